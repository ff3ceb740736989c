"""Smoke tests of the engine benchmarks on a tiny random Llama: the code paths of
throughput and latency run end to end, and their reports are consistent with the workload.
No timing is asserted (the machine may be shared)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

# tests/ is on sys.path (pytest puts the first folder without __init__.py there).
from models.helpers import make_config, save_hf_model  # noqa: E402
from benchmarks import engines as E  # noqa: E402
from benchmarks import latency, throughput  # noqa: E402
from benchmarks.workload import BenchRequest, WorkloadConfig, make_workload  # noqa: E402

VOCAB = 160  # tests/models/helpers.py BASE


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("bench_llama")
    save_hf_model(make_config("llama"), folder)
    return folder


def _args(parser_module, *argv: str):
    import argparse

    p = argparse.ArgumentParser()
    parser_module.add_arguments(p)
    return p.parse_args(list(argv))


# -- workload -----------------------------------------------------------------------------------
def test_workload_is_seeded_and_in_range() -> None:
    cfg = WorkloadConfig(num_requests=50, input_len=(3, 9), output_len=(2, 5), seed=7)
    a, b = make_workload(cfg, VOCAB), make_workload(cfg, VOCAB)
    assert a == b
    assert a != make_workload(WorkloadConfig(50, (3, 9), (2, 5), seed=8), VOCAB)
    assert all(3 <= r.prompt_len <= 9 and 2 <= r.output_len <= 5 for r in a)
    assert all(0 <= t < VOCAB for r in a for t in r.prompt_token_ids)
    # Both ends of the ranges are drawn (closed ranges).
    assert {r.prompt_len for r in a} >= {3, 9}


def test_workload_shared_prefixes() -> None:
    cfg = WorkloadConfig(num_requests=6, input_len=(2, 4), output_len=(1, 1), seed=1,
                         shared_prefix_len=5, num_prefixes=2)
    reqs = make_workload(cfg, VOCAB)
    heads = [r.prompt_token_ids[:5] for r in reqs]
    assert heads[0] == heads[2] == heads[4] and heads[1] == heads[3] == heads[5]
    assert heads[0] != heads[1]
    assert all(7 <= r.prompt_len <= 9 for r in reqs)


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(input_len=(5, 4)),
                                 dict(output_len=(0, 3)), dict(num_prefixes=0)])
def test_workload_rejects_bad_config(bad) -> None:
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)


# -- KV accounting ------------------------------------------------------------------------------
def test_static_batch_kv_counts_padding_and_finished_rows() -> None:
    batch = [BenchRequest((1, 2), 1), BenchRequest((1, 2, 3, 4), 3)]
    stats = E.KVStats(bytes_per_slot=10)
    E.static_batch_kv(batch, stats)
    # 2 rows x (longest prompt 4 + most new tokens 3) slots for 3 steps; live: both prompts
    # (6), then each row's generated tokens up to its own length.
    assert stats.steps == 3
    assert stats.allocated_slot_steps == 3 * 14
    assert stats.live_slot_steps == 6 + (6 + 1 + 1) + (6 + 1 + 2)
    assert math.isclose(stats.waste, 1 - 23 / 42)
    assert stats.peak_allocated_slots == 14 and stats.peak_live_slots == 9


def test_equal_memory_batch_size() -> None:
    reqs = [BenchRequest((1,) * 10, 2), BenchRequest((1,) * 3, 6)]  # rows of 10 + 6 slots
    assert E.equal_memory_batch_size(reqs, 16 * 100 * 5, bytes_per_token=100, cap=64) == 5
    assert E.equal_memory_batch_size(reqs, 16 * 100 * 5 - 1, bytes_per_token=100, cap=64) == 4
    assert E.equal_memory_batch_size(reqs, 16 * 100 * 5, bytes_per_token=100, cap=3) == 3
    assert E.equal_memory_batch_size(reqs, 1, bytes_per_token=100, cap=64) == 1


# -- throughput -----------------------------------------------------------------------------------
def test_throughput_report_is_consistent(model_dir: Path, tmp_path: Path) -> None:
    args = _args(throughput, "--model", str(model_dir), "--num-requests", "3",
                 "--input-len", "4-12", "--output-len", "2-6", "--hf-batch-size", "2",
                 "--sweep-requests", "2", "--block-size-sweep", "4,8",
                 "--max-num-seqs-sweep", "1", "--prefix-requests", "3", "--prefix-len", "8",
                 "--num-prefixes", "1", "--prefix-input-len", "1-3", "--prefix-output-len", "2",
                 "--block-size", "4", "--kv-cache-space", "0.01", "--out", str(tmp_path),
                 "--engines", "vllm_lite,hf_generate", "--no-progress",
                 "--goal", "hf_generate=0.001", "--goal", "hf_generate_batch=2",
                 "--goal-kv-waste", "1")
    report = throughput.run(args)
    report.save()
    data = json.loads((tmp_path / f"{report.stem}.json").read_text())
    # Goals only as given: one line each, the engine left out of --engines not run.
    hf_goal, batch_goal, kv_goal = data["goals"]
    assert hf_goal.startswith("- vllm_lite vs hf_generate:") and hf_goal.endswith(": met")
    assert batch_goal == "- vllm_lite vs hf_generate_batch: n/a (not run); goal >= 2.0x"
    assert kv_goal.startswith("- vllm_lite KV waste at block size 4:") and kv_goal.endswith(": met")
    requests = make_workload(WorkloadConfig(3, (4, 12), (2, 6), seed=0), VOCAB)
    wanted = sum(r.output_len for r in requests)
    ours, hf = data["engines"]
    assert ours["engine"] == "vllm_lite" and hf["engine"] == "hf_generate"
    for run in (ours, hf):
        assert run["output_tokens"] == wanted
        assert run["prompt_tokens"] == sum(r.prompt_len for r in requests)
        assert 0.0 <= run["kv"]["waste"] <= 1.0
        assert run["kv"]["peak_live_slots"] <= run["kv"]["peak_allocated_slots"]
        assert run["output_tokens_per_s"] > 0
        assert run["cpu_share"] > 0  # CPU runs report how much of the cores they got
    assert ours["generated_tokens"] == wanted  # no padding, no past-length tokens
    # HF's static batches run every row to the batch's longest output.
    batches = [requests[:2], requests[2:]]
    assert hf["generated_tokens"] == sum(len(b) * max(r.output_len for r in b) for b in batches)
    assert [r["settings"]["block_size"] for r in data["block_size_sweep"]] == [4, 8]
    assert all(r["output_tokens"] == sum(q.output_len for q in requests[:2])
               for r in data["block_size_sweep"] + data["max_num_seqs_sweep"])
    off, on = data["prefix_caching"]["runs"]
    # 8-token prefix = two full 4-token blocks shared by all three prompts; at least the
    # requests after the first find them.
    assert off["prefix_hit_rate"] is None or off["prefix_hit_rate"] == 0
    assert 0 < on["prefix_hit_rate"] <= 1
    md = (tmp_path / f"{report.stem}.md").read_text()
    assert "| vllm_lite |" in md and "### Goals" in md
    for fig in report.figures:
        assert fig.is_file() and fig.stat().st_size > 0


def test_throughput_tensor_parallel_rows(model_dir: Path, tmp_path: Path) -> None:
    """--tensor-parallel-size 1,2: the main workload again on 2 ranks, every token, with
    rank 0's collective time measured."""
    args = _args(throughput, "--model", str(model_dir), "--num-requests", "3",
                 "--input-len", "4-12", "--output-len", "2-6", "--no-sweeps",
                 "--block-size", "4", "--kv-cache-space", "0.01", "--out", str(tmp_path),
                 "--engines", "vllm_lite", "--no-progress", "--tensor-parallel-size", "1,2")
    report = throughput.run(args)
    report.save()
    data = json.loads((tmp_path / f"{report.stem}.json").read_text())
    wanted = sum(r.output_len for r in make_workload(WorkloadConfig(3, (4, 12), (2, 6), seed=0),
                                                     VOCAB))
    (ours,), (tp2,) = data["engines"], data["tensor_parallel"]
    assert ours["settings"]["tensor_parallel_size"] == 1 and ours["settings"]["comm_s"] == 0
    assert tp2["settings"]["tensor_parallel_size"] == 2 and tp2["output_tokens"] == wanted
    assert 0 < tp2["settings"]["comm_s"] < tp2["elapsed_s"]
    md = (tmp_path / f"{report.stem}.md").read_text()
    assert "## Tensor parallel" in md and "all-reduce share" in md


def test_throughput_repeats_report_the_median_run(model_dir: Path, tmp_path: Path) -> None:
    """--repeats 3: each engine's timed run three times; the table's row is the run with
    the median time (its tok/s is the middle of the three listed), every run complete."""
    args = _args(throughput, "--model", str(model_dir), "--num-requests", "3",
                 "--input-len", "4-12", "--output-len", "2-6", "--no-sweeps", "--repeats", "3",
                 "--hf-batch-size", "2", "--block-size", "4", "--kv-cache-space", "0.01",
                 "--out", str(tmp_path), "--engines", "vllm_lite,hf_generate",
                 "--no-progress")
    report = throughput.run(args)
    report.save()
    data = json.loads((tmp_path / f"{report.stem}.json").read_text())
    wanted = sum(r.output_len for r in make_workload(WorkloadConfig(3, (4, 12), (2, 6), seed=0),
                                                     VOCAB))
    for run in data["engines"]:
        speeds = run["settings"]["repeat_output_tok_s"]
        assert len(speeds) == 3 and run["output_tokens"] == wanted
        assert run["output_tokens_per_s"] == pytest.approx(sorted(speeds)[1], rel=1e-3)
    md = (tmp_path / f"{report.stem}.md").read_text()
    assert "ran the workload 3 times back to back" in md
    with pytest.raises(ValueError, match="--repeats must be >= 1"):
        throughput.run(_args(throughput, "--model", str(model_dir), "--repeats", "0",
                             "--out", str(tmp_path)))


def test_median_run_picks_the_middle_time_and_stops_at_a_failure() -> None:
    times = iter([3.0, 1.0, 2.0, 5.0])
    mid = E.median_run(lambda: E.RunResult("x", 1, elapsed_s=next(times), output_tokens=6), 3)
    assert mid.elapsed_s == 2.0 and mid.settings["repeat_output_tok_s"] == [2.0, 6.0, 3.0]
    calls = []

    def failing() -> E.RunResult:
        calls.append(1)
        return E.RunResult("x", 1, error="boom")

    assert E.median_run(failing, 4).error == "boom" and len(calls) == 1
    one = E.median_run(lambda: E.RunResult("x", 1, elapsed_s=1.0), 1)
    assert "repeat_output_tok_s" not in one.settings


def test_throughput_goals_are_the_ones_given() -> None:
    """No goal unless one is given; each given goal met or missed by its own ratio."""
    kv = E.KVStats(bytes_per_slot=1)
    live = int(torch.randint(90, 99, ()).item())
    kv.add(100, live)
    ours = E.RunResult(E.VLLM_LITE, 1, elapsed_s=1.0, kv=kv, settings={"block_size": 16},
                       output_tokens=int(torch.randint(50, 150, ()).item()))
    peer = E.RunResult(E.HF_STATIC, 1, elapsed_s=1.0, output_tokens=100)
    ratio = ours.output_tokens_per_s / peer.output_tokens_per_s
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    assert throughput.goals(ours, [peer], parser.parse_args([])) == []
    args = parser.parse_args(["--goal", f"hf_generate={ratio + 0.01}", "--goal",
                              f"hf_generate={ratio - 0.01}", "--goal-kv-waste", "0.05"])
    lines = throughput.goals(ours, [peer], args)
    assert [line.rsplit(": ", 1)[-1] for line in lines] == [
        "MISSED", "met", "met" if (100 - live) / 100 < 0.05 else "MISSED"]
    assert lines[2].startswith("- vllm_lite KV waste at block size 16:")


@pytest.mark.parametrize("bad", ["hf_generate", "hf_generate=0", "hf_generate=x",
                                 "vllm_lite=2", "nope=2", "=2", "hf_generate=inf"])
def test_throughput_refuses_a_bad_goal(bad: str, capsys) -> None:
    parser = argparse.ArgumentParser()
    throughput.add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--goal", bad])
    assert "--goal" in capsys.readouterr().err


def test_hf_generate_batch_runs_or_says_why(model_dir: Path) -> None:
    import torch

    model = E.load_hf_model(model_dir, torch.float32, torch.device("cpu"))
    requests = make_workload(WorkloadConfig(2, (3, 6), (2, 4), seed=3), VOCAB)
    res = E.run_hf_continuous(model, requests, kv_budget_bytes=1 << 20, max_num_seqs=4)
    import transformers.generation.configuration_utils as cu

    if not hasattr(cu, "ContinuousBatchingConfig"):  # a transformers without it says so
        assert not res.ok and res.error
        return
    # Where transformers has continuous batching it must run, whichever version's field
    # names (5.17's block_size, later page_size) it has.
    assert res.ok, res.error
    assert res.output_lens == [r.output_len for r in requests]
    assert res.output_tokens == res.generated_tokens
    assert isinstance(res.settings["page_size"], int) and res.settings["page_size"] > 0
    assert res.settings["num_blocks"] >= 1


# -- latency ------------------------------------------------------------------------------------
def test_latency_report_is_consistent(model_dir: Path, tmp_path: Path) -> None:
    args = _args(latency, "--model", str(model_dir), "--prompt-len", "6", "--output-len", "4",
                 "--iters", "2", "--num-requests", "3", "--request-rate", "50",
                 "--rate-input-len", "3-8", "--rate-output-len", "2-5", "--hf-batch-size", "2",
                 "--kv-cache-space", "0.01", "--out", str(tmp_path), "--no-progress")
    report = latency.run(args)
    report.save()
    data = json.loads((tmp_path / f"{report.stem}.json").read_text())
    rate_requests = make_workload(WorkloadConfig(3, (3, 8), (2, 5), seed=2), VOCAB)
    for engine in ("vllm_lite", "hf_generate"):
        b1 = data["batch1"][engine]
        assert len(b1["requests"]) == 2
        assert all(len(r["token_times"]) == 4 for r in b1["requests"])
        rate = data["rate"][engine]
        for req, timing in zip(rate_requests, rate["requests"]):
            times = timing["token_times"]
            assert len(times) == req.output_len
            assert times == sorted(times) and times[0] >= timing["arrival"]
        for key in ("ttft", "tpot", "itl", "e2e"):
            st = rate["stats"][key]
            assert 0 <= st["p50"] <= st["p95"] <= st["p99"]
    assert "Batch 1" in (tmp_path / f"{report.stem}.md").read_text()


def test_cli_rejects_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_lite.entrypoints.cli import main

    assert main(["bench", "throughput", "--model", str(tmp_path / "missing"),
                 "--out", str(tmp_path)]) == 2
    assert "error" in capsys.readouterr().err
    assert main(["bench", "latency", "--engines", "hf_generate", "--out", str(tmp_path)]) == 2


# -- llama.cpp peer ---------------------------------------------------------------------------------
def test_llama_cpp_is_a_throughput_peer_only(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from vllm_lite.entrypoints.cli import main

    assert main(["bench", "latency", "--engines", "vllm_lite,llama_cpp",
                 "--out", str(tmp_path)]) == 2
    assert "llama_cpp" in capsys.readouterr().err


def test_llama_cpp_without_a_build_says_how_to_get_one(tmp_path: Path, monkeypatch) -> None:
    from benchmarks import llama_cpp

    monkeypatch.setattr(llama_cpp, "PEERS_ROOT", tmp_path / "none")
    with pytest.raises(ValueError, match="benchmarks/peers/llama_cpp.sh"):
        llama_cpp.find_bin(None)
    with pytest.raises(ValueError, match="has no llama-server"):
        llama_cpp.find_bin(str(tmp_path))
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "llama-server").write_text("")
    with pytest.raises(ValueError, match="no BF16 GGUF"):
        llama_cpp.model_file(tmp_path / "bin", "bfloat16")


def _llama_build() -> Path | None:
    from benchmarks import llama_cpp

    try:
        return llama_cpp.find_bin(None)
    except ValueError:
        return None


@pytest.mark.skipif(_llama_build() is None, reason="no llama.cpp build (benchmarks/peers/llama_cpp.sh)")
def test_llama_server_generates_every_requested_token(tmp_path: Path, monkeypatch) -> None:
    """The real server (a build of benchmarks/peers/llama_cpp.sh): every request gets exactly its
    output length, greedy, EOS ignored, all sent at once to fewer slots than requests."""
    from benchmarks import llama_cpp

    bin_dir = _llama_build()
    gguf = llama_cpp.model_file(bin_dir, "float32")
    requests = make_workload(WorkloadConfig(5, (4, 20), (3, 9), seed=7), 49152)
    erased = []
    real_erase = llama_cpp.LlamaServer.erase_slots

    def spy(self, timeout: float) -> None:
        erased.append(self.port)
        real_erase(self, timeout)

    monkeypatch.setattr(llama_cpp.LlamaServer, "erase_slots", spy)
    res = llama_cpp.run_llama_cpp(bin_dir, gguf, requests, threads=1, slots=3,
                                  log_path=tmp_path / "server.log", precision="float32",
                                  repeats=2)
    assert len(res.settings["repeat_output_tok_s"]) == 2  # two timed runs on one server
    assert len(erased) == 2 and len(set(erased)) == 1  # before each timed run, one server
    assert res.ok and res.output_lens == [r.output_len for r in requests]
    assert res.output_tokens == sum(r.output_len for r in requests)
    assert res.settings["slots"] == 3 and res.elapsed_s > 0


@pytest.mark.skipif(_llama_build() is None, reason="no llama.cpp build (benchmarks/peers/llama_cpp.sh)")
def test_llama_server_erase_slots_empties_their_cache(tmp_path: Path) -> None:
    """A finished request's tokens stay in its slot (and its KV in the unified cache) until
    erase_slots, which the benchmark calls before every timed run."""
    import json
    import urllib.request

    from benchmarks import llama_cpp

    bin_dir = _llama_build()
    gguf = llama_cpp.model_file(bin_dir, "float32")
    prompt = [int(t) for t in torch.randint(10, 49152, (int(torch.randint(6, 20, ())),))]

    with llama_cpp.LlamaServer(bin_dir, gguf, 2, 128, 1, tmp_path / "server.log") as server:
        def cached() -> list[int]:
            with urllib.request.urlopen(server.url + "/slots", timeout=30) as r:
                return [int(s.get("n_prompt_tokens", 0)) for s in json.loads(r.read())]

        assert server.complete(BenchRequest(prompt, 3), 60) == 3
        assert max(cached()) >= len(prompt)
        server.erase_slots(60)
        assert cached() == [0, 0]


def _crashing_server(bin_dir: Path, calls: Path, then: str) -> None:
    """A llama-server stand-in in bin_dir that logs its arguments to calls, kills itself
    with SIGSEGV (as ggml's AMX kernels do while loading on some CPUs) unless given
    --no-repack, and then runs `then`."""
    bin_dir.mkdir()
    script = bin_dir / "llama-server"
    script.write_text("#!/bin/sh\n"
                      f'echo "$@" >> "{calls}"\n'
                      'case " $* " in *" --no-repack "*) ;; *) kill -SEGV $$ ;; esac\n'
                      f"{then}\n")
    script.chmod(0o755)


def test_llama_server_crash_while_loading_retried_once_with_no_repack(tmp_path: Path) -> None:
    """A server killed by a signal before /health answers is started once more with
    --no-repack; a second failure (here exit status 3) is raised, not retried again."""
    from benchmarks import llama_cpp

    calls = tmp_path / "calls"
    _crashing_server(tmp_path / "bin", calls, "exit 3")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"")
    requests = make_workload(WorkloadConfig(2, (4, 8), (2, 3), seed=1), 100)
    with pytest.raises(llama_cpp.ServerExited, match="exited with 3") as err:
        llama_cpp.run_llama_cpp(tmp_path / "bin", gguf, requests, threads=1, slots=2,
                                log_path=tmp_path / "server.log")
    assert err.value.returncode == 3
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and "--no-repack" not in lines[0].split()
    assert lines[1].split()[-1] == "--no-repack"


@pytest.mark.skipif(_llama_build() is None, reason="no llama.cpp build (benchmarks/peers/llama_cpp.sh)")
def test_llama_server_run_after_a_crash_says_so(tmp_path: Path) -> None:
    """The restarted real server runs the workload, and the result names the flag."""
    from benchmarks import llama_cpp

    real = _llama_build()
    _crashing_server(tmp_path / "bin", tmp_path / "calls", f'exec "{real}/llama-server" "$@"')
    gguf = llama_cpp.model_file(real, "float32")
    requests = make_workload(WorkloadConfig(3, (4, 12), (2, 5), seed=3), 49152)
    before = _llama_server_pids()
    res = llama_cpp.run_llama_cpp(tmp_path / "bin", gguf, requests, threads=1, slots=3,
                                  log_path=tmp_path / "server.log", precision="float32")
    assert res.ok and res.output_lens == [r.output_len for r in requests]
    assert res.settings["extra_args"] == ["--no-repack"] and "--no-repack" in res.note
    assert res.cpu_share is not None and res.cpu_share > 0  # read off the server that ran
    assert _llama_server_pids() <= before  # the server it started is stopped


def _llama_server_pids() -> set[int]:
    pids = set()
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"llama-server" in (d / "cmdline").read_bytes():
                pids.add(int(d.name))
        except OSError:
            pass
    return pids
