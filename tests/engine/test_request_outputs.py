"""The RequestOutputs of a streaming (CUMULATIVE) request: each step's output shows the
request as it stood after that step, however late it is read, and whatever a reader does
to it; the engine hands over its live token and logprob lists with their lengths instead
of copying them every step (vllm_lite.outputs.CompletionOutput)."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.outputs import CompletionOutput  # noqa: E402
from vllm_lite.sampling_params import RequestOutputKind  # noqa: E402


@pytest.fixture
def folder(tokenized_llama: Path) -> Path:
    return tokenized_llama  # conftest.py


def _requests() -> list[tuple[str, list[int], SamplingParams]]:
    cum = RequestOutputKind.CUMULATIVE
    return [
        # One sequence: the inline path, with logprob entries and prompt logprobs (its
        # 30-token prompt arrives in chunks: the prompt logprobs grow over steps).
        ("plain", list(range(5, 35)), SamplingParams(
            max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1, output_kind=cum)),
        ("greedy", [7, 8, 9], SamplingParams(max_tokens=9, ignore_eos=True, output_kind=cum)),
        # Several sequences: the general path.
        ("best_of", [11, 12, 13, 14], SamplingParams(
            n=2, best_of=3, temperature=0.9, seed=3, max_tokens=7, ignore_eos=True,
            logprobs=1, output_kind=cum)),
    ]


MARK: dict[int, Any] = {}  # what a meddling reader appends to the logprob lists


def _stream(folder: Path, meddle: bool) -> dict[str, list[Any]]:
    """Every RequestOutput of each request, in step order. ``meddle``: append to every list
    an output hands out, as soon as it comes (a reader may; the engine must not care).
    The prompt's lists are shared by a request's outputs, as in vLLM."""
    llm = LLM(str(folder), dtype="float32", device="cpu", seed=0, max_model_len=64,
              max_num_batched_tokens=16, max_num_seqs=8,
              enable_chunked_prefill=True)
    engine = llm.llm_engine
    for rid, prompt, params in _requests():
        engine.add_request(rid, None, params, prompt_token_ids=prompt)
    seen: dict[str, list[Any]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
            if meddle:
                out.prompt_token_ids.append(-1)
                if out.prompt_logprobs is not None:
                    out.prompt_logprobs.append(MARK)
                for c in out.outputs:
                    c.token_ids.append(-1)
                    if c.logprobs is not None:
                        c.logprobs.append(MARK)
    engine.shutdown()
    return seen


def _view(out: Any) -> tuple:
    """An output without what a meddling reader appended."""
    def ids(xs: list[int]) -> tuple[int, ...]:
        return tuple(x for x in xs if x != -1)

    def lps(xs: list[Any] | None) -> int | None:
        return None if xs is None else sum(x is not MARK for x in xs)

    return (out.request_id, out.finished, ids(out.prompt_token_ids), lps(out.prompt_logprobs),
            tuple((c.index, c.text, ids(c.token_ids), c.cumulative_logprob, lps(c.logprobs),
                   c.finish_reason) for c in out.outputs))


def test_each_output_is_its_steps_view_read_late_or_changed(folder: Path) -> None:
    late = _stream(folder, meddle=False)  # read only now, after every later step
    meddled = _stream(folder, meddle=True)  # read and changed at once, every step
    assert set(late) == {rid for rid, _, _ in _requests()}
    for rid, outs in late.items():
        # What the reader changed is the reader's: the engine's streams are the same.
        assert [_view(o) for o in outs] == [_view(o) for o in meddled[rid]]
        final = outs[-1]
        assert final.finished and not any(o.finished for o in outs[:-1])
        for c in final.outputs:
            assert c.logprobs is None or len(c.logprobs) == len(c.token_ids)
        if rid == "best_of":
            continue  # its completions are re-ranked every step: no prefix relation
        # One sequence: an output per prompt chunk (no token yet), then the k-th output
        # holds the first k tokens of the final one (each kept its step's length while
        # the engine went on).
        (c_final,) = final.outputs
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        chunks = lengths.count(0)
        assert lengths == [0] * chunks + list(range(1, len(outs) - chunks + 1))
        if rid == "plain":
            assert chunks >= 1  # its 30-token prompt takes two steps of 16
        for o in outs:
            (c,) = o.outputs
            assert c.token_ids == c_final.token_ids[:len(c.token_ids)]
            if c.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids)
                assert c.logprobs == c_final.logprobs[:len(c.logprobs)]
            assert o.prompt_token_ids == final.prompt_token_ids
    # Prompt logprobs grow chunk by chunk, then stay whole; each output keeps its own.
    plp = [len(o.prompt_logprobs) for o in late["plain"]]
    assert plp == sorted(plp) and plp[0] < plp[-1] == len(late["plain"][0].prompt_token_ids)


def test_completion_output_prefix_copy_pickle_and_equality() -> None:
    live_ids, live_lps = [4, 5], [{4: -0.1}, {5: -0.2}]
    c = CompletionOutput.of_live(0, "ab", live_ids, -0.3, live_lps, None, None)
    live_ids.append(6)
    live_lps.append({6: -0.3})
    assert c.token_ids == [4, 5] and c.logprobs == [{4: -0.1}, {5: -0.2}]
    assert c.token_ids is not live_ids and c.token_ids is c.token_ids  # copied out once
    assert c.token_ids_from(1) == [5]
    live_ids.append(7)
    assert c.token_ids == [4, 5] and c.token_ids_from(0) == [4, 5]
    d = CompletionOutput.of_live(0, "ab", [4, 5, 6], -0.3, None, None, None)
    assert d.token_ids_from(1) == [5, 6] and d.logprobs is None
    plain = CompletionOutput(0, "ab", [4, 5], -0.3, [{4: -0.1}, {5: -0.2}])
    assert plain == c and plain != d and repr(plain) == repr(c)
    assert "token_ids=[4, 5]" in repr(c)
    back = pickle.loads(pickle.dumps(d))
    assert back == d and back.token_ids == [4, 5, 6]
    plain.token_ids = [9]
    assert plain.token_ids == [9] and plain.token_ids_from(0) == [9]
    assert not c.finished() and CompletionOutput(0, "", [], None, None, "stop").finished()
