"""Load: 100 concurrent requests (greedy and seeded n=3 sampling, plain and streamed), 10
of them cancelled mid-stream. Every other request gets exactly the offline LLM's tokens;
afterwards no request is left in the engine and every KV block is free."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx
import torch

from entrypoints.utils import (MODEL_NAME, complete_ids, offline_params, read_metrics,  # noqa: E402
                              stream_ids)

N_GREEDY, N_SAMPLED, N_CANCELLED = 60, 30, 10
CANCEL_MAX_TOKENS = 200
TIMEOUT = 60


def _requests(seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    reqs = []
    for i in range(N_GREEDY + N_SAMPLED + N_CANCELLED):
        prompt = torch.randint(1, 300, (rng.randint(2, 30),), generator=gen).tolist()
        body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "logprobs": 0,
                                "return_tokens_as_token_ids": True,
                                "stream": rng.random() < 0.5}
        if i < N_GREEDY:
            body.update(temperature=0, max_tokens=rng.randint(3, 12))
        elif i < N_GREEDY + N_SAMPLED:
            body.update(n=3, temperature=1.0, seed=1000 + i, max_tokens=rng.randint(3, 10),
                        ignore_eos=True)
        else:
            body.update(temperature=0, max_tokens=CANCEL_MAX_TOKENS, ignore_eos=True,
                        stream=True)
        reqs.append(body)
    rng.shuffle(reqs)
    return reqs


def test_concurrent_load_with_cancellations(server: Any, offline: Any) -> None:
    reqs = _requests(seed=7)
    kept = [b for b in reqs if b["max_tokens"] != CANCEL_MAX_TOKENS]
    refs = offline.generate([b["prompt"] for b in kept], [offline_params(b) for b in kept],
                            use_tqdm=False)
    want = {id(b): {c.index: c.token_ids for c in ref.outputs} for b, ref in zip(kept, refs)}
    before = read_metrics(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)

    async def run_all() -> list[tuple[dict[str, Any], dict[int, list[int]]]]:
        limits = httpx.Limits(max_connections=len(reqs) + 10)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as c:
            async def one(body: dict[str, Any]) -> tuple[dict[str, Any], dict[int, list[int]]]:
                cancel = body["max_tokens"] == CANCEL_MAX_TOKENS
                if body["stream"]:
                    return body, await stream_ids(c, body, cancel)
                return body, await complete_ids(c, body)

            return await asyncio.wait_for(asyncio.gather(*(one(b) for b in reqs)), 120)

    batch_sizes: list[int] = []
    server.engine.step_callbacks.append(lambda outs: batch_sizes.append(len(outs)))
    try:
        results = asyncio.run(run_all())
    finally:
        server.engine.step_callbacks.clear()
    assert max(batch_sizes) >= 30  # the requests really ran together

    for body, got in results:
        if body["max_tokens"] == CANCEL_MAX_TOKENS:
            assert 1 <= len(got[0]) < CANCEL_MAX_TOKENS  # cut off mid-stream
            continue
        assert got == want[id(body)], body
        if body.get("ignore_eos"):
            assert all(len(t) == body["max_tokens"] for t in got.values())

    # The cancelled requests are aborted (not run to their 200 tokens): soon nothing is
    # left and every block is free.
    deadline = time.monotonic() + 20
    while True:
        m = read_metrics(httpx.get(server.url + "/metrics", timeout=TIMEOUT).text)
        idle = (m["vllm_lite:num_requests_running"] == m["vllm_lite:num_requests_waiting"]
                == m["vllm_lite:num_requests_swapped"] == 0)
        if idle and m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"]:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    assert m["vllm_lite:gpu_cache_usage_perc"] == 0
    assert m["vllm_lite:cpu_cache_blocks_free"] == m["vllm_lite:cpu_cache_blocks_total"]

    def delta(name: str) -> float:
        return m.get(name, 0.0) - before.get(name, 0.0)

    assert delta('vllm_lite:request_success_total{finished_reason="abort"}') == N_CANCELLED
    finished = sum(delta(f'vllm_lite:request_success_total{{finished_reason="{r}"}}')
                   for r in ("stop", "length"))
    assert finished == N_GREEDY + N_SAMPLED
    # Well short of what the cancelled requests would have generated to the end.
    kept_tokens = sum(len(t) for _, got in results for t in got.values())
    assert delta("vllm_lite:generation_tokens_total") < kept_tokens + N_CANCELLED * CANCEL_MAX_TOKENS / 2
    assert not server.engine.engine.has_unfinished_requests()


def test_plain_request_is_aborted_when_its_client_leaves(server: Any) -> None:
    """A non-streaming request whose client gives up (timeout) is aborted at once, not run
    to its max_tokens."""
    url = server.url
    before = read_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": CANCEL_MAX_TOKENS,
            "ignore_eos": True}
    seen: list[int] = []

    def slow_step(outs: Any) -> None:
        # The tiny model runs a step in ~1 ms: pace the engine thread so the request cannot
        # finish inside the client's 0.3 s read timeout (200 steps take >= 2 s).
        seen.append(len(outs))
        time.sleep(0.01)

    server.engine.step_callbacks.append(slow_step)
    try:
        try:
            httpx.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(TIMEOUT, read=0.3))
            raise AssertionError("the request finished before the client gave up")
        except httpx.ReadTimeout:
            pass
        deadline = time.monotonic() + 20
        while True:
            m = read_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
            aborted = m.get('vllm_lite:request_success_total{finished_reason="abort"}', 0) - \
                before.get('vllm_lite:request_success_total{finished_reason="abort"}', 0)
            if aborted == 1 and m["vllm_lite:num_requests_running"] == 0:
                break
            assert time.monotonic() < deadline, m
            time.sleep(0.05)
    finally:
        server.engine.step_callbacks.clear()
    assert len(seen) < CANCEL_MAX_TOKENS  # stopped well before its last token
    assert m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"]


def test_get_load_counts_requests_in_the_engine(server: Any) -> None:
    """/get_load (vLLM's router probe) is the number of requests in the engine: k open
    streams read k, and 0 once they are done or gone."""
    def load() -> int:
        return httpx.get(server.url + "/get_load", timeout=TIMEOUT).json()["load"]

    async def run() -> list[int]:
        seen = []
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            streams = []
            for k in range(1, 4):
                body = {"model": MODEL_NAME, "prompt": [3, 4, k], "max_tokens": 200,
                        "ignore_eos": True, "stream": True}
                cm = client.stream("POST", "/v1/completions", json=body)
                lines = (await cm.__aenter__()).aiter_lines()
                await lines.__anext__()  # the request is in the engine
                # Held: a dropped line iterator would close the response (an abort).
                streams.append((cm, lines))
                seen.append(await asyncio.to_thread(load))
            for cm, _ in streams:
                await cm.__aexit__(None, None, None)  # the clients leave: aborted
        return seen

    def slow_step(outs: Any) -> None:  # 200 tokens take 4 s: the streams stay open
        time.sleep(0.02)

    server.engine.step_callbacks.append(slow_step)
    try:
        assert asyncio.run(run()) == [1, 2, 3]
    finally:
        server.engine.step_callbacks.remove(slow_step)
    deadline = time.monotonic() + 10
    while load() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert load() == 0
