"""Sampler benchmark: vllm_lite's sampler against HF transformers' sampling step, on the same logits.

For each row count (sequences in a decode step) and sampling setting, one run times on the
CPU one call of vllm_lite's ``Sampler`` (the engine's: processing, the token draw and the
sampled tokens' logprobs) and its peer, what ``model.generate`` does per step in HF
transformers: the ``LogitsProcessorList`` for the same settings (repetition penalty,
temperature, top_k, top_p), then ``argmax`` (greedy) or ``softmax`` + ``torch.multinomial``.
The logits are float32 [rows, vocab] (49152, the default model's), normal with standard
deviation 4 and rounded through bfloat16 as a bfloat16 model's are (so ties exist); every
row has a 150-token prompt and 64 output tokens (the repetition penalty's history).
Greedy rows must pick the same tokens in both; random rows are checked to draw tokens
their own processing kept. Each cell is the median of timed calls after a warm-up.
Writes ``sampler.md`` to --out and prints it.
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/sampler.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from . import RESULTS_DIR
from .common import time_us
from vllm_lite.config import THREADS_HELP, set_threads

log = logging.getLogger(__name__)

DEFAULT_ROWS = (1, 8, 32)
QUICK_ROWS = (8,)
# name -> SamplingParams keywords (HF gets the same values).
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 1": dict(temperature=1.0),
    "temperature 0.7, top_p 0.9": dict(temperature=0.7, top_p=0.9),
    "temperature 0.7, top_k 50": dict(temperature=0.7, top_k=50),
    "temperature 0.7, repetition_penalty 1.1": dict(temperature=0.7, repetition_penalty=1.1),
}
PROMPT_LEN, OUTPUT_LEN = 150, 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help=f"rows {' '.join(map(str, QUICK_ROWS))} "
                   "and a shorter time per cell (seconds on 2 cores)")
    p.add_argument("--rows", nargs="+", type=int, default=None,
                   help=f"sequences per call (default: {' '.join(map(str, DEFAULT_ROWS))})")
    p.add_argument("--vocab", type=int, default=49152, help="(default: %(default)s)")
    p.add_argument("--target-s", type=float, default=None,
                   help="seconds of timed calls per cell (default 0.5; --quick 0.05)")
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder "
                   "(default: %(default)s)")


def _hf_step(torch: Any, processors: Any, ids: Any, logits: Any, greedy: bool) -> Any:
    scores = processors(ids, logits)
    if greedy:
        return scores.argmax(dim=-1)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1).squeeze(1)


def _hf_processors(params: dict[str, float]) -> Any:
    from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    # generate()'s order: processors (penalties), then the warpers (temperature, top_k,
    # top_p); greedy uses none of the warpers.
    out = LogitsProcessorList()
    if params.get("repetition_penalty", 1.0) != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(params["repetition_penalty"]))
    if params["temperature"] > 0:
        if params["temperature"] != 1.0:
            out.append(TemperatureLogitsWarper(params["temperature"]))
        if "top_k" in params:
            out.append(TopKLogitsWarper(params["top_k"]))
        if "top_p" in params:
            out.append(TopPLogitsWarper(params["top_p"]))
    return out


def run(args: argparse.Namespace) -> str:
    """The report (markdown) of one run."""
    import torch

    from vllm_lite.layers.sampler import Sampler, process_logits
    from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow
    from vllm_lite.sampling_params import SamplingParams
    from vllm_lite.worker.cpu_malloc import keep_freed_memory

    set_threads(args.threads)
    rows_list = args.rows or list(QUICK_ROWS if args.quick else DEFAULT_ROWS)
    if any(r < 1 for r in rows_list):
        raise ValueError("--rows must be >= 1")
    if args.vocab < PROMPT_LEN + OUTPUT_LEN:
        raise ValueError(f"--vocab must be >= {PROMPT_LEN + OUTPUT_LEN}, got {args.vocab}")
    keep_freed_memory()  # as a CPU engine runs (vllm_lite/worker/cpu_malloc.py)
    target = args.target_s if args.target_s is not None else (0.05 if args.quick else 0.5)
    gen = torch.Generator().manual_seed(args.seed)
    lines = [
        f"# Sampler on the CPU ({torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"vocab {args.vocab}, float32 logits, {PROMPT_LEN}-token prompts, {OUTPUT_LEN} output "
        "tokens)",
        "",
        "| setting | rows | vllm_lite (ms) | HF transformers (ms) | speedup |",
        "|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for m in rows_list:
            logits = (torch.randn(m, args.vocab, generator=gen) * 4).bfloat16().float()
            history = [torch.randint(0, args.vocab, (PROMPT_LEN + OUTPUT_LEN,), generator=gen)
                       for _ in range(m)]
            ids = torch.stack(history)
            for name, kw in SETTINGS.items():
                params = SamplingParams(**kw)
                rows = [SamplingRow(seq_id=i, request_id=str(i), params=params,
                                    prompt_token_ids=h[:PROMPT_LEN].tolist(),
                                    output_token_ids=h[PROMPT_LEN:].tolist())
                        for i, h in enumerate(history)]
                meta = SamplingMetadata(rows)
                sampler = Sampler(seed=args.seed)
                processors = _hf_processors(kw)
                greedy = kw["temperature"] == 0
                ours = [o.token_ids[0] for o in sampler(logits, meta).outputs]
                theirs = _hf_step(torch, processors, ids, logits.clone(), greedy).tolist()
                if greedy and ours != theirs:
                    raise RuntimeError(f"{name}: greedy tokens differ: {ours} vs {theirs}")
                if not greedy:
                    kept = torch.isfinite(process_logits(logits, meta))
                    hf_kept = torch.isfinite(processors(ids, logits.clone()))
                    if not all(kept[i, t] for i, t in enumerate(ours)) or not all(
                            hf_kept[i, t] for i, t in enumerate(theirs)):
                        raise RuntimeError(f"{name}: a token outside its kept set was drawn")
                t_ours = time_us(lambda: sampler(logits, meta), target) / 1e3
                t_hf = time_us(lambda: _hf_step(torch, processors, ids, logits.clone(), greedy),
                               target) / 1e3
                lines.append(f"| {name} | {m} | {_ms(t_ours)} | {_ms(t_hf)} | "
                             f"{t_hf / t_ours:.1f} |")
                log.info("%s, %d rows: vllm_lite %.2f ms, HF %.2f ms", name, m, t_ours, t_hf)
    lines += ["", "Speedup: HF transformers' time / vllm_lite's (above 1: vllm_lite is "
              "faster). HF's time includes a copy of the logits (its processors work in "
              "place), under 1% of it."]
    return "\n".join(lines) + "\n"


def _ms(t: float) -> str:
    # Two decimals, more below 0.01 ms (tiny test sizes), so no cell reads 0.00.
    return f"{t:.2f}" if t >= 0.01 else f"{t:.4f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-lite bench sampler",
                                description=__doc__.splitlines()[0])
    add_arguments(p)
    return run_args(p.parse_args(argv))


def run_args(args: argparse.Namespace) -> int:
    from .common import run_markdown_report

    return run_markdown_report("vllm-lite bench sampler", run, args, "sampler.md")


if __name__ == "__main__":
    sys.exit(main())
