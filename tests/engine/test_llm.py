"""LLM.generate end to end on the CPU: tiny random Llama / Qwen2 / Qwen3 checkpoints
against HF transformers' greedy generate (float32), under preemption, prefix caching,
chunked prefill and batch limits; sampling, n > 1, stop strings, bad inputs, block
accounting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

# tests/ is on sys.path (pytest puts the first folder without __init__.py there).
from models.helpers import assert_all_free, hf_greedy, make_config, save_hf_model  # noqa: E402
from models.helpers import make_tokenizer as _make_tokenizer  # noqa: E402  (shared)
from vllm_lite import LLM, RequestOutput, SamplingParams  # noqa: E402
from vllm_lite.detokenizer import IncrementalDetokenizer  # noqa: E402

VOCAB = 320
MAX_TOKENS = 10
PROMPT_LENS = [3, 9, 17, 30]


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _hf_greedy(hf_model: Any, prompt: list[int], k: int = MAX_TOKENS) -> list[int]:
    return hf_greedy(hf_model, prompt, k)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, HF model, greedy references); the llama folder has a tokenizer, the
    qwen2 and qwen3 (q/k norm) ones none (token-id prompts only)."""
    name = request.param
    folder = tmp_path_factory.mktemp(f"engine_{name}")
    config = make_config(name)
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    hf_model = save_hf_model(config, folder)
    if name == "llama":
        _make_tokenizer(folder)
    refs = [_hf_greedy(hf_model, p) for p in _prompts()]
    return name, folder, hf_model, refs


def _llm(folder: Path, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_space", 0.01)
    kw.setdefault("swap_space", 0.01)
    return LLM(str(folder), dtype="float32", device="cpu", **kw)


def _greedy(k: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=k)


_assert_all_free = assert_all_free


def _token_ids(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("layout", ["split", "flash"])
def test_greedy_matches_hf(ckpt, layout: str) -> None:
    name, folder, _, refs = ckpt
    llm = _llm(folder, kv_cache_layout=layout)
    k_cache = llm.llm_engine.cache_engine.gpu_cache[0][0]
    assert k_cache.dim() == (4 if layout == "flash" else 5)
    outs = llm.generate(_prompts(), _greedy(), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == _prompts()
    assert _token_ids(outs) == refs
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        c = o.outputs[0]
        assert c.finish_reason in ("length", "stop") and c.index == 0
        if name != "llama":
            assert c.text == ""
    _assert_all_free(llm)


VARIANTS = {
    "preempt_recompute": dict(num_gpu_blocks_override=14, preemption_mode="recompute"),
    "preempt_swap": dict(num_gpu_blocks_override=14, preemption_mode="swap"),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),
    "max_num_seqs_1": dict(max_num_seqs=1),
    "prefix_caching": dict(enable_prefix_caching=True),
    # The flash layout where blocks move (swap, copy-on-write forks use the same ops) and
    # prefills mix with decodes.
    "flash_preempt_swap": dict(kv_cache_layout="flash", num_gpu_blocks_override=14,
                               preemption_mode="swap"),
    "flash_chunked_prefill_prefix": dict(kv_cache_layout="flash", enable_chunked_prefill=True,
                                         max_num_batched_tokens=8, max_num_seqs=4,
                                         enable_prefix_caching=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_scheduling_variants_match_hf(ckpt, variant: str) -> None:
    _, folder, _, refs = ckpt
    llm = _llm(folder, **VARIANTS[variant])
    outs = llm.generate(_prompts(), _greedy(), use_tqdm=False)
    assert _token_ids(outs) == refs
    if "preempt" in variant:
        mode = VARIANTS[variant]["preemption_mode"]
        assert llm.llm_engine.scheduler.num_preemptions[mode] > 0
    _assert_all_free(llm)


def test_prefix_cache_hits_match_hf(ckpt) -> None:
    _, folder, hf_model, _ = ckpt
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(1, 300, (13,), generator=gen).tolist()
    prompts = [prefix + torch.randint(1, 300, (n,), generator=gen).tolist() for n in (2, 5, 7)]
    refs = [_hf_greedy(hf_model, p) for p in prompts]
    llm = _llm(folder, enable_prefix_caching=True)
    first = llm.generate(prompts[:1], _greedy(), use_tqdm=False)
    rest = llm.generate(prompts[1:], _greedy(), use_tqdm=False)
    again = llm.generate(prompts[:1], _greedy(), use_tqdm=False)
    assert llm.llm_engine.scheduler.prefix_cache_stats.hits > 0
    assert _token_ids(first + rest) == refs
    assert _token_ids(again) == refs[:1]
    _assert_all_free(llm)


def test_sampling_seeded_and_temperature_zero(ckpt) -> None:
    _, folder, _, refs = ckpt
    llm = _llm(folder)
    prompts = _prompts()
    seeded = SamplingParams(temperature=0.9, top_p=0.9, seed=123, max_tokens=8)
    alone = llm.generate([prompts[1]], seeded, use_tqdm=False)
    mixed = llm.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=8), seeded,
                                   _greedy(), SamplingParams(temperature=0.5, max_tokens=8)],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == refs[2][:MAX_TOKENS]
    # Unseeded rows follow the engine seed: a fresh LLM with the same seed repeats them.
    llm2 = _llm(folder)
    llm2.generate([prompts[1]], seeded, use_tqdm=False)
    mixed2 = llm2.generate(prompts, [SamplingParams(temperature=1.0, max_tokens=8), seeded,
                                     _greedy(), SamplingParams(temperature=0.5, max_tokens=8)],
                           use_tqdm=False)
    assert _token_ids(mixed2) == _token_ids(mixed)
    for o in mixed:
        assert all(0 <= t < VOCAB for t in o.outputs[0].token_ids)
    _assert_all_free(llm)


def test_n2_forks_and_shares_prompt_blocks(ckpt) -> None:
    _, folder, _, _ = ckpt
    llm = _llm(folder)
    engine = llm.llm_engine
    prompt = _prompts()[3]  # 30 tokens: 7 full blocks of 4
    engine.add_request("r", None, SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=5),
                       prompt_token_ids=prompt)
    engine.step()  # prefill + first sample: forks into 2 sequences
    group = engine.scheduler.get_seq_group("r")
    seqs = group.get_seqs()
    assert len(seqs) == 2
    bm = engine.scheduler.block_manager
    t0, t1 = bm.get_block_table(seqs[0]), bm.get_block_table(seqs[1])
    assert t0[:7] == t1[:7]  # the full prompt blocks are shared
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    final = [o for o in outs if o.finished]
    assert len(final) == 1 and len(final[0].outputs) == 2
    assert sorted(c.index for c in final[0].outputs) == [0, 1]
    assert all(len(c.token_ids) == 5 or c.finish_reason == "stop" for c in final[0].outputs)
    # best_of > n returns the n best by cumulative logprob.
    out = llm.generate([prompt], SamplingParams(n=1, best_of=3, temperature=1.0, max_tokens=4),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 1
    _assert_all_free(llm)


def test_bad_inputs_raise_and_engine_keeps_serving(ckpt) -> None:
    _, folder, _, refs = ckpt
    llm = _llm(folder, max_model_len=32)
    good = _prompts()
    with pytest.raises(ValueError, match="empty"):
        llm.generate([good[0], []], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([good[0], [5, VOCAB]], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(1, 40))], _greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match="stop strings are not supported with beam search"):
        llm.generate([good[0]], SamplingParams(use_beam_search=True, best_of=2, temperature=0.0,
                                               stop=["x"]), use_tqdm=False)
    with pytest.raises(ValueError):
        llm.generate(good[:2], [_greedy()], use_tqdm=False)  # one params for two prompts
    assert not llm.llm_engine.has_unfinished_requests()
    outs = llm.generate(good[:2], _greedy(), use_tqdm=False)
    assert _token_ids(outs) == refs[:2]
    _assert_all_free(llm)


def test_abort_frees_blocks(ckpt) -> None:
    _, folder, _, _ = ckpt
    llm = _llm(folder)
    engine = llm.llm_engine
    engine.add_request("a", None, _greedy(50), prompt_token_ids=_prompts()[2])
    engine.step()
    engine.step()
    engine.abort_request("a")
    _assert_all_free(llm)


def test_text_stop_strings_logprobs_chat(ckpt) -> None:
    name, folder, _, _ = ckpt
    if name != "llama":
        pytest.skip("only the llama checkpoint has a tokenizer")
    llm = _llm(folder)
    tok = llm.get_tokenizer()
    out = llm.generate("hello world, the cat", SamplingParams(temperature=0.0, max_tokens=16,
                                                             logprobs=2), use_tqdm=False)[0]
    c = out.outputs[0]
    assert out.prompt == "hello world, the cat"
    assert out.prompt_token_ids == tok.encode("hello world, the cat")
    assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    assert len(c.logprobs) == len(c.token_ids)
    assert all(t in d for t, d in zip(c.token_ids, c.logprobs))
    if len(c.text) >= 6 and c.text[3:5].strip():
        stop = c.text[3:5]
        first = c.text.find(stop)
        s = llm.generate("hello world, the cat", SamplingParams(temperature=0.0, max_tokens=16,
                                                               stop=[stop]), use_tqdm=False)[0]
        assert s.outputs[0].text == c.text[:first]
        assert s.outputs[0].finish_reason == "stop" and s.outputs[0].stop_reason == stop
    chat = llm.chat([{"role": "user", "content": "hello"}], _greedy(4), use_tqdm=False)
    assert len(chat) == 1 and chat[0].finished
    _assert_all_free(llm)


def test_incremental_detokenizer_holds_back_split_characters(tmp_path: Path) -> None:
    tok = _make_tokenizer(tmp_path)
    text = "日本語 café ✓"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # multi-byte characters span several byte tokens
    det = IncrementalDetokenizer(tok, [])
    pieces = [det.add_tokens([t]) for t in ids]
    det.flush()
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == det.text == text


def test_import_is_lazy() -> None:
    code = ("import sys, vllm_lite; assert 'transformers' not in sys.modules; "
            "assert 'vllm_lite.entrypoints' not in sys.modules; "
            "from vllm_lite import LLM, SamplingParams, RequestOutput; print(LLM.__name__)")
    # The vllm_lite these tests import (the installed package in CI: a clean checkout's
    # vllm_lite has no compiled _C), run from outside the checkout.
    import vllm_lite

    home = str(Path(vllm_lite.__file__).resolve().parent.parent)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={"PYTHONPATH": home, "PATH": "/usr/bin:/bin"}, timeout=120,
                         cwd="/")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "LLM"


def test_cli_generate_prints_outputs_and_throughput(ckpt, capsys: pytest.CaptureFixture) -> None:
    from vllm_lite.entrypoints.cli import main

    name, folder, _, _ = ckpt
    if name != "llama":
        pytest.skip("only the llama checkpoint has a tokenizer")
    rc = main(["generate", "--model", str(folder), "--dtype", "float32", "--device", "cpu",
               "--max-tokens", "5", "--block-size", "4", "--kv-cache-space", "0.01",
               "hello world", "the cat"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--- 'hello world'" in out and "--- 'the cat'" in out
    assert "2 requests" in out and "output tokens/s" in out
    rc = main(["generate", "--model", str(folder / "missing"), "x"])
    assert rc == 2 and "error" in capsys.readouterr().err


def test_failed_step_aborts_only_its_requests(ckpt) -> None:
    """A step that raises aborts the requests it ran (named in EngineStepError, blocks freed
    at once); a request it did not run is untouched and finishes equal to HF."""
    from vllm_lite.engine.llm_engine import EngineStepError

    _, folder, _, refs = ckpt
    llm = _llm(folder, max_num_seqs=1)
    engine = llm.llm_engine
    prompts = _prompts()
    engine.add_request("bad", sampling_params=_greedy(), prompt_token_ids=prompts[0])
    engine.add_request("good", sampling_params=_greedy(), prompt_token_ids=prompts[1])
    runner = engine.runner
    execute = runner.execute_model

    def failing(out: Any) -> Any:
        if any(s.request_id == "bad" for s in out.scheduled_seq_groups):
            raise RuntimeError("injected failure")
        return execute(out)

    runner.execute_model = failing
    try:
        with pytest.raises(EngineStepError, match="injected failure") as info:
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        del runner.execute_model
    assert info.value.request_ids == ["bad"]
    assert engine.scheduler.get_seq_group("bad") is None
    bm = engine.scheduler.block_manager
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks  # "good" still waits
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert list(final) == ["good"]
    assert final["good"].outputs[0].token_ids == refs[1]
    _assert_all_free(llm)
