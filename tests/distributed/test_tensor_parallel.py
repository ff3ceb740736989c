"""Tensor parallelism on the CPU (gloo): real worker processes on tiny random checkpoints.

Every greedy output must equal the unsplit engine's (tensor_parallel_size 1, same options)
and HF transformers'; the features that move KV blocks (prefix caching, chunked prefill,
preemption by swap and by recompute, n > 1, beam search) and prompt logprobs (rows of a
prefill gathered over the vocabulary) run across the ranks; a worker
that dies or hangs fails the engine with a clear error and leaves no process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entrypoints.utils import cli_env, free_port  # noqa: E402
from models.helpers import assert_all_free, hf_greedy, make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.errors import DistributedError  # noqa: E402

VOCAB = 320
MAX_TOKENS = 10
PROMPT_LENS = [3, 9, 17, 30]


def _prompts(seed: int = 0, lens: list[int] = PROMPT_LENS) -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(1, 300, (n,), generator=gen).tolist()}
            for n in lens]


def _hf_greedy(hf_model: Any, prompt: list[int]) -> list[int]:
    return hf_greedy(hf_model, prompt, MAX_TOKENS)


def _ckpt(tmp_path_factory: pytest.TempPathFactory, name: str, **overrides: Any):
    config = make_config(name)
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    for k, v in overrides.items():
        setattr(config, k, v)
    folder = tmp_path_factory.mktemp(f"tp_{name}")
    hf_model = save_hf_model(config, folder)
    return folder, hf_model


@pytest.fixture(scope="module")
def bias_ckpt(tmp_path_factory: pytest.TempPathFactory):
    """4 heads / 2 KV heads, biases on q/k/v, o_proj and the MLP (row-parallel biases must
    be added once), linear rope scaling."""
    return _ckpt(tmp_path_factory, "llama_linear_bias")


def _llm(folder: Path, tp: int, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_space", 0.01)
    kw.setdefault("swap_space", 0.01)
    kw.setdefault("distributed_timeout", 60)
    return LLM(str(folder), dtype="float32", device="cpu", tensor_parallel_size=tp, **kw)


def _ids(outs: list[Any]) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def _worker_procs(llm: LLM) -> list[subprocess.Popen]:
    return list(llm.llm_engine.executor.ranks.procs.values())


def _assert_gone(procs: list[subprocess.Popen], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        p.wait(max(0.1, deadline - time.monotonic()))
        assert p.returncode is not None




# Prefix caching + chunked prefill + a pool small enough that sequences are preempted.
ENGINE_OPTIONS = dict(enable_prefix_caching=True, enable_chunked_prefill=True,
                      max_num_batched_tokens=8, max_num_seqs=4, num_gpu_blocks_override=14)


def test_tp2_equals_tp1_and_hf_across_scheduler_features(bias_ckpt) -> None:
    folder, hf_model = bias_ckpt
    prompts = _prompts()
    hf = [[_hf_greedy(hf_model, p["prompt_token_ids"])] for p in prompts]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    sampled = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=MAX_TOKENS,
                             logprobs=2)
    beams = SamplingParams(n=2, best_of=3, use_beam_search=True, temperature=0.0,
                           max_tokens=6, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = _llm(folder, tp, **ENGINE_OPTIONS)
        procs = _worker_procs(llm) if tp > 1 else []
        assert len(procs) == tp - 1 and all(p.poll() is None for p in procs)
        first = llm.generate(prompts, greedy, use_tqdm=False)
        again = llm.generate(prompts[2:], greedy, use_tqdm=False)  # prefix-cache hits
        # Two n=2 groups at a time (max_num_seqs 4) outgrow the pool: one is swapped out.
        n2 = llm.generate(_prompts(4, [9, 10, 11, 12]), sampled, use_tqdm=False)
        beam = llm.generate(prompts[1:3], beams, use_tqdm=False)
        plp = llm.generate(prompts[1:2], SamplingParams(temperature=0.0, max_tokens=2,
                                                        prompt_logprobs=1), use_tqdm=False)
        sched = llm.llm_engine.scheduler
        assert sched.prefix_cache_stats.hits > 0
        assert sched.num_preemptions["recompute"] > 0, "the pool must force preemptions"
        assert sched.num_preemptions["swap"] > 0, "n > 1 must be swapped out"
        assert_all_free(llm)
        results[tp] = dict(first=_ids(first), again=_ids(again), n2=_ids(n2), beam=_ids(beam),
                           logprobs=[[c.cumulative_logprob for c in o.outputs] for o in n2],
                           prompt_logprobs=[d[t].logprob for d, t in zip(
                               plp[0].prompt_logprobs[1:], plp[0].prompt_token_ids[1:])])
        llm.shutdown()
        _assert_gone(procs)
    assert results[2]["first"] == results[1]["first"] == hf
    assert results[2]["again"] == hf[2:]
    for key in ("n2", "beam"):
        assert results[2][key] == results[1][key], key
    assert len(results[2]["prompt_logprobs"]) == len(prompts[1]["prompt_token_ids"]) - 1
    torch.testing.assert_close(torch.tensor(results[2]["prompt_logprobs"]),
                               torch.tensor(results[1]["prompt_logprobs"]), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(torch.tensor(results[2]["logprobs"]),
                               torch.tensor(results[1]["logprobs"]), rtol=1e-4, atol=1e-4)


def test_tp3_nine_heads_three_kv_heads_like_the_default_model(tmp_path_factory) -> None:
    """9 / 3 heads over 3 ranks (one KV head each), a vocabulary that 3 does not divide
    (320: padded to 321)."""
    folder, hf_model = _ckpt(tmp_path_factory, "llama", hidden_size=144,
                             num_attention_heads=9, num_key_value_heads=3,
                             intermediate_size=96, tie_word_embeddings=True)
    prompts = _prompts(1, [5, 21])
    hf = [[_hf_greedy(hf_model, p["prompt_token_ids"])] for p in prompts]
    llm = _llm(folder, 3)
    procs = _worker_procs(llm)
    assert len(procs) == 2
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert _ids(outs) == hf
    llm.shutdown()
    _assert_gone(procs)


def test_kv_heads_replicated_when_ranks_outnumber_them(tmp_path_factory) -> None:
    """Qwen3 (per-head q/k norms) with 1 KV head over 2 ranks: each holds a copy."""
    folder, hf_model = _ckpt(tmp_path_factory, "qwen3")
    prompts = _prompts(2, [7, 12])
    hf = [[_hf_greedy(hf_model, p["prompt_token_ids"])] for p in prompts]
    llm = _llm(folder, 2)
    attn = llm.llm_engine.model.model.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                        use_tqdm=False)
    assert _ids(outs) == hf
    llm.shutdown()


def test_int8_shards_are_the_rows_of_the_unsplit_quantization(bias_ckpt) -> None:
    """Column-parallel shards quantize per output row, so rank 0's int8 q/k/v rows equal
    the unsplit engine's; generation with both agrees on most tokens (row-parallel shards
    quantize their own input slices, so not bit for bit)."""
    folder, _ = bias_ckpt
    one = _llm(folder, 1, quantization="int8")
    two = _llm(folder, 2, quantization="int8")
    q1 = one.llm_engine.model.model.layers[0].self_attn.qkv_proj.qweight_rows()
    q2 = two.llm_engine.model.model.layers[0].self_attn.qkv_proj.qweight_rows()
    d = 16  # head_dim: hidden 64 / 4 heads; rank 0 holds q heads 0-1 and KV head 0
    expect = torch.cat([q1[:2 * d], q1[4 * d:5 * d], q1[6 * d:7 * d]])
    assert torch.equal(q2, expect)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    a = _ids(one.generate(_prompts(), params, use_tqdm=False))
    b = _ids(two.generate(_prompts(), params, use_tqdm=False))
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra[0], rb[0]))
    assert same >= 0.75 * sum(len(r[0]) for r in a), (a, b)
    two.shutdown()


# The hung worker (found only after the timeout, so the slower case) is part of the full
# grid (pytest --full-grid).
@pytest.mark.parametrize("how", ["kill", pytest.param("hang", marks=pytest.mark.full_grid)])
def test_dead_or_hung_worker_is_a_clear_error_and_nothing_is_left(bias_ckpt, how) -> None:
    folder, _ = bias_ckpt
    # The hang is found only at the timeout: keep it short there. A killed rank is found
    # at once, so its run may give the ranks' start (torch's import on a busy machine)
    # more time to join.
    timeout = 4.0 if how == "hang" else 60.0
    llm = _llm(folder, 2, distributed_timeout=timeout)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    llm.generate(_prompts(), params, use_tqdm=False)
    procs = _worker_procs(llm)
    pid = procs[0].pid
    os.kill(pid, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
    if how == "kill":
        procs[0].wait(10)
    start = time.monotonic()
    with pytest.raises(DistributedError, match="rank") as info:
        llm.generate(_prompts(), params, use_tqdm=False)
    assert time.monotonic() - start < timeout + 20
    if how == "kill":
        assert f"pid {pid}" in str(info.value) or "rank 1" in str(info.value)
    _assert_gone(procs)
    # The engine stays failed with the same error; nothing hangs.
    with pytest.raises(DistributedError):
        llm.generate(_prompts(), params, use_tqdm=False)
    llm.shutdown()


def test_startup_errors_are_clear(bias_ckpt) -> None:
    folder, _ = bias_ckpt
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's "
                                         "num_attention_heads"):
        _llm(folder, 3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        _llm(folder, 0)
    with pytest.raises(ValueError, match="distributed_timeout"):
        _llm(folder, 2, distributed_timeout=0)
    from vllm_lite.config import ParallelConfig

    hf_config = make_config("llama")
    with pytest.raises(ValueError, match="intermediate_size"):
        hf_config.intermediate_size = 127
        ParallelConfig(tensor_parallel_size=2).check_model(hf_config, None)
    with pytest.raises(ValueError, match="pass the model's path, not a module"):
        from vllm_lite.engine.llm_engine import LLMEngine
        from vllm_lite.config import EngineArgs

        config = EngineArgs(model=str(folder), dtype="float32", tensor_parallel_size=2,
                            kv_cache_space=0.01).create_engine_config()
        LLMEngine(config, model=torch.nn.Linear(1, 1))
    with pytest.raises(ValueError, match="quantization_group_size 128 must divide"):
        _llm(folder, 2, quantization="int4")  # each rank's o_proj has 32 inputs


def test_two_nodes_on_one_machine(bias_ckpt, monkeypatch) -> None:
    """Rank 1 started by hand as on a second machine (`vllm-lite worker` with torchrun's
    variables), the driver told by LOCAL_WORLD_SIZE=1 to start none itself."""
    folder, hf_model = bias_ckpt
    port = free_port()
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    # cwd: not the checkout, whose vllm_lite (maybe unbuilt) `-m` would import first.
    worker = subprocess.Popen(
        [sys.executable, "-m", "vllm_lite.entrypoints.cli", "worker"],
        env=cli_env({**common, "RANK": "1", "LOCAL_RANK": "0"}), cwd=folder)
    try:
        for k, v in {**common, "RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
            monkeypatch.setenv(k, v)
        llm = _llm(folder, 2)
        assert _worker_procs(llm) == []
        prompts = _prompts(3, [6, 11])
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                            use_tqdm=False)
        assert _ids(outs) == [[_hf_greedy(hf_model, p["prompt_token_ids"])] for p in prompts]
        llm.shutdown()
        assert worker.wait(20) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


_CTRL_C_SCRIPT = """
import faulthandler, signal, sys
# Ctrl-C as in a terminal: a process started in the background of a non-interactive shell
# (CI scripts, `cmd &`) inherits SIGINT ignored, and Python then keeps it ignored.
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test's dump if it hangs
from vllm_lite import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", device="cpu", tensor_parallel_size=2,
          block_size=4, kv_cache_space=0.01, swap_space=0.01)
print(" ".join(str(p.pid) for p in llm.llm_engine.executor.ranks.procs.values()), flush=True)
params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
while True:
    llm.generate([{"prompt_token_ids": [1, 2, 3]}] * 4, params, use_tqdm=False)
"""


def test_ctrl_c_shuts_every_rank_down(bias_ckpt, tmp_path) -> None:
    """SIGINT to the whole process group (a terminal's Ctrl-C): the workers ignore it, the
    driver's KeyboardInterrupt ends it and takes the workers with it."""
    folder, _ = bias_ckpt
    script = tmp_path / "ctrl_c.py"
    script.write_text(_CTRL_C_SCRIPT)
    err = tmp_path / "stderr.log"  # the driver's and its rank's
    with open(err, "w") as err_file:
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], env=cli_env(),
                                stdout=subprocess.PIPE, stderr=err_file, text=True,
                                start_new_session=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 1
        time.sleep(1.0)  # inside generate
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            # Where each process stands (faulthandler: the script's and the ranks' own).
            os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(3)
            pytest.fail("the driver still ran 60 s after SIGINT; the processes' stacks "
                        f"and stderr:\n{err.read_text()[-12000:]}")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its dead parent's reaper) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().split(")")[-1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def test_server_with_two_ranks_answers_the_openai_client(model_dir, offline, tmp_path) -> None:
    """`vllm-lite serve --tensor-parallel-size 2`: completions (greedy, with logprobs) and
    chat equal the unsplit offline engine's; a killed rank fails requests at once and turns
    /health 503; SIGTERM stops the server."""
    openai = pytest.importorskip("openai")
    from entrypoints.utils import MODEL_NAME, ServeProcess

    server = ServeProcess(model_dir, tmp_path, args=["--tensor-parallel-size", "2"]).start()
    try:
        server.wait_healthy()
        ranks = _children(server.proc.pid)
        assert len(ranks) == 1, ranks
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        for text in ("hello world", "the quick brown fox"):
            ref = offline.generate(text, SamplingParams(temperature=0, max_tokens=8,
                                                        logprobs=1), use_tqdm=False)[0]
            r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=8,
                                          temperature=0, logprobs=1, timeout=60)
            choice = r.choices[0]
            assert choice.text == ref.outputs[0].text
            want = [lp[t].logprob for lp, t in zip(ref.outputs[0].logprobs,
                                                    ref.outputs[0].token_ids)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-4)
        messages = [{"role": "user", "content": "hi there"}]
        ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=6),
                           use_tqdm=False)[0]
        chat = client.chat.completions.create(model=MODEL_NAME, messages=messages,
                                              max_tokens=6, temperature=0, timeout=60)
        assert chat.choices[0].message.content == ref.outputs[0].text
        # A dead rank: the next request fails at once (no hang) and /health turns 503, so a
        # load balancer takes the replica out.
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(openai.APIStatusError):
            client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=4,
                                      timeout=60)
        import httpx

        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    finally:
        rc, log = server.stop()
    assert rc in (0, -signal.SIGTERM), log  # uvicorn re-raises the SIGTERM
    assert "DistributedError" in log and "rank" in log, log  # the engine thread's death
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in ranks):
        time.sleep(0.1)
    assert not any(_alive(p) for p in ranks), log


# The same check on the other 4-bit format, GPTQ, is part of the full grid (--full-grid).
@pytest.mark.parametrize("method, group",
                         [("awq", 64), pytest.param("gptq", 32, marks=pytest.mark.full_grid)])
def test_kept_4bit_checkpoints_split_over_two_ranks(tmp_path, method, group) -> None:
    """A GPTQ / AWQ checkpoint's 4-bit weights cut per rank (rows of the column-parallel
    projections, whole groups of the row-parallel ones' inputs): the same tokens as one rank
    and as HF on the dequantized weights (float64)."""
    from models.test_gptq_awq import make_checkpoint

    hf_model, _ = make_checkpoint(tmp_path, method, group)
    gen = torch.Generator().manual_seed(5)  # the checkpoint's vocabulary is 160
    prompts = [{"prompt_token_ids": torch.randint(1, 160, (n,), generator=gen).tolist()}
               for n in (4, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = _llm(tmp_path, tp)
        assert llm.llm_engine.config.model_config.quantization == method
        outs[tp] = _ids(llm.generate(prompts, params, use_tqdm=False))
        llm.shutdown()
    hf64 = hf_model.double()
    assert outs[2] == outs[1] == [[hf_greedy(hf64, p["prompt_token_ids"], MAX_TOKENS)]
                                  for p in prompts]


def test_gptq_act_order_is_refused_over_ranks(tmp_path) -> None:
    from models.test_gptq_awq import make_checkpoint

    make_checkpoint(tmp_path, "gptq", 32, act_order=True)
    with pytest.raises(ValueError, match="act-order"):
        _llm(tmp_path, 2)
