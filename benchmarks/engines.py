"""The engines a benchmark compares, each run on the same requests.

- :func:`run_vllm_lite`: vllm_lite's LLMEngine, stepped here so that the KV use can be read
  from the block manager after every step.
- :func:`run_hf_static`: Hugging Face ``generate`` on static, left-padded batches taken in
  arrival order; a batch runs until its longest request is done.
- :func:`run_hf_continuous`: Hugging Face's own continuous batching (the manager behind
  ``model.generate_batch``), driven request by request so that each gets its own output
  length (``generate_batch`` takes one ``max_new_tokens`` for all).

All decode greedily and ignore EOS, so every request produces exactly its requested
number of tokens and the engines do the same useful work. A run returns a
:class:`RunResult`; only useful tokens count as output (a padded row's or a row's tokens
past its own length are counted apart, as ``generated_tokens``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterator, Sequence

import torch

from .workload import BenchRequest

logger = logging.getLogger(__name__)

VLLM_LITE = "vllm_lite"
HF_STATIC = "hf_generate"
HF_CONTINUOUS = "hf_generate_batch"
ENGINES = (VLLM_LITE, HF_STATIC, HF_CONTINUOUS)
# bench throughput's extra peer (benchmarks/llama_cpp.py); other benchmarks refuse it.
LLAMA_CPP = "llama_cpp"


# -- KV accounting ----------------------------------------------------------------------------
@dataclass
class KVStats:
    """KV slots handed out vs slots holding live tokens, summed over the engine's steps.

    A slot is one token's K and V in every layer (``bytes_per_slot`` bytes). ``waste`` is
    the step-averaged fraction of handed-out slots that hold nothing live.
    """

    bytes_per_slot: int
    steps: int = 0
    allocated_slot_steps: int = 0
    live_slot_steps: int = 0
    peak_allocated_slots: int = 0
    peak_live_slots: int = 0
    # (allocated, live) per step, for the KV plot.
    timeline: list[tuple[int, int]] = field(default_factory=list, repr=False)

    def add(self, allocated: int, live: int) -> None:
        if live > allocated:
            raise ValueError(f"{live} live slots in {allocated} allocated ones")
        self.steps += 1
        self.allocated_slot_steps += allocated
        self.live_slot_steps += live
        self.peak_allocated_slots = max(self.peak_allocated_slots, allocated)
        self.peak_live_slots = max(self.peak_live_slots, live)
        self.timeline.append((allocated, live))

    @property
    def live_fraction(self) -> float:
        return self.live_slot_steps / self.allocated_slot_steps if self.allocated_slot_steps else 1.0

    @property
    def waste(self) -> float:
        return 1.0 - self.live_fraction

    @property
    def peak_allocated_mib(self) -> float:
        return self.peak_allocated_slots * self.bytes_per_slot / 2**20

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_per_slot": self.bytes_per_slot, "steps": self.steps,
            "allocated_slot_steps": self.allocated_slot_steps,
            "live_slot_steps": self.live_slot_steps,
            "peak_allocated_slots": self.peak_allocated_slots,
            "peak_live_slots": self.peak_live_slots,
            "peak_allocated_mib": self.peak_allocated_mib, "waste": self.waste,
        }


def kv_bytes_per_token(hf_config: Any, dtype: torch.dtype) -> int:
    """Bytes of K and V of one token over all layers."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * elem


def static_batch_kv(batch: Sequence[BenchRequest], stats: KVStats) -> None:
    """Adds a static batch's steps to ``stats``: a cache preallocated for the padded batch,
    rows x (longest prompt + most new tokens) slots, against the live tokens: each row's
    prompt and the outputs it still wants (a row past its own length holds no live token).
    """
    rows = len(batch)
    max_prompt = max(r.prompt_len for r in batch)
    max_new = max(r.output_len for r in batch)
    allocated = rows * (max_prompt + max_new)
    prompts = sum(r.prompt_len for r in batch)
    for step in range(max_new):  # step 0 is the prefill; step t holds t generated tokens
        stats.add(allocated, prompts + sum(min(step, r.output_len) for r in batch))


# -- results ------------------------------------------------------------------------------------
@dataclass
class RunResult:
    """One engine's run over one workload."""

    engine: str
    num_requests: int
    elapsed_s: float = 0.0
    prompt_tokens: int = 0
    # Useful output tokens: each request's tokens up to its requested length.
    output_tokens: int = 0
    # Every token the engine produced, padded rows and rows past their length included.
    generated_tokens: int = 0
    kv: KVStats | None = None
    # Per request, in workload order: useful output tokens.
    output_lens: list[int] = field(default_factory=list, repr=False)
    prefix_hit_rate: float | None = None
    num_preemptions: int | None = None
    # CPU seconds the process used / (wall seconds x torch threads): well below 1 while
    # other jobs share the cores (timings then say little); see cpu_share().
    cpu_share: float | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    # Set when the engine could not run: the reason, shown as n/a.
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.ok and self.elapsed_s > 0 else 0.0

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s if self.ok and self.elapsed_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine, "num_requests": self.num_requests,
            "elapsed_s": self.elapsed_s, "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens, "generated_tokens": self.generated_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "requests_per_s": self.requests_per_s,
            "kv": self.kv.to_dict() if self.kv is not None else None,
            "prefix_hit_rate": self.prefix_hit_rate, "num_preemptions": self.num_preemptions,
            "cpu_share": self.cpu_share,
            "settings": self.settings, "note": self.note, "error": self.error,
        }


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, dynamic_ncols=True, leave=False)


def release_memory(device: torch.device) -> None:
    """Frees what the last engine left, so the next one starts from the same memory."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


class CpuShare:
    """How much of its threads' CPU time the process got over a timed span (CPU only)."""

    def __init__(self) -> None:
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()

    def __call__(self, device: torch.device) -> float | None:
        if device.type != "cpu":
            return None
        wall = time.perf_counter() - self.wall0
        return (time.process_time() - self.cpu0) / (wall * torch.get_num_threads()) if wall else None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_run(run: Callable[[], RunResult], repeats: int) -> RunResult:
    """``run()`` ``repeats`` times back to back; the run with the median time (the slower
    middle one for an even count), with every run's output tokens/s in
    ``settings["repeat_output_tok_s"]`` in run order. Repeats absorb how far a shared
    machine's neighbours move one run; a failed run is returned at once."""
    runs = []
    for _ in range(repeats):
        r = run()
        if not r.ok:
            return r
        runs.append(r)
    chosen = sorted(runs, key=lambda r: r.elapsed_s)[len(runs) // 2]
    if repeats > 1:
        chosen.settings["repeat_output_tok_s"] = [round(r.output_tokens_per_s, 2) for r in runs]
    return chosen


# -- vllm_lite ------------------------------------------------------------------------------------
_run_ids = itertools.count()


def build_llm(model: str, dtype: str, device: str, **options: Any) -> Any:
    """A vllm_lite LLM for a benchmark: ``options`` are LLM's (EngineArgs') keywords, the
    rest keep their defaults; no swap space (the benchmarks measure the KV pool alone)."""
    from vllm_lite import LLM

    return LLM(model=model, dtype=dtype, device=device, swap_space=0, **options)


def greedy_params(output_len: int) -> Any:
    from vllm_lite import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True,
                          detokenize=False)


def run_vllm_lite(llm: Any, requests: Sequence[BenchRequest], track_kv: bool = True,
                  progress: bool = False, label: str = VLLM_LITE) -> RunResult:
    """All requests queued at once, then engine steps until every one is finished.

    The KV accounting after each step is timed apart and left out of ``elapsed_s``.
    """
    engine = llm.llm_engine
    device = engine.config.device
    # The cache's own element size (1 byte for an fp8 kv_cache_dtype), not the model's.
    bytes_per_slot = kv_bytes_per_token(engine.config.model_config.hf_config,
                                        engine.cache_engine.dtype)
    kv = KVStats(bytes_per_slot) if track_kv else None
    before = engine.stats()  # counters are cumulative over the engine's life
    run = next(_run_ids)
    ids = [f"bench{run}-{i}" for i in range(len(requests))]
    done: dict[str, Any] = {}
    accounting = 0.0
    bar = _progress(len(requests), label, progress)
    _sync(device)
    share = CpuShare()
    start = time.perf_counter()
    try:
        for rid, req in zip(ids, requests):
            engine.add_request(rid, None, greedy_params(req.output_len),
                               prompt_token_ids=list(req.prompt_token_ids))
        while len(done) < len(ids):
            if not engine.has_unfinished_requests():
                raise RuntimeError("the engine stopped with requests unfinished")
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
                    bar.update(1)
            if kv is not None:
                t0 = time.perf_counter()
                kv.add(*engine.kv_usage())
                accounting += time.perf_counter() - t0
        _sync(device)
        elapsed = time.perf_counter() - start - accounting
    except BaseException:
        engine.abort_request([r for r in ids if r not in done])
        raise
    finally:
        bar.close()
    errors = [o.error for o in done.values() if getattr(o, "error", None)]
    lens = [min(len(done[r].outputs[0].token_ids), req.output_len) for r, req in zip(ids, requests)]
    after = engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    result = RunResult(
        engine=label, num_requests=len(requests), elapsed_s=elapsed,
        prompt_tokens=sum(r.prompt_len for r in requests), output_tokens=sum(lens),
        generated_tokens=sum(len(o.outputs[0].token_ids) for o in done.values()),
        kv=kv, output_lens=lens,
        prefix_hit_rate=((after.prefix_cache_hits - before.prefix_cache_hits) / queries
                         if queries else None),
        num_preemptions=after.num_preemptions - before.num_preemptions,
        cpu_share=share(device),
        settings={"block_size": engine.cache_config.block_size,
                  "kv_pool_bytes": engine.cache_config.num_gpu_blocks
                  * engine.cache_config.block_size * bytes_per_slot,
                  "max_num_seqs": engine.config.scheduler_config.max_num_seqs,
                  "num_kv_blocks": engine.cache_config.num_gpu_blocks,
                  "prefix_caching": engine.cache_config.enable_prefix_caching},
    )
    if errors:
        result.note = f"{len(errors)} request(s) failed: {errors[0]}"
    return result


# -- Hugging Face --------------------------------------------------------------------------------
def load_hf_model(folder: str | Path, dtype: torch.dtype, device: torch.device) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    return model.to(device).eval()


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers warns once per generate call about flags we set on purpose."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _pad_id(model: Any) -> int:
    for value in (model.generation_config.pad_token_id, model.config.pad_token_id,
                  model.generation_config.eos_token_id, model.config.eos_token_id):
        if isinstance(value, (list, tuple)):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


def left_pad(batch: Sequence[BenchRequest], pad_id: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [rows, longest prompt], prompts aligned to the right."""
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[i, width - r.prompt_len:] = 1
    return ids.to(device), mask.to(device)


def hf_generate(model: Any, batch: Sequence[BenchRequest], streamer: Any = None) -> torch.Tensor:
    """Greedy ``generate`` of one static batch for as many tokens as its longest request
    wants; ``min_new_tokens`` keeps EOS from ending a row early (ignore_eos)."""
    device = model.device
    ids, mask = left_pad(batch, _pad_id(model), device)
    max_new = max(r.output_len for r in batch)
    with torch.inference_mode(), quiet_transformers():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
            do_sample=False, num_beams=1, pad_token_id=_pad_id(model), streamer=streamer,
            temperature=None, top_p=None, top_k=None,
        )
    if out.shape[1] - ids.shape[1] != max_new:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, "
                           f"asked for {max_new}")
    return out


def run_hf_static(model: Any, requests: Sequence[BenchRequest], batch_size: int,
                  progress: bool = False) -> RunResult:
    """Static batches of ``batch_size`` requests in workload order."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    device = model.device
    bytes_per_slot = kv_bytes_per_token(model.config, model.dtype)
    kv = KVStats(bytes_per_slot)
    generated = 0
    bar = _progress(len(requests), HF_STATIC, progress)
    _sync(device)
    share = CpuShare()
    start = time.perf_counter()
    try:
        for b in range(0, len(requests), batch_size):
            batch = requests[b:b + batch_size]
            hf_generate(model, batch)
            generated += len(batch) * max(r.output_len for r in batch)
            bar.update(len(batch))
        _sync(device)
        elapsed = time.perf_counter() - start
    finally:
        bar.close()
    for b in range(0, len(requests), batch_size):
        static_batch_kv(requests[b:b + batch_size], kv)
    return RunResult(
        engine=HF_STATIC, num_requests=len(requests), elapsed_s=elapsed,
        prompt_tokens=sum(r.prompt_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), generated_tokens=generated, kv=kv,
        output_lens=[r.output_len for r in requests], cpu_share=share(device),
        settings={"batch_size": batch_size, "padding": "left", "cache": "DynamicCache"},
        note="KV as a preallocated cache: rows x (longest prompt + most new tokens)",
    )


def equal_memory_batch_size(requests: Sequence[BenchRequest], kv_budget_bytes: int,
                            bytes_per_token: int, cap: int) -> int:
    """The largest static batch whose padded cache, rows x (longest prompt + most new
    tokens), fits in ``kv_budget_bytes`` (at least 1, at most ``cap``): HF generate given
    the KV memory vllm_lite's pool has."""
    width = max(r.prompt_len for r in requests) + max(r.output_len for r in requests)
    return max(1, min(cap, kv_budget_bytes // (width * bytes_per_token)))


def _cb_grad_mode() -> Any:
    """inference_mode around HF's continuous batching where its generation thread takes the
    caller's mode (later 5.x: the fastest HF); no_grad where the thread runs under its own
    no_grad (5.17), which refuses the inference tensors an inference_mode caller's cache
    would be ("Inplace update to inference tensor outside InferenceMode")."""
    import inspect

    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager)

    loop = inspect.signature(ContinuousBatchingManager._run_generation_loop)
    return torch.inference_mode() if "use_inference_mode" in loop.parameters else torch.no_grad()


def _cb_config(model: Any, kv_budget_bytes: int | None, max_num_seqs: int) -> tuple[Any, int]:
    """HF continuous batching with vllm_lite's KV budget and batch limit (None: HF sizes
    its cache itself), and its tokens per block."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    # Tokens per block: ``block_size`` up to transformers 5.1x (the GPU machine has 5.17),
    # ``page_size`` after (where ``block_size`` became another setting).
    page_field = "page_size" if "page_size" in names else "block_size"
    kwargs: dict[str, Any] = {"max_requests_per_batch": max_num_seqs}
    if "seed" in names:
        kwargs["seed"] = 0  # older versions have no seed; greedy decoding needs none
    if kv_budget_bytes:
        block_bytes = (getattr(ContinuousBatchingConfig, page_field)
                       * kv_bytes_per_token(model.config, model.dtype))
        kwargs["num_blocks"] = max(1, kv_budget_bytes // block_bytes)
    config = ContinuousBatchingConfig(**kwargs)
    return config, getattr(config, page_field)


def run_hf_continuous(model: Any, requests: Sequence[BenchRequest],
                      kv_budget_bytes: int | None, max_num_seqs: int,
                      progress: bool = False, timeout_s: float = 600.0) -> RunResult:
    """HF's continuous batching manager (what ``generate_batch`` runs), each request with
    its own ``max_new_tokens`` and EOS disabled. Any failure is reported as the result's
    ``error`` (shown as n/a), not raised."""
    result = RunResult(engine=HF_CONTINUOUS, num_requests=len(requests),
                       prompt_tokens=sum(r.prompt_len for r in requests))
    try:
        from transformers import GenerationConfig

        gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(r.output_len for r in requests),
                                      eos_token_id=-1, pad_token_id=_pad_id(model))
        cb_config, page_size = _cb_config(model, kv_budget_bytes, max_num_seqs)
        result.settings = {"page_size": page_size, "num_blocks": cb_config.num_blocks,
                           "max_requests_per_batch": cb_config.max_requests_per_batch}
    except Exception as e:  # an older transformers without continuous batching
        result.error = f"{type(e).__name__}: {e}"
        return result
    outputs: dict[str, Any] = {}
    bar = _progress(len(requests), HF_CONTINUOUS, progress)
    try:
        with _cb_grad_mode(), quiet_transformers(), model.continuous_batching_context_manager(
                generation_config=gen_config, continuous_batching_config=cb_config,
                block=True, timeout=30) as manager:
            _sync(model.device)
            share = CpuShare()
            start = time.perf_counter()
            ids = [manager.add_request(list(r.prompt_token_ids), request_id=f"r{i}",
                                       max_new_tokens=r.output_len, eos_token_id=-1)
                   for i, r in enumerate(requests)]
            deadline = start + timeout_s
            while len(outputs) < len(ids):
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{len(ids) - len(outputs)} requests unfinished after "
                                       f"{timeout_s:.0f} s")
                out = manager.get_result(timeout=1)
                if out is None:
                    if not manager.is_running():
                        raise RuntimeError("the generation thread stopped")
                    continue
                if out.is_finished():
                    if getattr(out, "error", None):
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}")
                    outputs[out.request_id] = out
                    bar.update(1)
            _sync(model.device)
            result.elapsed_s = time.perf_counter() - start
            result.cpu_share = share(model.device)
    except Exception as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    finally:
        bar.close()
    lens = [len(outputs[f"r{i}"].generated_tokens) for i in range(len(requests))]
    result.output_lens = [min(n, r.output_len) for n, r in zip(lens, requests)]
    result.output_tokens = sum(result.output_lens)
    result.generated_tokens = sum(lens)
    return result
