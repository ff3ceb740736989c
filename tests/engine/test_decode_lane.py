"""The engine's decode lane (plain decodes as columns through scheduler, runner, output
processor and apply) against the per-request path (the lane switched off).

A tiny random Llama with a tokenizer runs a mixed workload in which every step holds lane
rows and per-request rows together (prefills, n / best_of, beams, prompt logprobs, logprob
entries, stop strings): under a KV cache small enough to preempt (by recompute and by
swap), with prefix caching, aborts between steps, synchronous and async output
processing, every request's stream of outputs is the same with and without the lane.
Requests finish by every token rule: max_tokens, EOS, min_tokens holding EOS back,
stop_token_ids, max_model_len."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from models.helpers import assert_all_free  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.sampling_params import RequestOutputKind  # noqa: E402

MAX_MODEL_LEN = 40


@pytest.fixture
def folder(tokenized_llama: Path) -> Path:
    return tokenized_llama  # conftest.py


def _llm(folder: Path, lane: bool, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("swap_space", 0.01)
    llm = LLM(str(folder), dtype="float32", device="cpu", seed=0,
              max_model_len=MAX_MODEL_LEN, **kw)
    llm.llm_engine.scheduler._decode_lane = lane
    return llm


def _view(out: Any) -> tuple:
    comps = tuple(
        (c.index, c.text, tuple(c.token_ids), c.cumulative_logprob, c.finish_reason,
         c.stop_reason,
         None if c.logprobs is None else tuple(
             tuple(sorted((t, lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()))
             for e in c.logprobs))
        for c in out.outputs)
    return out.request_id, out.finished, comps, out.error


def _run(llm: LLM, requests: list[tuple[list[int], SamplingParams]],
         abort_at: dict[int, list[str]], eos: int | None = None) -> tuple[dict, dict]:
    """Every request's outputs in order, and what the lane saw (rows, mixed steps)."""
    engine = llm.llm_engine
    if eos is not None:
        engine.eos_token_id = eos
    seen = {"lane_rows": 0, "mixed": 0}
    schedule = engine.scheduler.schedule

    def counting() -> Any:
        out = schedule()
        if out.lane is not None:
            seen["lane_rows"] += len(out.lane)
            seen["mixed"] += bool(out.groups)
        return out

    engine.scheduler.schedule = counting
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    streams: dict[str, list] = {f"r{i}": [] for i in range(len(requests))}
    calls = 0
    while engine.has_unfinished_requests():
        for rid in abort_at.get(calls, []):
            engine.abort_request(rid)
        for out in engine.step():
            streams[out.request_id].append(_view(out))
        calls += 1
        assert calls < 500
    seen["preemptions"] = sum(engine.scheduler.num_preemptions.values())
    seen["prefix_hits"] = engine.scheduler.prefix_cache_stats.hits
    assert_all_free(llm)
    return streams, seen


def _prompts(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(2, 20, (n,), generator=gen).tolist()
    shared = torch.randint(1, 300, (8,), generator=gen).tolist()
    return [(shared if k % 2 else []) + torch.randint(1, 300, (m,), generator=gen).tolist()
            for k, m in enumerate(lens)]


def _requests(prompts: list[list[int]], kind: RequestOutputKind, stop_token: int,
              eos_len: int) -> list[tuple[list[int], SamplingParams]]:
    P = lambda **kw: SamplingParams(output_kind=kind, **kw)  # noqa: E731
    params = [
        P(temperature=0.0, max_tokens=14, ignore_eos=True),
        P(temperature=0.0, max_tokens=12, logprobs=2),
        P(temperature=0.0, max_tokens=5, prompt_logprobs=1),
        P(temperature=0.9, seed=3, max_tokens=13),
        P(temperature=0.8, top_p=0.9, seed=5, max_tokens=8, n=2, best_of=3),
        P(temperature=0.0, max_tokens=6, use_beam_search=True, best_of=2),
        P(temperature=0.0, max_tokens=10, min_tokens=4),
        P(temperature=0.0, max_tokens=16, stop_token_ids=[stop_token]),
        P(temperature=0.0, max_tokens=10, stop=["e"]),
        P(temperature=0.0, max_tokens=None, ignore_eos=True),  # to max_model_len
        P(temperature=0.7, seed=11, max_tokens=11, detokenize=False),
        P(temperature=0.0, max_tokens=eos_len + 3),
    ] * 2
    prompts = list(prompts)
    prompts[9] = prompts[21] = list(range(1, 31))  # 30 of MAX_MODEL_LEN's 40
    # The stop_token_ids and EOS requests continue the probe's greedy stream.
    prompts[7] = prompts[19] = prompts[11] = prompts[23] = prompts[0]
    return list(zip(prompts, params))


@pytest.mark.parametrize("variant", ["sync-recompute", "async-swap", "cumulative-cached"])
def test_the_lane_gives_the_per_request_paths_outputs(folder: Path, variant: str) -> None:
    kind = (RequestOutputKind.CUMULATIVE if variant == "cumulative-cached"
            else RequestOutputKind.FINAL_ONLY)
    kw: dict[str, Any] = dict(
        async_output_proc="on" if variant == "async-swap" else "off",
        enable_prefix_caching=variant == "cumulative-cached",
        preemption_mode="swap" if variant == "async-swap" else "recompute",
        num_gpu_blocks_override=40, max_num_seqs=16)
    # A token the greedy streams sample (it ends the stop_token_ids request early) and
    # one to play EOS: taken from a greedy run of the first prompt.
    prompts = _prompts(24, seed=1)
    probe = _llm(folder, True)
    greedy = probe.generate({"prompt_token_ids": prompts[0]},
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    tokens = greedy[0].outputs[0].token_ids
    stop_token, eos = tokens[2], tokens[5]
    requests = _requests(prompts, kind, stop_token, eos_len=6)
    abort_at = {3: ["r0", "r13"], 7: ["r16"]}
    lane_streams, seen = _run(_llm(folder, True, **kw), requests, abort_at, eos)
    plain_streams, plain_seen = _run(_llm(folder, False, **kw), requests, abort_at, eos)
    assert lane_streams == plain_streams
    assert plain_seen["lane_rows"] == 0
    assert seen["lane_rows"] > 50 and seen["mixed"] > 3
    assert seen["preemptions"] == plain_seen["preemptions"] > 0
    if kw["enable_prefix_caching"]:
        assert seen["prefix_hits"] == plain_seen["prefix_hits"] > 0
    # Every finish the workload asks for happened (aborted requests end unfinished).
    finals = {rid: s[-1] for rid, s in lane_streams.items() if s}
    assert all(not s or not s[-1][1] for rid, s in lane_streams.items()
               if rid in ("r0", "r13", "r16"))
    reasons = {(c[4], c[5]) for f in finals.values() if f[1] for c in f[2]}
    assert ("stop", stop_token) in reasons  # stop_token_ids
    assert ("stop", None) in reasons  # EOS
    assert ("stop", "e") in reasons  # a stop string
    assert ("length", None) in reasons  # max_tokens, max_model_len
    capped = finals["r9"][2][0]
    assert capped[4] == "length" and len(capped[2]) == MAX_MODEL_LEN + 1 - 30
    min_tok = finals["r6"][2][0]
    assert len(min_tok[2]) >= 4
