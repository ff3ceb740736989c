"""The cluster simulation (benchmarks/cluster_sim.py): real Schedulers on a
virtual clock, each step costing what the cost model says. Traces and coefficients are
drawn fresh each run (the seed is in every failure message); the checks are the ones that
hold for any draw: conservation, the cost model's own arithmetic for a lone request,
routing properties, saturation scaling, the fit, and the command line end to end."""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

import pytest

from benchmarks import cluster_sim as cs
from benchmarks.workload import BenchRequest
from vllm_lite.config import CacheConfig, SchedulerConfig

BLOCK = 16


def _seed() -> int:
    return random.SystemRandom().randrange(1 << 30)


def _configs(num_blocks: int = 2048, max_len: int = 2048,
             max_num_seqs: int = 64) -> tuple[SchedulerConfig, CacheConfig]:
    return (SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=max_len),
            CacheConfig(block_size=BLOCK, num_gpu_blocks=num_blocks, num_cpu_blocks=0,
                        enable_prefix_caching=True))


def _cost(rng: random.Random) -> cs.CostModel:
    return cs.CostModel(c0=rng.uniform(5e-3, 5e-2), c_prefill=rng.uniform(1e-5, 1e-3),
                        c_prefill_attn=rng.uniform(0, 1e-7), c_decode=rng.uniform(1e-4, 5e-3),
                        c_decode_ctx=rng.uniform(0, 1e-5))


def _trace(rng: random.Random, n: int, prompt: tuple[int, int], output: tuple[int, int],
           prefixes: list[tuple[int, ...]] = (), shared: float = 0.0) -> list[BenchRequest]:
    out = []
    for _ in range(n):
        own = tuple(rng.randrange(1000) for _ in range(rng.randint(*prompt)))
        head = rng.choice(prefixes) if prefixes and rng.random() < shared else ()
        out.append(BenchRequest(head + own, rng.randint(*output)))
    return out


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _run(requests, arrivals, replicas, policy, cost, **kw) -> cs.SimResult:
    sched, cache = _configs(**kw)
    return cs.simulate(requests, arrivals, replicas, policy, cost, sched, cache)


# -- the simulation ---------------------------------------------------------------------------
@pytest.mark.parametrize("burst", [False, True], ids=["poisson", "burst"])
@pytest.mark.parametrize("policy", cs.POLICIES)
def test_every_request_finishes_with_its_tokens(policy: str, burst: bool) -> None:
    """Small pools, so that runs preempt (recompute) and must still conserve every token;
    a burst of everything at once into 12 blocks always does."""
    seed = _seed()
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1000) for _ in range(rng.randint(16, 80))) for _ in range(3)]
    requests = _trace(rng, 60, (1, 60), (1, 24), prefixes, shared=0.6)
    if burst:
        arrivals, blocks, replicas = [0.0] * len(requests), 12, rng.randint(1, 2)
    else:
        arrivals = _poisson(rng, len(requests), rate=rng.uniform(5, 50))
        blocks, replicas = rng.randint(12, 40), rng.randint(1, 4)
    sched, cache = _configs(num_blocks=blocks, max_len=256, max_num_seqs=rng.choice([4, 16]))
    sim = cs.ClusterSim(replicas, policy, _cost(rng), sched, cache)
    res = sim.run(requests, arrivals, rate=1.0)
    if burst:
        assert res.preemptions > 0, seed
    assert res.finished == len(requests) and res.ignored == 0, seed
    assert res.output_tokens == sum(r.output_len for r in requests), seed
    for req, t, arrival in zip(requests, res.timings, arrivals):
        assert len(t.token_times) == req.output_len, seed
        assert arrival < t.token_times[0] and t.token_times == sorted(t.token_times), seed
    assert sum(p["requests"] for p in res.per_replica) == len(requests), seed
    assert sum(p["output_tokens"] for p in res.per_replica) == res.output_tokens, seed
    for rep in sim.replicas:
        # Drained: nothing queued, every block free (cached prefixes are free too), the
        # router's counts back to zero.
        st = rep.scheduler.stats()
        assert not rep.scheduler.has_unfinished_seqs(), seed
        assert st.device_blocks_free == st.device_blocks_total, seed
        assert rep.outstanding_requests == 0 and rep.outstanding_tokens == 0, seed
    assert 0 < res.kv_peak <= 1 and 0 < res.kv_mean <= res.kv_peak, seed
    assert 0 < res.utilization <= 1 + 1e-9, seed


def test_lone_request_times_are_the_cost_models() -> None:
    """TTFT and E2E of one request on an idle replica, summed by hand from the cost model;
    then the same prompt again, its full blocks now prefix-cache hits."""
    seed = _seed()
    rng = random.Random(seed)
    cost = _cost(rng)
    L, O = rng.randint(BLOCK + 2, 300), rng.randint(2, 40)
    prompt = tuple(rng.randrange(1000) for _ in range(L))
    t0 = rng.uniform(0, 10)

    def expected(cached: int) -> tuple[float, float]:
        n = L - cached
        ttft = cost.c0 + cost.c_prefill * n + cost.c_prefill_attn * (n * cached + n * (n + 1) / 2)
        # Decode i (1..O-1) reads the prompt and i output tokens.
        decode = sum(cost.c0 + cost.c_decode + cost.c_decode_ctx * (L + i) for i in range(1, O))
        return ttft, ttft + decode

    ttft, e2e = expected(0)
    gap = e2e + rng.uniform(0.1, 1.0)  # the second arrives after the first is done
    res = _run([BenchRequest(prompt, O)] * 2, [t0, t0 + gap], 1, "round_robin", cost)
    first, second = res.timings
    assert math.isclose(first.ttft, ttft, rel_tol=1e-9), seed
    assert math.isclose(first.e2e, e2e, rel_tol=1e-9), seed
    cached = (L - 1) // BLOCK * BLOCK  # at least one token is computed for its logits
    ttft2, e2e2 = expected(cached)
    assert math.isclose(second.ttft, ttft2, rel_tol=1e-9), seed
    assert math.isclose(second.e2e, e2e2, rel_tol=1e-9), seed
    assert res.prefix_hit_rate == pytest.approx(0.5 * cached / BLOCK / ((L - 1) // BLOCK)), seed


def test_prefix_aware_routing_gets_more_prefix_hits_than_round_robin() -> None:
    seed = _seed()
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1000) for _ in range(rng.randint(4, 8) * BLOCK))
                for _ in range(rng.randint(12, 24))]
    requests = _trace(rng, 160, (4, 40), (2, 12), prefixes, shared=0.9)
    arrivals = _poisson(rng, len(requests), rate=rng.uniform(10, 40))
    cost = _cost(rng)
    replicas = rng.randint(4, 6)
    rr = _run(requests, arrivals, replicas, "round_robin", cost)
    pa = _run(requests, arrivals, replicas, "prefix_aware", cost)
    assert pa.prefix_hit_rate > rr.prefix_hit_rate, (seed, pa.prefix_hit_rate, rr.prefix_hit_rate)


def test_least_load_balances_a_skewed_trace_better_than_round_robin() -> None:
    """Every R-th request is long: round robin sends all of them to one replica."""
    seed = _seed()
    rng = random.Random(seed)
    replicas = rng.randint(3, 5)
    requests = [BenchRequest(tuple(rng.randrange(1000) for _ in range(rng.randint(8, 40))),
                             rng.randint(80, 120) if i % replicas == 0 else rng.randint(1, 4))
                for i in range(24 * replicas)]
    arrivals = _poisson(rng, len(requests), rate=rng.uniform(2, 6) * replicas)
    cost = _cost(rng)
    rr = _run(requests, arrivals, replicas, "round_robin", cost)
    ll = _run(requests, arrivals, replicas, "least_load", cost)
    assert ll.imbalance < rr.imbalance, (seed, ll.imbalance, rr.imbalance)
    assert ll.duration_s < rr.duration_s, seed


@pytest.mark.parametrize("policy", cs.POLICIES)
def test_more_replicas_never_lower_saturated_throughput(policy: str) -> None:
    seed = _seed()
    rng = random.Random(seed)
    requests = _trace(rng, 96, (8, 64), (4, 32))
    cost = _cost(rng)
    # All queued at once: each count of replicas serves as fast as it can.
    runs = [_run(requests, [0.0] * len(requests), n, policy, cost, max_num_seqs=16)
            for n in (1, 2, 4, 8)]
    speeds = [r.output_tokens_per_s for r in runs]
    assert all(b >= a for a, b in zip(speeds, speeds[1:])), (seed, speeds)
    assert runs[0].sustained_tokens_per_s is None  # no arrival span to sustain a rate over


def test_rate_scaled_per_replica_keeps_the_per_replica_load() -> None:
    """The same unit trace at rate x replicas: each replica sees about one replica's load."""
    seed = _seed()
    rng = random.Random(seed)
    requests = _trace(rng, 200, (8, 32), (2, 8))
    unit = _poisson(rng, len(requests), 1.0)
    cost = cs.CostModel(c0=0.01, c_prefill=1e-4, c_prefill_attn=0, c_decode=1e-3, c_decode_ctx=0)
    res = {n: _run(requests, [t / (2.0 * n) for t in unit], n, "least_load", cost) for n in (1, 4)}
    assert res[4].duration_s < res[1].duration_s / 2, seed
    assert res[4].utilization == pytest.approx(res[1].utilization, abs=0.25), seed


# -- the cost model and its fit -----------------------------------------------------------------
def test_fit_recovers_a_known_cost_model() -> None:
    seed = _seed()
    rng = random.Random(seed)
    true = _cost(rng)
    samples = []
    for _ in range(40):
        if rng.random() < 0.5:
            n, c = rng.randint(1, 1024), rng.choice([0, 0, rng.randint(1, 512)])
            f = (n, n * c + n * (n + 1) / 2, rng.choice([0, rng.randint(1, 32)]), 0)
            f = (*f[:3], f[2] * rng.randint(1, 512))
        else:
            d = rng.randint(1, 64)
            f = (0, 0, d, d * rng.randint(1, 1024))
        samples.append(cs.Sample(tuple(float(x) for x in f), true.predict(f)))
    fit = cs.fit_cost_model(samples)
    for name, value in vars(true).items():
        assert getattr(fit.cost, name) == pytest.approx(value, rel=1e-6, abs=1e-15), (seed, name)
    assert fit.r2 == pytest.approx(1.0) and fit.median_rel_error < 1e-6, seed
    assert fit.dropped == (), seed
    # Noise never yields a negative coefficient.
    noisy = [cs.Sample(s.features, s.seconds * rng.uniform(0.7, 1.3)) for s in samples]
    assert min(vars(cs.fit_cost_model(noisy).cost).values()) >= 0, seed
    # Steps slowed by other jobs (2-4x, a few of them) are left out: the fit is exact again.
    slowed = rng.sample(range(len(samples)), 6)
    contended = [cs.Sample(s.features, s.seconds * (rng.uniform(2, 4) if i in slowed else 1))
                 for i, s in enumerate(samples)]
    fit = cs.fit_cost_model(contended)
    assert sorted(fit.dropped) == sorted(slowed), seed
    assert fit.cost.c0 == pytest.approx(true.c0, rel=1e-6) and fit.r2 == pytest.approx(1.0), seed
    assert cs.fit_cost_model(contended, slow_factor=None).dropped == ()


def test_bursty_arrivals_are_burstier_than_poisson() -> None:
    seed = _seed()
    rate, cv = random.Random(seed).uniform(0.5, 20), 3.0
    times = cs.gamma_arrivals(20000, rate, cv, seed)
    gaps = [b - a for a, b in zip([0.0] + times, times)]
    mean = sum(gaps) / len(gaps)
    sd = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps))
    assert mean == pytest.approx(1 / rate, rel=0.15), seed
    assert sd / mean > 2.0, seed


# -- the command line ---------------------------------------------------------------------------
def _calibration_file(folder: Path, rng: random.Random) -> Path:
    samples = [cs.Sample((float(p), p * (p + 1) / 2, 0.0, 0.0), 0.01 + 1e-4 * p)
               for p in (8, 64, 256)]
    cal = cs.Calibration(fit=cs.Fit(_cost(rng), 0.99, 0.02), samples=samples, model="test",
                         device="cpu", dtype="float32", threads=1,
                         engine={"block_size": BLOCK, "num_gpu_blocks": 512, "max_model_len": 512,
                                 "max_num_seqs": 32, "vocab_size": 1000})
    return cal.save(folder / "cal.json")


def test_cli_writes_md_json_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    seed = _seed()
    cal = _calibration_file(tmp_path, random.Random(seed))
    out = tmp_path / "out"
    argv = ["--calibration", str(cal), "--replicas", "1,3", "--num-requests", "40",
            "--input-len", "4-40", "--output-len", "2-10", "--prefix-len", "32",
            "--num-prefixes", "3", "--arrival", "bursty", "--seed", str(seed), "--out", str(out),
            "--block-size", str(BLOCK), "--max-num-seqs", "32", "--no-progress"]
    assert cs.main(argv) == 0, seed
    md = list(out.glob("cluster_sim_*.md"))
    assert len(md) == 1, seed
    stem = md[0].stem
    assert (out / f"{stem}_scaling.png").stat().st_size > 0
    assert (out / f"{stem}_calibration.png").stat().st_size > 0
    data = json.loads((out / f"{stem}.json").read_text())
    results = data["results"]
    assert [(r["policy"], r["replicas"]) for r in results] == [
        (p, n) for n in (1, 3) for p in cs.POLICIES], seed
    for r in results:
        assert r["finished"] == 40 and r["output_tokens"] == data["trace"]["output_tokens"], seed
    assert data["calibration"]["coefficients"] and data["saturated_rate_one_replica"] > 0
    printed = capsys.readouterr().out
    assert "| prefix_aware | 3 |" in printed and "R^2" in printed


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cs.add_arguments(p)
    args = p.parse_args(argv)
    cs.resolve_args(args)
    return args


def test_calibrate_on_the_real_engine_and_reuse_it(tmp_path: Path) -> None:
    """--calibrate measures a real LLM (a tiny random Llama built by the module) and saves
    the fit; without either calibration flag the saved one is found again."""
    pytest.importorskip("transformers")
    model = cs.tiny_random_llama(tmp_path / "model", max_len=1024)
    out = tmp_path / "out"
    common = ["--model", str(model), "--kv-cache-space", "0.01", "--threads", "1",
              "--out", str(out), "--no-progress", "--quick"]
    cal = cs.obtain_calibration(_parse(["--calibrate"] + common), "cluster_sim_test")
    assert cal.path == out / "cluster_sim_test_calibration.json" and cal.path.is_file()
    assert len(cal.samples) >= 10 and math.isfinite(cal.fit.r2)
    assert cal.cost.predict((100.0, 5050.0, 0.0, 0.0)) > 0
    assert cal.engine["vocab_size"] == 512 and cal.request["model"] == str(model)
    assert cal.engine["max_model_len"] == 1024  # the model's limit
    # Prefill-only, decode-only and mixed steps were all measured.
    kinds = {(s.features[0] > 0, s.features[2] > 0) for s in cal.samples}
    assert kinds == {(True, False), (False, True), (True, True)}, kinds
    again = cs.obtain_calibration(_parse(common), "cluster_sim_later")
    assert again.path == cal.path and again.cost == cal.cost
    assert not (out / "cluster_sim_later_calibration.json").exists()
    # Another model is not served the first one's calibration: it is measured.
    other = cs.find_saved_calibration(out, _parse(common[2:] + ["--model", "elsewhere"]))
    assert other is None


@pytest.mark.parametrize("argv,option", [
    (["--policies", "round_robin,fastest"], "--policies"),
    (["--shared-prefix-fraction", "1.5"], "--shared-prefix-fraction"),
    (["--arrival", "bursty", "--cv", "0.5"], "--cv"),
    (["--load-bound", "0.9"], "--load-bound"),
    (["--rate", "0"], "--rate"),
    (["--output-len", "2000", "--input-len", "8"], "--max-model-len"),
    (["--calibration", "/nonexistent/cal.json"], "--calibration"),
])
def test_bad_arguments_name_the_option(tmp_path: Path, argv: list[str], option: str,
                                       capsys: pytest.CaptureFixture) -> None:
    cal = _calibration_file(tmp_path, random.Random(_seed()))
    if "--calibration" not in argv:
        argv = argv + ["--calibration", str(cal)]
    assert cs.main(argv + ["--out", str(tmp_path / "out"), "--no-progress", "--quick"]) == 2
    err = capsys.readouterr().err
    assert option in err and "Traceback" not in err, err


@pytest.mark.parametrize("argv,option", [
    (["--arrival", "zipf"], "--arrival"),
    (["--replicas", "0,2"], "--replicas"),
    (["--calibrate", "--calibration", "x.json"], "--calibration"),
])
def test_unparsable_arguments_exit_2(argv: list[str], option: str,
                                     capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as e:
        cs.main(argv)
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_simulate_rejects_a_bad_policy_and_trace() -> None:
    sched, cache = _configs()
    cost = cs.CostModel(0.01, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="policy"):
        cs.simulate([BenchRequest((1, 2), 1)], [0.0], 2, "random", cost, sched, cache)
    with pytest.raises(ValueError, match="arrival"):
        cs.simulate([BenchRequest((1, 2), 1)] * 2, [1.0, 0.0], 2, "least_load", cost, sched, cache)
    with pytest.raises(ValueError, match="c_decode"):
        cs.CostModel(0.01, 0, 0, -1.0, 0)


def test_add_arguments_defaults_come_from_the_engine() -> None:
    """The replicas' scheduler settings default to EngineArgs' defaults (not restated)."""
    from vllm_lite.config import EngineArgs

    p = argparse.ArgumentParser()
    cs.add_arguments(p)
    args = p.parse_args([])
    for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "scheduling_policy",
                 "enable_chunked_prefill", "preemption_mode"):
        assert getattr(args, name) == EngineArgs.defaults()[name], name
