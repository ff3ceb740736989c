"""The `vllm-lite` command line.

    vllm-lite generate --model smollm2-135m "Hello, my name is" "The capital of France is"
    vllm-lite generate --model smollm2-135m --chat "What is the capital of France?"

Prints each prompt's completion, then the throughput of the run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Optional, Sequence

from vllm_lite.models import DEFAULT_MODEL

logger = logging.getLogger(__name__)


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts and print them")
    p.add_argument("prompts", nargs="+", help="prompt texts (chat messages with --chat)")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"an alias ({DEFAULT_MODEL}), a .gguf file or an HF model folder")
    p.add_argument("--chat", action="store_true",
                   help="treat each prompt as a user message under the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-space", type=float, default=4.0, help="GiB of KV cache (CPU)")
    p.add_argument("--enable-prefix-caching", action="store_true")
    p.add_argument("--enable-chunked-prefill", action="store_true")


def _run_generate(args: argparse.Namespace) -> int:
    from vllm_lite import LLM, SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)
    llm = LLM(model=args.model, dtype=args.dtype, device=args.device,
              block_size=args.block_size, max_num_seqs=args.max_num_seqs,
              kv_cache_space=args.kv_cache_space,
              enable_prefix_caching=args.enable_prefix_caching,
              enable_chunked_prefill=args.enable_chunked_prefill)
    start = time.perf_counter()
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                   for p in args.prompts]
    else:
        outputs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            generated += len(completion.token_ids)
            print(f"--- {prompt!r}" + (f" [{completion.index}]" if args.n > 1 else ""))
            print(completion.text)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"--- {len(outputs)} requests, {prompt_tokens} prompt tokens, {generated} generated "
          f"tokens in {elapsed:.2f} s: {generated / elapsed:.1f} output tokens/s, "
          f"{len(outputs) / elapsed:.2f} requests/s")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-lite", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run_generate(args)
    except ValueError as e:  # bad arguments or input: say why, no traceback
        print(f"vllm-lite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
