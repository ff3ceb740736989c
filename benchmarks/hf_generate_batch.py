#!/usr/bin/env python3
"""HF transformers' ``generate_batch`` (continuous batching) on vllm_lite's attention
kernels (attn_implementation "vllm_lite_flash", vllm_lite.integrations.transformers)
against HF's default attention ("sdpa") on the same model, prompts and greedy settings.

Both runs load the same checkpoint (default: vllm_lite's default model, SmolLM2-135M),
generate exactly --max-new-tokens tokens per prompt (no EOS), and are timed end to end
(wall clock of generate_batch, best of --repeat after a warmup call). Prints a markdown
row per implementation: generated tok/s and the ratio to sdpa, and how many prompts'
tokens equal sdpa's.

    python3 benchmarks/hf_generate_batch.py                         # 16 prompts x 64 new tokens
    python3 benchmarks/hf_generate_batch.py --dtype bfloat16 --num-prompts 32 --prompt-len 256
"""

from __future__ import annotations

if __name__ == "__main__" and not __package__:  # python3 benchmarks/hf_generate_batch.py
    import _checkout
    _checkout.run_as_module(__file__)

import argparse
import os
import sys
import time

from .report import cpu_name

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder (default: vllm_lite's default model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (+- 50%%)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2, help="timed calls per implementation")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    import vllm_lite.integrations.transformers as hf_int

    if a.threads:
        torch.set_num_threads(a.threads)
    folder = a.model
    if folder is None:
        from vllm_lite.models import DEFAULT_MODEL, resolve_model

        folder = str(resolve_model(DEFAULT_MODEL))
    dtype = getattr(torch, a.dtype)
    g = torch.Generator().manual_seed(a.seed)
    lo, hi = max(1, a.prompt_len // 2), a.prompt_len * 3 // 2
    cfg = GenerationConfig(max_new_tokens=a.max_new_tokens, do_sample=False, eos_token_id=-1,
                           pad_token_id=0)

    results: dict[str, tuple[float, list[list[int]]]] = {}
    for impl in ("sdpa", hf_int.CB_NAME):
        model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=impl,
                                                     dtype=dtype).eval()
        vocab = model.config.vocab_size
        g.manual_seed(a.seed)
        prompts = [torch.randint(1, vocab, (int(torch.randint(lo, hi + 1, (1,), generator=g)),),
                                 generator=g).tolist() for _ in range(a.num_prompts)]
        best = float("inf")
        outs: list[list[int]] = []
        with torch.no_grad():
            model.generate_batch(prompts[:2], generation_config=cfg, progress_bar=False)
            for _ in range(a.repeat):
                t0 = time.perf_counter()
                res = model.generate_batch(prompts, generation_config=cfg, progress_bar=False)
                best = min(best, time.perf_counter() - t0)
        by_prompt = {tuple(r.prompt_ids): r.generated_tokens for r in res.values()}
        outs = [by_prompt[tuple(pr)] for pr in prompts]
        tokens = sum(len(o) for o in outs)
        results[impl] = (tokens / best, outs)
        del model

    base_tps, base_outs = results["sdpa"]
    print(f"CPU: {cpu_name()}, torch threads "
          f"{torch.get_num_threads()}, {a.dtype}, {a.num_prompts} prompts of {lo}-{hi} "
          f"tokens, {a.max_new_tokens} new tokens each, best of {a.repeat}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| attention | generated tok/s | vs sdpa | prompts equal to sdpa |")
    print("|---|---:|---:|---:|")
    for impl, (tps, outs) in results.items():
        same = sum(o == b for o, b in zip(outs, base_outs))
        print(f"| {impl} | {tps:.1f} | {tps / base_tps:.2f}x | {same}/{len(outs)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
