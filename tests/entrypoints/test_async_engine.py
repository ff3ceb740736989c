"""AsyncLLMEngine on its own (no HTTP): concurrent requests equal the offline LLM, an
abort frees the request's blocks by the next step while the others run on, a failing step
fails its requests only, and shutdown fails what is left and frees every block."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest
import torch

from entrypoints.utils import VOCAB, fail_steps_with, make_llm  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402
from vllm_lite.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineError  # noqa: E402
from vllm_lite.metrics import Metrics  # noqa: E402


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> Any:
    return make_llm(model_dir)


@pytest.fixture
def engine(llm: Any) -> Iterator[AsyncLLMEngine]:
    eng = AsyncLLMEngine(llm.llm_engine, Metrics("tiny"))
    eng.start()
    yield eng
    eng.shutdown()
    _assert_all_free(llm.llm_engine)


def _assert_all_free(llm_engine: Any) -> None:
    bm = llm_engine.scheduler.block_manager
    assert not llm_engine.has_unfinished_requests()
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks


def _prompts(seed: int, lens: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lens]


async def _final(engine: AsyncLLMEngine, rid: str, prompt: list[int], params: SamplingParams) -> Any:
    last = None
    async for out in engine.generate(rid, sampling_params=params, prompt_token_ids=prompt):
        assert not (last is not None and last.finished)
        last = out
    assert last is not None and last.finished
    return last


def test_concurrent_requests_equal_offline(engine: AsyncLLMEngine, offline: Any) -> None:
    prompts = _prompts(0, [4, 9, 17, 25, 6])
    params = [SamplingParams(temperature=0, max_tokens=9),
              SamplingParams(n=2, temperature=0.8, seed=4, max_tokens=7),
              SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[7]),
              SamplingParams(temperature=1.0, seed=9, max_tokens=11, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=3, logprobs=2)]
    refs = offline.generate(prompts, params, use_tqdm=False)

    async def run() -> list[Any]:
        return await asyncio.gather(*(_final(engine, f"r{i}", p, sp)
                                      for i, (p, sp) in enumerate(zip(prompts, params))))

    outs = asyncio.run(run())
    # A text prompt (tokenized by the engine thread) too.
    text_ref = offline.generate("hello world", params[0], use_tqdm=False)[0]

    async def run_text() -> Any:
        last = None
        async for out in engine.generate("text", "hello world", params[0]):
            last = out
        return last

    text_out = asyncio.run(run_text())
    assert text_out.prompt_token_ids == text_ref.prompt_token_ids
    assert text_out.outputs[0].text == text_ref.outputs[0].text
    for out, ref in zip(outs, refs):
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ref.outputs]
        assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in ref.outputs]
    assert outs[4].outputs[0].logprobs is not None


def test_abort_frees_blocks_by_the_next_step(engine: AsyncLLMEngine, offline: Any) -> None:
    llm_engine = engine.engine
    sched = llm_engine.scheduler
    bm = sched.block_manager
    pa, pb = _prompts(1, [12, 7])
    long = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    ref_b = offline.generate([pb], long, use_tqdm=False)[0]
    state: dict[str, Any] = {"aborted_at": None, "step": 0, "after": []}

    def on_step(outputs: list[Any]) -> None:  # runs in the engine thread, between steps
        state["step"] += 1
        if state["aborted_at"] is None:
            return
        group_b = sched.get_seq_group("b")
        in_use_b = len(bm.get_block_table(group_b.get_seqs()[0])) if group_b is not None else 0
        state["after"].append((
            any(o.request_id == "a" for o in outputs),
            sched.get_seq_group("a") is None,
            bm.num_total_device_blocks - bm.get_num_free_device_blocks() == in_use_b,
        ))

    engine.step_callbacks.append(on_step)

    async def run() -> Any:
        task_b = asyncio.ensure_future(_final(engine, "b", pb, long))
        gen_a = engine.generate("a", sampling_params=long, prompt_token_ids=pa)
        async for out in gen_a:
            if len(out.outputs[0].token_ids) >= 3:
                break
        state["aborted_at"] = state["step"]
        await gen_a.aclose()  # the consumer leaves: the request is aborted
        return await task_b

    out_b = asyncio.run(run())
    after = state["after"]
    assert len(after) > 10  # b ran on for many steps after the abort
    # At most the step already under way still carried a; from the next one on, a is gone
    # and the only blocks in use are b's.
    assert all(gone and only_b for _, gone, only_b in after[1:])
    assert not any(saw_a for saw_a, _, _ in after[1:])
    assert out_b.outputs[0].token_ids == ref_b.outputs[0].token_ids
    metrics = engine.metrics.render().decode()
    assert 'vllm_lite:request_success_total{finished_reason="abort",model_name="tiny"} 1.0' in metrics


def test_failing_step_fails_its_requests_only(llm: Any, offline: Any) -> None:
    poison = 300  # never in _prompts
    fail_steps_with(llm, poison)
    engine = AsyncLLMEngine(llm.llm_engine)
    engine.start()
    try:
        good = _prompts(2, [8])[0]
        params = SamplingParams(temperature=0, max_tokens=6)

        async def run() -> Any:
            with pytest.raises(EngineError, match="injected failure"):
                await _final(engine, "bad", [1, poison, 2], params)
            return await _final(engine, "good", good, params)

        out = asyncio.run(run())
        ref = offline.generate([good], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finally:
        engine.shutdown()
        del llm.llm_engine.runner.execute_model  # back to the class's method
    _assert_all_free(llm.llm_engine)


def test_bad_requests_raise_value_error(engine: AsyncLLMEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def run() -> None:
        # Outside the vocabulary: the engine's own check, raised back here.
        with pytest.raises(ValueError, match="vocabulary"):
            await _final(engine, "x", [1, VOCAB + 1], params)
        first = engine.generate("dup", sampling_params=params, prompt_token_ids=[1, 2, 3])
        await first.__anext__()
        with pytest.raises(ValueError, match="already"):
            await _final(engine, "dup", [4, 5], params)
        await first.aclose()

    asyncio.run(run())


def test_shutdown_fails_pending_requests(llm: Any) -> None:
    engine = AsyncLLMEngine(llm.llm_engine)
    engine.start()
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def run() -> None:
        gen = engine.generate("long", sampling_params=long, prompt_token_ids=[5, 6, 7])
        await gen.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await _final(engine, "late", [1, 2], long)

    asyncio.run(run())
    _assert_all_free(llm.llm_engine)


# -- batching delay -----------------------------------------------------------------------------

def _first_step_and_ttft(llm: Any, delay: float, gaps: list[float], max_tokens: int = 4,
                         busy: bool = False) -> tuple[set[str], list[float], dict[str, list[int]]]:
    """Sends len(gaps) requests, request i ``gaps[i]`` s after request i-1 (greedy, random
    prompts): the request ids in the first step that prefilled any of them, each request's
    time to its first output, and their token ids. ``busy``: a long request is already
    running when they arrive."""
    engine = AsyncLLMEngine(llm.llm_engine, batching_delay=delay)
    steps: list[set[str]] = []
    engine.step_callbacks.append(lambda outs: steps.append({o.request_id for o in outs}))
    engine.start()
    prompts = _prompts(int(delay * 1000) + len(gaps), [5 + 3 * i % 20 for i in range(len(gaps))])
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    try:
        async def one(i: int, ttfts: list[float]) -> list[int]:
            sent = time.monotonic()
            first = None
            async for out in engine.generate(f"q{i}", sampling_params=params,
                                             prompt_token_ids=prompts[i]):
                if first is None:
                    first = time.monotonic() - sent
                last = out
            ttfts[i] = first
            return last.outputs[0].token_ids

        async def run() -> tuple[list[float], list[list[int]]]:
            background = None
            if busy:
                background = asyncio.ensure_future(_final(
                    engine, "busy", [9, 9, 9], SamplingParams(temperature=0, max_tokens=150,
                                                              ignore_eos=True)))
                while not steps:
                    await asyncio.sleep(0.005)
            ttfts = [0.0] * len(gaps)
            tasks = []
            for i, gap in enumerate(gaps):
                await asyncio.sleep(gap)
                tasks.append(asyncio.ensure_future(one(i, ttfts)))
            ids = await asyncio.gather(*tasks)
            if background is not None:
                await background
            return ttfts, ids

        ttfts, ids = asyncio.run(run())
    finally:
        engine.shutdown()
    _assert_all_free(llm.llm_engine)
    first = next(s for s in steps if any(r.startswith("q") for r in s))
    refs = {f"q{i}": o.outputs[0].token_ids
            for i, o in enumerate(llm.generate(prompts, params, use_tqdm=False))}
    assert {f"q{i}": t for i, t in enumerate(ids)} == refs  # the delay changes no token
    return {r for r in first if r.startswith("q")}, ttfts, refs


def test_batching_delay_gathers_a_burst_into_one_prefill(llm: Any) -> None:
    gaps = [0.0, 0.03, 0.03, 0.03]
    # No delay: the first request is prefilled alone, as soon as it arrives.
    first, ttfts, _ = _first_step_and_ttft(llm, 0.0, gaps)
    assert first == {"q0"}
    # A 400 ms delay: all four (sent over 90 ms) share the first step; the first request
    # waited the delay (its TTFT >= 0.4 s), the last one only what was left of it.
    first, ttfts, _ = _first_step_and_ttft(llm, 0.4, gaps)
    assert first == {"q0", "q1", "q2", "q3"}
    assert ttfts[0] >= 0.4 - 0.01 and ttfts[3] < ttfts[0] - 0.05


def test_batching_delay_ends_when_max_num_seqs_wait(model_dir: Path) -> None:
    llm = make_llm(model_dir, max_num_seqs=5)
    # max_num_seqs requests at once end a 30 s delay at once.
    first, ttfts, _ = _first_step_and_ttft(llm, 30.0, [0.0] * 5, max_tokens=2)
    assert len(first) == 5 and max(ttfts) < 10


def test_batching_delay_only_holds_an_idle_engine(llm: Any) -> None:
    # A request arriving while another runs joins the next step: no delay.
    _, ttfts, _ = _first_step_and_ttft(llm, 5.0, [0.0], busy=True)
    assert ttfts[0] < 2.0


def test_batching_delay_must_be_a_finite_number() -> None:
    from vllm_lite.entrypoints.openai.api_server import ServerConfig

    for bad in (-1.0, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="batching_delay_ms"):
            ServerConfig(batching_delay_ms=bad)
        with pytest.raises(ValueError, match="drain_timeout_s"):
            ServerConfig(drain_timeout_s=bad)


def test_two_engines_step_at_once_in_one_process(model_dir: Path, offline: Any) -> None:
    """Two engines in one process (two servers, an engine embedded beside another), each
    stepping in its own thread at the same time: each sees only its own batch."""
    import threading

    prompts = _prompts(11, [3, 9, 14, 20, 6, 11])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    refs = [o.outputs[0].token_ids for o in offline.generate(prompts, params, use_tqdm=False)]
    llms = [make_llm(model_dir), make_llm(model_dir)]
    results: list[Any] = [None, None]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        try:
            # Different batches (one reversed), so a mix-up shows in the tokens or raises.
            ps = prompts if i == 0 else prompts[::-1]
            results[i] = [o.outputs[0].token_ids
                          for o in llms[i].generate(ps, params, use_tqdm=False)]
        except Exception as e:  # noqa: BLE001  (reported below)
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[0] == refs, results[0]
    assert results[1] == refs[::-1], results[1]
