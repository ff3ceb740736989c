"""Engine step profile: where one step's time goes, prefill steps and decode steps apart.

Runs one seeded workload (all requests queued at once, greedy, ignore_eos) through
``LLM``'s engine on the CPU and times, per step, with ``time.perf_counter`` around the
engine's own functions and forward hooks on the model's modules:

- ``schedule``: the scheduler and block manager (``Scheduler.schedule``);
- ``prepare inputs``: building the step's tensors and metadata (``ModelRunner.prepare_input``);
- ``linear``: the decoder's projections (qkv, o, gate_up, down: every ``nn.Linear`` /
  quantized layer but the LM head), with the MLP's activation where gate_up computes it
  in its GEMM (a gated-packed ``Linear``: ``ops.packed_gated_linear``);
- ``attention``: the attention layers (cache write, the paged kernel or SDPA);
- ``other model ops``: the rest of the forward (embedding, norms, rotary, unfused
  activations, residuals);
- ``lm_head``: the logits of the sampled rows;
- ``sampler``: ``Sampler``;
- ``output processing``: appending tokens, stop checks, detokenizing, outputs;
- ``rest``: whatever else the step spends (cache ops, bookkeeping, hook overhead).

A step is a "prefill" step when it holds any prompt tokens. The hooks cost a few
microseconds per module call; the table gives the instrumented total, and a second,
uninstrumented run of the same workload gives the plain throughput beside it.
Writes ``step_profile.md`` to --out and prints it.

``--host-time``: the engine's own cost per decode step, apart from the model's compute.
A micro random Llama (one layer, hidden 64, compute negligible) decodes --num-seqs
sequences together at each --contexts length; host time is the mean decode step's wall
time minus the paged-attention kernel's own time in that step (timed around each kernel
call: on the CPU it runs synchronously). Where the CPU runs the decode layers in one native
call (``ops.llama_decode_layers``: the CPU has a packed GEMM), the kernels run inside that
call and cannot be timed there: each context runs layer by layer first (the model's
``fused_decode`` off; every kernel timed in its step), then in one call, whose row takes
the kernel time of the first (the same kernel on the same arguments; where it dominates, as
at long contexts, its run-to-run spread makes that row's host ms approximate; the row's
host CPU without the model's compute is exact: the whole call counts as compute, timed in
the row's own steps). It should stay flat as the context grows. Beside
it, in process CPU time, the micro model's own compute (its projections and LM head,
``Linear.forward``'s GEMMs, and the greedy sampling kernel ``ops.greedy_sample``: on a GPU
all device kernels, on these CPUs 1.5-2 ms of a step) and the host CPU time without it:
what the engine's Python costs. ``--output-kind``: the requests' SamplingParams.output_kind
(cumulative: a RequestOutput per request and step, as a streaming server reads them;
final_only: only finished ones, as LLM.generate reads them). ``--tokenizer bpe``: a
SentencePiece-style BPE covering the micro model's vocabulary is saved beside it, so every decode
step also detokenizes, as with a real checkpoint (none: no text is made).
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/step_profile.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import dataclasses
import logging
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from . import RESULTS_DIR
from .common import int_list
from vllm_lite.config import KV_CACHE_DTYPES, THREADS_HELP, EngineArgs, set_threads

log = logging.getLogger(__name__)

PHASES = ("schedule", "prepare inputs", "linear", "attention", "other model ops", "lm_head",
          "sampler", "output processing", "rest")
KINDS = ("prefill", "decode")
FULL = dict(num_requests=32, input_len=128, output_len=64)
QUICK = dict(num_requests=8, input_len=64, output_len=16)
HOST_FULL = dict(contexts=[64, 1500], num_seqs=256, decode_steps=24)
HOST_QUICK = dict(contexts=[64, 512], num_seqs=64, decode_steps=8)
# Decode steps run before the timed ones (first-call costs).
HOST_WARMUP_STEPS = 16
OUTPUT_KINDS = ("cumulative", "final_only")
HOST_TOKENIZERS = ("none", "bpe")
DECODE_BATCH_SIZES = [1, 32, 256]
DECODE_CONTEXT = 128


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help=f"a small workload (seconds on 2 cores): {QUICK}")
    p.add_argument("--model", default=EngineArgs.model, help="(default: %(default)s)")
    p.add_argument("--dtype", default=EngineArgs.dtype, help="(default: %(default)s)")
    p.add_argument("--kv-cache-dtype", default=EngineArgs.kv_cache_dtype,
                   choices=KV_CACHE_DTYPES, help="(default: %(default)s)")
    p.add_argument("--quantization", default=EngineArgs.quantization,
                   help="as the engine's --quantization (default: the checkpoint's own)")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"(default {FULL['num_requests']})")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"prompt tokens per request (default {FULL['input_len']})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"output tokens per request (default {FULL['output_len']})")
    p.add_argument("--kv-cache-space", type=float, default=1.0,
                   help="GiB of KV cache (default: %(default)s, so nothing is preempted)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy; above 0 the sampler's "
                        "random path, seeded by --seed)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR,
                   help="results folder (default: %(default)s)")
    p.add_argument("--host-time", action="store_true",
                   help="the decode step's host time (step minus the paged-attention "
                        "kernel's time) with a micro random Llama, per --contexts")
    p.add_argument("--contexts", type=int_list, default=None,
                   help=f"--host-time: prompt lengths (default "
                        f"{','.join(map(str, HOST_FULL['contexts']))}; --quick "
                        f"{','.join(map(str, HOST_QUICK['contexts']))})")
    p.add_argument("--num-seqs", type=int, default=None,
                   help=f"--host-time: sequences decoding together (default "
                        f"{HOST_FULL['num_seqs']}; --quick {HOST_QUICK['num_seqs']})")
    EngineArgs.add_cli_args(p, include=["async_output_proc"])
    p.add_argument("--output-kind", default="cumulative", choices=OUTPUT_KINDS,
                   help="--host-time: the requests' output_kind (default: %(default)s: "
                        "an output per request and step; final_only: LLM.generate's)")
    p.add_argument("--tokenizer", default="none", choices=HOST_TOKENIZERS,
                   help="--host-time: none (default): the micro model makes no text; bpe: "
                        "a BPE over all its ids, so each step detokenizes")
    p.add_argument("--decode-time", action="store_true",
                   help="ms per decode step of --model at each --batch-sizes, with and "
                        "without CUDA graphs on a GPU (eager only on the CPU)")
    p.add_argument("--batch-sizes", type=int_list, default=None,
                   help=f"--decode-time: sequences decoding together (default "
                        f"{','.join(map(str, DECODE_BATCH_SIZES))}); prompts of --input-len "
                        f"tokens (default {DECODE_CONTEXT})")
    p.add_argument("--device", default="auto",
                   help="--decode-time: cpu, cuda, cuda:N or auto (default: %(default)s)")
    p.add_argument("--decode-steps", type=int, default=None,
                   help=f"--host-time / --decode-time: decode steps timed per run (default "
                        f"{HOST_FULL['decode_steps']}; --quick {HOST_QUICK['decode_steps']})")


class _Clock:
    """Seconds per (kind, phase); ``kind`` is set by the step being run."""

    def __init__(self) -> None:
        self.seconds: dict[tuple[str, str], float] = defaultdict(float)
        self.steps: dict[str, int] = defaultdict(int)
        self.tokens: dict[str, int] = defaultdict(int)
        self.kind = "decode"

    def wrap(self, obj: Any, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[self.kind, phase] += time.perf_counter() - t

        setattr(obj, name, timed)

    def hook(self, module: Any, phase: str) -> None:
        starts: list[float] = []

        def pre(*_: Any) -> None:
            starts.append(time.perf_counter())

        def post(*_: Any) -> None:
            self.seconds[self.kind, phase] += time.perf_counter() - starts.pop()

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)


def _workload(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(args.seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(args.input_len)]
            for _ in range(args.num_requests)]


def _run(llm: Any, prompts: list[list[int]], output_len: int, temperature: float = 0.0) -> float:
    from vllm_lite import SamplingParams

    params = SamplingParams(temperature=temperature, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - t


def _instrument(llm: Any, clock: _Clock) -> None:
    from torch import nn

    from vllm_lite.layers.attention import Attention
    from vllm_lite.layers.quantization import Int4Linear, Int8GroupLinear, Int8Linear

    engine = llm.llm_engine
    runner = engine.runner
    model = engine.model
    schedule = engine.scheduler.schedule

    def schedule_step() -> Any:
        t = time.perf_counter()
        out = schedule()
        # The step's kind, known once it is scheduled: any prompt tokens make it a prefill.
        clock.kind = "prefill" if any(g.is_prompt for g in out.scheduled_seq_groups) else "decode"
        clock.steps[clock.kind] += 1
        clock.tokens[clock.kind] += out.num_batched_tokens
        clock.seconds[clock.kind, "schedule"] += time.perf_counter() - t
        return out

    engine.scheduler.schedule = schedule_step
    clock.wrap(engine.output_processor, "process", "output processing")
    clock.wrap(runner, "sampler", "sampler")
    clock.wrap(runner, "prepare_input", "prepare inputs")
    clock.wrap(engine, "step", "step")
    clock.hook(model.model, "forward")  # the decoder stack (not the LM head)
    clock.hook(model.lm_head, "lm_head")
    for m in model.model.modules():
        if isinstance(m, (nn.Linear, Int8Linear, Int4Linear, Int8GroupLinear)):
            clock.hook(m, "linear")
        elif isinstance(m, Attention):
            clock.hook(m, "attention")


def _table(clock: _Clock) -> list[str]:
    s = clock.seconds
    rows = ["| phase | " + " | ".join(f"{k}: ms per step (share)" for k in KINDS) + " |",
            "|---|" + "---|" * len(KINDS)]
    per_kind: dict[str, dict[str, float]] = {}
    for k in KINDS:
        v = {p: s[k, p] for p in PHASES}
        v["other model ops"] = s[k, "forward"] - s[k, "linear"] - s[k, "attention"]
        v["rest"] = s[k, "step"] - sum(x for p, x in v.items() if p != "rest")
        per_kind[k] = v
    for p in PHASES:
        cells = []
        for k in KINDS:
            n, total = clock.steps[k], s[k, "step"]
            cells.append("-" if not n else
                         f"{per_kind[k][p] / n * 1e3:.2f} ({per_kind[k][p] / total:.0%})")
        rows.append(f"| {p} | " + " | ".join(cells) + " |")
    cells = [f"**{s[k, 'step'] / clock.steps[k] * 1e3:.2f}** ({clock.steps[k]} steps, "
             f"{clock.tokens[k] / clock.steps[k]:.0f} tokens each)" if clock.steps[k] else "-"
             for k in KINDS]
    rows.append("| step | " + " | ".join(cells) + " |")
    return rows


def host_time(args: argparse.Namespace) -> str:
    """The --host-time report: per context, the mean decode step, the paged-attention
    kernel's share of it and the rest (the host's), in ms."""
    import tempfile

    import torch

    from vllm_lite import ops
    from vllm_lite.models.llama import Linear
    from .cluster_sim import tiny_random_llama

    for key, value in (HOST_QUICK if args.quick else HOST_FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.num_seqs < 1 or args.decode_steps < 1 or not args.contexts:
        raise ValueError("--num-seqs, --decode-steps and --contexts must be >= 1")
    if args.tokenizer not in HOST_TOKENIZERS:
        raise ValueError(f"--tokenizer must be one of {', '.join(HOST_TOKENIZERS)}, got "
                         f"{args.tokenizer!r}")
    if args.output_kind not in OUTPUT_KINDS:
        raise ValueError(f"--output-kind must be one of {', '.join(OUTPUT_KINDS)}, got "
                         f"{args.output_kind!r}")
    set_threads(args.threads)
    # [kernel wall, kernel CPU, compute CPU] seconds of the step being timed; compute: the
    # micro model's GEMMs and the greedy sampling kernel (device kernels on a GPU).
    kernel_s = [0.0, 0.0, 0.0]
    paged_attention = ops.paged_attention
    linear_forward = Linear.forward
    greedy_sample = ops.greedy_sample

    def timed_kernel(*a: Any, **kw: Any) -> Any:
        t, c = time.perf_counter(), time.process_time()
        try:
            return paged_attention(*a, **kw)
        finally:
            kernel_s[0] += time.perf_counter() - t
            kernel_s[1] += time.process_time() - c

    def compute_timed(fn: Any) -> Any:
        """``fn`` with its process CPU time added to the step's compute."""
        def timed(*a: Any, **kw: Any) -> Any:
            c = time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                kernel_s[2] += time.process_time() - c
        return timed

    rows = ["| context | decoder layers | decode step ms | paged-attention kernel ms | host ms "
            "| host CPU ms | of which model compute CPU ms | host CPU without the model's "
            "compute ms |",
            "|---:|---|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory() as tmp:
        max_len = max(args.contexts) + HOST_WARMUP_STEPS + args.decode_steps + 16
        model = tiny_random_llama(Path(tmp) / "micro", max_len=max_len, seed=args.seed,
                                  layers=1, heads=2, kv_heads=1)
        if args.tokenizer == "bpe":
            _save_micro_tokenizer(model, vocab=512)
        ops.paged_attention = timed_kernel
        Linear.forward = compute_timed(linear_forward)
        ops.greedy_sample = compute_timed(greedy_sample)
        try:
            for context in args.contexts:
                for layers, step, kernel, cpu, gemm in _host_time_at(args, model, context,
                                                                     kernel_s):
                    rows.append(f"| {context} | {layers} | {step * 1e3:.2f} | "
                                f"{kernel * 1e3:.2f} | **{(step - kernel) * 1e3:.2f}** | "
                                f"{cpu * 1e3:.2f} | {gemm * 1e3:.2f} | "
                                f"{(cpu - gemm) * 1e3:.2f} |")
        finally:
            ops.paged_attention = paged_attention
            Linear.forward = linear_forward
            ops.greedy_sample = greedy_sample
    header = (f"Decode host time, {time.strftime('%Y-%m-%d %H:%M')}: micro random Llama "
              f"(1 layer, hidden 64, 2/1 heads of 32, vocab 512), {args.num_seqs} sequences "
              f"decoding together, mean of {args.decode_steps} decode steps, "
              f"{torch.get_num_threads()} threads, async output processing "
              f"{args.async_output_proc}, tokenizer {args.tokenizer}, "
              f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}"
              f", output_kind {args.output_kind}; host = step - "
              f"kernel (wall clock); host CPU = the same in process CPU time (less "
              f"sensitive to a busy machine, but counting every thread's time); model "
              f"compute = the micro model's projections and LM head (Linear.forward) and "
              f"the greedy sampling kernel (ops.greedy_sample): work a GPU does on the "
              f"device.")
    return "\n".join([header, "", *rows, ""])


def _save_micro_tokenizer(folder: Path, vocab: int) -> None:
    """A SentencePiece-style BPE ("▁" for spaces, as Llama's) of exactly ``vocab`` ids
    ("<eos>" = 0, "<unk>" = 1, this file's characters and merges learnt from its text),
    saved beside the micro model: every id the model samples is a token of valid text,
    as a real model's output mostly is (so the detokenizer seldom holds text back)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>", "<unk>"],
                                  show_progress=False)
    tok.train_from_iterator(Path(__file__).read_text().splitlines(), trainer)
    if tok.get_vocab_size() != vocab:
        raise RuntimeError(f"the micro tokenizer has {tok.get_vocab_size()} ids, not {vocab}")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>",
                            unk_token="<unk>").save_pretrained(folder)


def _host_time_at(args: argparse.Namespace, model: Path, context: int,
                  kernel_s: list[float]) -> list[tuple[str, float, float, float, float]]:
    """Rows (how the decoder layers ran, mean decode step, mean kernel time in it, mean
    host CPU time, mean GEMM CPU time; seconds) at one prompt length, with the micro model
    on the CPU: the layers run layer by layer (every kernel timed in the step), then, where
    the CPU runs them in one native call, a second row for that way, whose kernel time is
    the first row's (the same kernel on the same arguments: approximate where its own
    run-to-run spread is as large as the host time) and whose compute is the call's own
    CPU time, less that kernel time, plus the LM head and sampling kernel: its host CPU
    time without the model's compute is measured in its own steps."""
    from vllm_lite import LLM, RequestOutputKind, ops
    from vllm_lite.models.llama import LlamaModel

    n = args.num_seqs
    total = context + HOST_WARMUP_STEPS + args.decode_steps + 1
    llm = LLM(str(model), dtype="float32", device="cpu", seed=args.seed,
              max_model_len=total + 8, max_num_seqs=n,
              max_num_batched_tokens=max(2048, n * (context + 1)), swap_space=0,
              kv_cache_space=max(0.05, 2.5 * n * total * 2 * 32 * 4 / 2**30),
              async_output_proc=args.async_output_proc)
    kind = RequestOutputKind[args.output_kind.upper()]
    one_call = ops.llama_decode_layers
    calls = [0]

    def counted(*a: Any, **kw: Any) -> Any:
        calls[0] += 1
        c = time.process_time()
        try:
            return one_call(*a, **kw)
        finally:
            kernel_s[2] += time.process_time() - c  # model compute, kernel included

    try:
        fused = LlamaModel.fused_decode
        LlamaModel.fused_decode = False
        try:
            step, kernel, cpu, gemm, kernel_cpu = _time_decode(
                llm, n, context, args.decode_steps, args.seed, kernel_s, kind,
                args.temperature)
        finally:
            LlamaModel.fused_decode = fused
        rows = [("per layer", step, kernel, cpu, gemm)]
        if not fused:
            return rows
        ops.llama_decode_layers = counted
        try:
            step1, _, cpu1, compute1, _ = _time_decode(
                llm, n, context, args.decode_steps, args.seed, kernel_s, kind,
                args.temperature)
        finally:
            ops.llama_decode_layers = one_call
    finally:
        llm.llm_engine.shutdown()
    if calls[0]:
        # The call's compute less the kernel's (the first row's) as the compute column:
        # the host CPU without the model's compute is then measured in this row's steps.
        rows.append(("one call", step1, kernel, cpu1 - kernel_cpu, compute1 - kernel_cpu))
    return rows


def _time_decode(llm: Any, n: int, context: int, decode_steps: int, seed: int,
                 kernel_s: list[float], output_kind: Any = None, temperature: float = 0.0
                 ) -> tuple[float, float, float, float, float]:
    """Queues n requests (greedy, or sampled at ``temperature`` above 0) of ``context``
    random prompt tokens, all prefilled in one
    step, and times ``decode_steps`` engine steps in which all n decode (after
    HOST_WARMUP_STEPS untimed ones): (mean step, mean of kernel_s[0] (reset before each
    step; the caller's wrappers add to it), mean process CPU time minus kernel_s[1],
    mean kernel_s[2] and mean kernel_s[1]), seconds. ``output_kind``: the requests' (None: the default)."""
    import random

    from vllm_lite import SamplingParams

    engine = llm.llm_engine
    vocab = engine.config.model_config.hf_config.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(temperature=temperature,
                            max_tokens=HOST_WARMUP_STEPS + decode_steps + 1, ignore_eos=True)
    if output_kind is not None:
        params = dataclasses.replace(params, output_kind=output_kind)
    for i in range(n):
        engine.add_request(f"decode-{i}", None, params, prompt_token_ids=[
            rng.randrange(10, vocab - 10) for _ in range(context)])
    schedule = engine.scheduler.schedule
    shape: list[int] = [0]

    def recording() -> Any:
        out = schedule()
        # The decode lane's rows are never prompts; reading ``groups`` (not
        # ``scheduled_seq_groups``) keeps the lane's records unbuilt, as the engine does.
        shape[0] = out.num_batched_tokens if not any(
            g.is_prompt for g in out.groups) else -1
        return out

    engine.scheduler.schedule = recording
    try:
        warm, steps, step_s, kernel, cpu, gemm, kernel_cpu = 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0
        while engine.has_unfinished_requests() and steps < decode_steps:
            kernel_s[:] = [0.0, 0.0, 0.0]
            t, c = time.perf_counter(), time.process_time()
            engine.step()  # ends with the sampled tokens on the host: the step is done
            dt, dc = time.perf_counter() - t, time.process_time() - c
            if shape[0] != n:
                continue  # a prefill step, or not every sequence decoding yet
            if warm < HOST_WARMUP_STEPS:
                warm += 1
                continue
            steps += 1
            step_s += dt
            kernel += kernel_s[0]
            cpu += dc - kernel_s[1]
            kernel_cpu += kernel_s[1]
            gemm += kernel_s[2]
    finally:
        del engine.scheduler.schedule  # the class's method again
        engine.abort_request(engine.unfinished_request_ids())
    if steps < decode_steps:
        raise RuntimeError(f"only {steps} decode steps ran with all {n} sequences")
    return step_s / steps, kernel / steps, cpu / steps, gemm / steps, kernel_cpu / steps


def decode_time(args: argparse.Namespace) -> str:
    """The --decode-time report: ms per decode step at each --batch-sizes, with and
    without CUDA graphs (on a GPU; eager only on the CPU)."""
    import gc

    import torch

    from vllm_lite import LLM
    from vllm_lite.config import resolve_device

    sizes = args.batch_sizes or DECODE_BATCH_SIZES
    context = args.input_len if args.input_len is not None else DECODE_CONTEXT
    steps = args.decode_steps if args.decode_steps is not None else (
        HOST_QUICK if args.quick else HOST_FULL)["decode_steps"]
    if context < 1 or steps < 1:
        raise ValueError("--input-len and --decode-steps must be >= 1")
    set_threads(args.threads)
    device = resolve_device(args.device)
    modes = [True, False] if device.type == "cuda" else [True]
    rows = ["| sequences | " + " | ".join(
                "eager ms/step" if eager else "graphs ms/step" for eager in modes)
            + (" | graphs speedup | graphs output tok/s |" if len(modes) > 1
               else " | output tok/s |"),
            "|---:|" + "---:|" * (len(modes) + (2 if len(modes) > 1 else 1))]
    results: dict[tuple[int, bool], float] = {}
    for eager in modes:
        llm = LLM(args.model, dtype=args.dtype, device=str(device), seed=args.seed,
                  enforce_eager=eager, max_num_seqs=max(sizes),
                  max_model_len=context + HOST_WARMUP_STEPS + steps + 16,
                  max_num_batched_tokens=max(2048, max(sizes) * (context + 1)), swap_space=0,
                  kv_cache_space=args.kv_cache_space, quantization=args.quantization,
                  async_output_proc=args.async_output_proc)
        try:
            for n in sizes:
                results[n, eager] = _time_decode(llm, n, context, steps, args.seed,
                                                 [0.0, 0.0], None, args.temperature)[0]
        finally:
            llm.llm_engine.shutdown()
            del llm
            # The next engine sizes its KV cache from what is free: this one's must go.
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for n in sizes:
        cells = [f"{results[n, e] * 1e3:.3f}" for e in modes]
        last = results[n, modes[-1]]
        if len(modes) > 1:
            cells.append(f"{results[n, True] / last:.2f}x")
        cells.append(f"{n / last:,.0f}")
        rows.append(f"| {n} | " + " | ".join(cells) + " |")
    header = (f"Decode step time, {time.strftime('%Y-%m-%d %H:%M')}: model `{args.model}`, "
              f"{args.dtype}, {device}, {context}-token prompts, mean of {steps} decode steps "
              f"with every sequence decoding, {torch.get_num_threads()} threads, "
              f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}"
              + ("" if device.type == "cuda" else "; the CPU runs eagerly (no graphs)") + ".")
    return "\n".join([header, "", *rows, ""])


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch

    from vllm_lite import LLM

    if args.host_time and args.decode_time:
        raise ValueError("--host-time and --decode-time are two runs; choose one")
    if not args.temperature >= 0.0:
        raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
    if args.host_time:
        return host_time(args)
    if args.decode_time:
        return decode_time(args)

    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for name in ("num_requests", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    set_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", seed=args.seed,
              kv_cache_space=args.kv_cache_space, kv_cache_dtype=args.kv_cache_dtype,
              quantization=args.quantization, async_output_proc=args.async_output_proc,
              max_model_len=args.input_len + args.output_len + 16)
    vocab = llm.llm_engine.config.model_config.hf_config.vocab_size
    prompts = _workload(args, vocab)
    _run(llm, prompts[:2], 4)  # warm-up
    # The faster of two plain runs (the first still pays one-time costs of new GEMM shapes).
    plain = min(_run(llm, prompts, args.output_len, args.temperature) for _ in range(2))
    clock = _Clock()
    _instrument(llm, clock)
    timed = _run(llm, prompts, args.output_len, args.temperature)
    out_tokens = args.num_requests * args.output_len
    lines = [
        f"Engine step profile, {time.strftime('%Y-%m-%d %H:%M')}: model `{args.model}`, "
        f"{llm.llm_engine.dtype}, KV cache {args.kv_cache_dtype}, quantization "
        f"{llm.llm_engine.config.model_config.quantization or 'none'}, {args.num_requests} requests x {args.input_len} "
        f"prompt + {args.output_len} output tokens, "
        f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature:g}'}, "
        f"{torch.get_num_threads()} threads.",
        "",
        f"Uninstrumented: {plain:.2f} s, {out_tokens / plain:.1f} output tok/s; "
        f"instrumented: {timed:.2f} s (the hooks' cost).",
        "",
        *_table(clock),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-lite bench profile",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from .common import run_markdown_report

    return run_markdown_report("vllm-lite bench profile", run, args, "step_profile.md")


if __name__ == "__main__":
    sys.exit(main())
