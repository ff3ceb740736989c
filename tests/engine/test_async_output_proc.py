"""Async output processing (``async_output_proc="on"``): a step returns the previous step's
outputs, their text made while the next forward runs. Checked against the synchronous
engine on a tiny random Llama with a tokenizer: every request's stream of outputs (tokens,
text, logprobs, finish and stop reasons) is the same, step for step, only one call later;
stop strings, max_tokens, EOS, n / best_of, beams, seeded sampling, aborts, preemption and
prefix caching keep it so, and no block is left held."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from models.helpers import assert_all_free  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.config import EngineArgs  # noqa: E402


@pytest.fixture
def folder(tokenized_llama: Path) -> Path:
    return tokenized_llama  # conftest.py


def _llm(folder: Path, mode: str, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_space", 0.01)
    kw.setdefault("swap_space", 0.01)
    return LLM(str(folder), dtype="float32", device="cpu", seed=0, async_output_proc=mode, **kw)


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 24, (n,), generator=gen).tolist()
    return [torch.randint(1, 300, (k,), generator=gen).tolist() for k in lens]


def _view(out: Any) -> tuple:
    """Everything a user sees of one RequestOutput."""
    comps = tuple(
        (c.index, c.text, tuple(c.token_ids), c.cumulative_logprob, c.finish_reason,
         c.stop_reason,
         None if c.logprobs is None else tuple(
             tuple(sorted((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()))
             for e in c.logprobs))
        for c in out.outputs)
    return out.request_id, out.finished, comps, out.error


def _streams(llm: LLM, requests: list[tuple[list[int], SamplingParams]],
             abort_at: dict[int, list[str]] | None = None) -> tuple[dict[str, list], int]:
    """Runs the requests through engine.step() to the end: every request's outputs in the
    order they came, and the number of calls. ``abort_at``: call index -> requests to abort
    before it."""
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    streams: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    calls = 0
    while engine.has_unfinished_requests():
        for rid in (abort_at or {}).get(calls, []):
            engine.abort_request(rid)
        for out in engine.step():
            streams[out.request_id].append(_view(out))
        calls += 1
        assert calls < 500
    return streams, calls


def _mixed_requests(stop_text: str | None = None) -> list[tuple[list[int], SamplingParams]]:
    prompts = _prompts(10, seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=7),
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
        SamplingParams(temperature=0.9, seed=3, max_tokens=9),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, n=2, best_of=3),
        SamplingParams(temperature=0.0, max_tokens=6, use_beam_search=True, best_of=2),
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, min_tokens=4),
        SamplingParams(temperature=0.0, max_tokens=10, stop=[stop_text] if stop_text else None),
        SamplingParams(temperature=0.0, max_tokens=9, skip_special_tokens=False),
        SamplingParams(temperature=0.7, seed=11, max_tokens=11, logprobs=1),
    ]
    return list(zip(prompts, params))


def test_default_is_on_with_a_gpu_only() -> None:
    from vllm_lite.config.resolve import resolve_async_output_proc

    assert EngineArgs.async_output_proc == "auto"
    assert resolve_async_output_proc("auto", "cuda", 1) is True
    assert resolve_async_output_proc("auto", "cpu", 1) is False
    assert resolve_async_output_proc("auto", "cuda", 2) is False
    assert resolve_async_output_proc("on", "cpu", 1) is True
    assert resolve_async_output_proc("off", "cuda", 1) is False
    with pytest.raises(ValueError, match="async_output_proc"):
        resolve_async_output_proc(True, "cpu", 1)


def test_bad_value_is_refused_naming_the_option(folder: Path) -> None:
    with pytest.raises(ValueError, match="async_output_proc"):
        _llm(folder, "sometimes")


@pytest.mark.parametrize("variant", ["plain", "preempt_recompute", "prefix_caching"])
def test_streams_equal_the_synchronous_engine(folder: Path, variant: str) -> None:
    kw: dict[str, Any] = {
        "plain": {},
        "preempt_recompute": dict(num_gpu_blocks_override=24, preemption_mode="recompute"),
        "prefix_caching": dict(enable_prefix_caching=True),
    }[variant]
    sync_llm, async_llm = _llm(folder, "off", **kw), _llm(folder, "on", **kw)
    assert not sync_llm.llm_engine.async_output_proc and async_llm.llm_engine.async_output_proc
    # A stop string the greedy request 7 meets in its text, so it stops on text.
    probe = sync_llm.generate([{"prompt_token_ids": _prompts(10, seed=1)[7]}],
                              SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    text = probe[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2] or None
    requests = _mixed_requests(stop)
    if variant == "prefix_caching":
        # A first run fills the cache; the streams compared are the second run's, whose
        # prompts (and their extensions) hit the first one's blocks.
        requests = requests + [(requests[0][0] + p, sp) for p, sp in requests[:4]]
        for llm in (sync_llm, async_llm):
            _streams(llm, requests)
    want, sync_calls = _streams(sync_llm, requests)
    got, async_calls = _streams(async_llm, requests)
    assert got == want
    assert async_calls == sync_calls + 1  # the last outputs come with one call more
    for stream in got.values():
        assert [finished for _, finished, _, _ in stream] == [False] * (len(stream) - 1) + [True]
    if stop is not None:
        last = want["r7"][-1][2][0]
        assert last[4] == "stop" and last[5] == stop
    if variant == "preempt_recompute":
        assert async_llm.llm_engine.scheduler.num_preemptions["recompute"] > 0
    if variant == "prefix_caching":
        assert async_llm.llm_engine.stats().prefix_cache_hits > 0
    for llm in (sync_llm, async_llm):
        assert_all_free(llm)
        assert not llm.llm_engine.has_unfinished_requests()


def test_generate_is_unchanged(folder: Path) -> None:
    requests = _mixed_requests()
    prompts = [{"prompt_token_ids": p} for p, _ in requests]
    params = [sp for _, sp in requests]
    want = [_view(o) for o in _llm(folder, "off").generate(prompts, params, use_tqdm=False)]
    llm = _llm(folder, "on")
    got = [_view(o) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert_all_free(llm)


@pytest.mark.parametrize("mode", ["off", "on"])
def test_final_only_requests_get_only_their_last_output(folder: Path, mode: str) -> None:
    """output_kind FINAL_ONLY (LLM.generate's requests): one output per request, from the
    step that finished it, equal to the last of its CUMULATIVE stream; mixed with
    CUMULATIVE requests, whose streams stay whole."""
    from vllm_lite import RequestOutputKind

    requests = _mixed_requests()
    want, _ = _streams(_llm(folder, mode), requests)
    final = [(p, dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY))
             if i % 3 else (p, sp) for i, (p, sp) in enumerate(requests)]
    llm = _llm(folder, mode)
    got, _ = _streams(llm, final)
    for i in range(len(requests)):
        rid = f"r{i}"
        assert got[rid] == (want[rid][-1:] if i % 3 else want[rid]), rid
    assert sum(len(want[f"r{i}"]) > 1 for i in range(len(requests)) if i % 3) >= 5
    assert_all_free(llm)


def test_an_aborted_request_gets_no_later_output(folder: Path) -> None:
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
                for p in _prompts(4, seed=2)]
    want, _ = _streams(_llm(folder, "off"), requests, abort_at={3: ["r1"]})
    llm = _llm(folder, "on")
    got, _ = _streams(llm, requests, abort_at={4: ["r1"]})
    # The synchronous engine returned r1's outputs of steps 0-2 before the abort (step 3
    # never ran for it); the async one returns each a call later, so the abort comes
    # after step 3 ran, with its output pending: that output is dropped, the stream is
    # the same and ends unfinished.
    assert got["r1"] == want["r1"] and len(got["r1"]) == 3 and not got["r1"][-1][1]
    for rid in ("r0", "r2", "r3"):
        assert got[rid] == want[rid]
    assert_all_free(llm)


def test_abort_of_a_finished_request_keeps_its_last_output(folder: Path) -> None:
    llm = _llm(folder, "on")
    engine = llm.llm_engine
    engine.add_request("a", None, SamplingParams(temperature=0.0, max_tokens=1),
                       prompt_token_ids=[5, 6, 7])
    assert engine.step() == []  # the prefill samples the only token; its output is pending
    assert engine.has_unfinished_requests()
    engine.abort_request("a")  # finished already: nothing to abort
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a"] and outs[0].finished
    assert outs[0].outputs[0].finish_reason == "length" and len(outs[0].outputs[0].token_ids) == 1
    assert not engine.has_unfinished_requests()
    assert_all_free(llm)


def _streams_with_failure(llm: LLM, requests: list[tuple[list[int], SamplingParams]]
                          ) -> tuple[dict[str, list], list[str]]:
    """_streams with a forward that fails whenever r1 runs with two or more output
    tokens: the engine isolates it (EngineStepError naming it, the step's other outputs
    carried); returns the streams and the failed requests."""
    from vllm_lite.engine.llm_engine import EngineStepError

    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    runner = engine.runner
    execute = runner.execute_model

    def failing(out: Any) -> Any:
        for s in out.scheduled_seq_groups:
            if s.request_id == "r1" and s.seq_group.get_seqs()[0].get_output_len() >= 2:
                raise RuntimeError("injected failure")
        return execute(out)

    runner.execute_model = failing
    streams: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    failed: list[str] = []
    try:
        while engine.has_unfinished_requests():
            try:
                outs = engine.step()
            except EngineStepError as e:
                failed += e.request_ids
                outs = e.outputs
            for out in outs:
                streams[out.request_id].append(_view(out))
    finally:
        del runner.execute_model
    return streams, failed


def test_a_failed_request_fails_alone_with_the_same_streams(folder: Path) -> None:
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1))
                for p in _prompts(4, seed=3)]
    want, want_failed = _streams_with_failure(_llm(folder, "off"), requests)
    llm = _llm(folder, "on")
    got, got_failed = _streams_with_failure(llm, requests)
    assert got_failed == want_failed == ["r1"]
    assert got == want
    assert got["r1"][-1][1] and "injected failure" in got["r1"][-1][3]
    assert_all_free(llm)


def test_a_request_whose_text_fails_fails_alone(folder: Path) -> None:
    """Text made one call late (async) that raises fails its request only, as in the
    synchronous engine: EngineStepError names it, its last output carries the error, its
    blocks are free, and every other stream is unchanged."""
    from vllm_lite.engine.llm_engine import EngineStepError
    from vllm_lite.engine.output_processor import OutputProcessor

    requests = [(p, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
                for p in _prompts(3, seed=4)]
    advance = OutputProcessor._advance

    def failing(self: Any, group: Any, seq: Any, *args: Any, **kw: Any) -> Any:
        if group.request_id == "r1" and seq.get_output_len() >= 3:
            raise RuntimeError("injected text failure")
        return advance(self, group, seq, *args, **kw)

    results = []
    for mode in ("off", "on"):
        llm = _llm(folder, mode)
        engine = llm.llm_engine
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
        streams: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
        failed: list[str] = []
        OutputProcessor._advance = failing
        try:
            while engine.has_unfinished_requests():
                try:
                    outs = engine.step()
                except EngineStepError as e:
                    failed += e.request_ids
                    outs = e.outputs
                for out in outs:
                    streams[out.request_id].append(_view(out))
        finally:
            OutputProcessor._advance = advance
        assert failed == ["r1"]
        last = streams["r1"][-1]
        assert last[1] and "injected text failure" in last[3]
        assert_all_free(llm)
        results.append(streams)
    want, got = results
    assert got["r0"] == want["r0"] and got["r2"] == want["r2"]
