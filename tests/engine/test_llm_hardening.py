"""LLM hardening: one caller can never break a step for another. Two threads
calling generate at once get exactly the outputs of sequential calls; the engine's
max_logprobs cap; memory and cache settings that are not finite, in range and numbers are a
ValueError naming the field."""

from __future__ import annotations

import math
import random
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from models.helpers import make_config, save_hf_model  # noqa: E402
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.config import DEFAULT_MAX_LOGPROBS, GiB, total_memory_bytes  # noqa: E402

VOCAB = 200


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hardening_llama")
    config = make_config("llama")
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    save_hf_model(config, path, seed=random.randrange(1000))
    return path


def _llm(folder: Path, **kw: Any) -> LLM:
    kw.setdefault("block_size", 4)
    kw.setdefault("kv_cache_space", 0.01)
    kw.setdefault("swap_space", 0.01)
    return LLM(str(folder), dtype="float32", device="cpu", **kw)


@pytest.fixture(scope="module")
def llm(folder: Path) -> LLM:
    return _llm(folder)


def _assert_idle(llm: LLM) -> None:
    sched = llm.llm_engine.scheduler
    bm = sched.block_manager
    assert not sched.has_unfinished_seqs()
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks
    assert not llm.llm_engine._requests


def _summary(outs: Any) -> list:
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_two_threads_generate_like_sequential_calls(llm: LLM) -> None:
    rng = random.Random()
    jobs = []
    for t in range(2):
        prompts = [[rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 12))]
                   for _ in range(rng.randint(3, 5))]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(6, 12), ignore_eos=True)
                  if i % 2 == 0 else
                  SamplingParams(temperature=0.8, seed=rng.randrange(2**32), n=2,
                                 max_tokens=rng.randint(6, 12), ignore_eos=True)
                  for i in range(len(prompts))]
        jobs.append((prompts, params))
    expected = [_summary(llm.generate(p, s, use_tqdm=False)) for p, s in jobs]
    for _ in range(3):
        results: list = [None, None]
        errors: list = []
        barrier = threading.Barrier(2)

        def work(i: int) -> None:
            try:
                barrier.wait()
                results[i] = _summary(llm.generate(*jobs[i], use_tqdm=False))
            except BaseException as e:  # noqa: BLE001  (reported below)
                errors.append(e)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        assert not errors, errors
        assert results == expected
    _assert_idle(llm)


def test_a_generate_that_fails_in_one_thread_leaves_the_other_intact(llm: LLM) -> None:
    prompt = [random.randrange(1, VOCAB) for _ in range(5)]
    good = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = _summary(llm.generate([prompt], good, use_tqdm=False))
    results: list = []
    errors: list = []

    def bad() -> None:
        try:
            llm.generate([prompt, [VOCAB + 5]], good, use_tqdm=False)
        except ValueError as e:
            errors.append(e)

    def ok() -> None:
        results.append(_summary(llm.generate([prompt], good, use_tqdm=False)))

    threads = [threading.Thread(target=f) for f in (bad, ok, bad, ok)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert len(errors) == 2 and results == [expected, expected]
    _assert_idle(llm)


# -- admission -------------------------------------------------------------------------------

def test_add_request_refuses_bad_input_and_changes_nothing(llm: LLM) -> None:
    """LLMEngine.add_request admits every request (engine/admission.py, the checks LLM and
    the server call too): bad input is a ValueError naming the field, and the engine holds
    exactly what it held before (a KV-holding request keeps running)."""
    engine = llm.llm_engine
    max_len = engine.config.model_config.max_model_len
    engine.add_request("held", None, SamplingParams(max_tokens=3), prompt_token_ids=[1, 2, 3])
    engine.step()
    before = (list(engine.scheduler.requests), engine.scheduler.block_manager
              .get_num_free_device_blocks())
    cases = [
        (dict(prompt_token_ids=[]), "the prompt is empty"),
        (dict(prompt_token_ids=[1, 2.0]), "prompt token ids must be ints"),
        (dict(prompt_token_ids=[1, VOCAB]), f"token id {VOCAB} is outside the vocabulary"),
        (dict(prompt_token_ids=[1] * (max_len + 1)), "longer than max_model_len"),
        (dict(prompt_token_ids=[1], sampling_params=SamplingParams(n=10**4, temperature=1.0)),
         "^n must be at most"),
        (dict(prompt_token_ids=[1], sampling_params="greedy"), "sampling_params must be"),
        (dict(prompt_token_ids=[1], priority=1), "priority 1 needs the priority"),
        (dict(prompt_token_ids=[1], sampling_params=SamplingParams(max_tokens=10**6)),
         "KV blocks at once"),
        (dict(request_id="held", prompt_token_ids=[1]), "already in the engine"),
    ]
    for kwargs, message in cases:
        kwargs.setdefault("request_id", "new")
        with pytest.raises(ValueError, match=message):
            engine.add_request(**kwargs)
        assert (list(engine.scheduler.requests),
                engine.scheduler.block_manager.get_num_free_device_blocks()) == before
    while engine.has_unfinished_requests():
        engine.step()
    _assert_idle(llm)


# -- max_logprobs ---------------------------------------------------------------------------

def test_max_logprobs_default_and_cap(folder: Path, llm: LLM) -> None:
    assert llm.llm_engine.config.model_config.max_logprobs == DEFAULT_MAX_LOGPROBS == 20
    prompt = [random.randrange(1, VOCAB) for _ in range(4)]
    out = llm.generate([prompt], SamplingParams(max_tokens=2, logprobs=20, prompt_logprobs=20),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs) == 2
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"^{field} must be at most 20"):
            llm.generate([prompt], SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
        with pytest.raises(ValueError, match=f"^{field} must be at most 20"):
            llm.llm_engine.add_request("x", None, SamplingParams(**{field: 10**9}),
                                       prompt_token_ids=prompt)
    small = _llm(folder, max_logprobs=3)
    small.generate([prompt], SamplingParams(max_tokens=2, logprobs=3), use_tqdm=False)
    with pytest.raises(ValueError, match="^logprobs must be at most 3"):
        small.generate([prompt], SamplingParams(max_tokens=2, logprobs=4), use_tqdm=False)
    _assert_idle(llm)
    _assert_idle(small)


@pytest.mark.parametrize("bad", [-1, 2.5, True, "20", None])
def test_max_logprobs_must_be_a_non_negative_int(folder: Path, bad: Any) -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        _llm(folder, max_logprobs=bad)


# -- engine memory settings ------------------------------------------------------------------

_TOTAL = total_memory_bytes()
_HUGE = 2 * (_TOTAL or 2**50) / GiB


@pytest.mark.parametrize("field, bad", [
    ("kv_cache_space", math.inf), ("kv_cache_space", math.nan), ("kv_cache_space", -math.inf),
    ("kv_cache_space", 0), ("kv_cache_space", -1.0), ("kv_cache_space", "4"),
    ("kv_cache_space", None), ("kv_cache_space", True), ("kv_cache_space", 10**400),
    ("swap_space", math.inf), ("swap_space", math.nan), ("swap_space", -1),
    ("swap_space", "1"), ("swap_space", None), ("swap_space", False),
    ("gpu_memory_utilization", math.inf), ("gpu_memory_utilization", math.nan),
    ("gpu_memory_utilization", 0.0), ("gpu_memory_utilization", 1.5),
    ("gpu_memory_utilization", "0.9"), ("gpu_memory_utilization", None),
    ("block_size", 4.0), ("block_size", "4"), ("block_size", True), ("block_size", 0),
    ("max_num_seqs", 2.0), ("max_num_seqs", None), ("max_num_batched_tokens", 512.0),
    ("enable_prefix_caching", "yes"), ("enable_chunked_prefill", 1),
])
def test_engine_settings_are_checked(folder: Path, field: str, bad: Any) -> None:
    with pytest.raises(ValueError) as info:
        _llm(folder, **{field: bad})
    assert field.split("_space")[0] in str(info.value), str(info.value)


@pytest.mark.skipif(_TOTAL is None, reason="the OS does not report its memory")
@pytest.mark.parametrize("field", ["kv_cache_space", "swap_space"])
def test_more_memory_than_the_machine_has(folder: Path, field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} .* more than this machine's memory"):
        _llm(folder, **{field: _HUGE})


def test_valid_engine_settings_still_work(folder: Path) -> None:
    llm = _llm(folder, kv_cache_space=0.02, swap_space=0, gpu_memory_utilization=1)
    prompt = [random.randrange(1, VOCAB) for _ in range(3)]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
