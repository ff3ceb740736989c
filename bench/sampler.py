#!/usr/bin/env python3
"""Runs vllm_lite's sampler benchmark (vllm_lite/benchmarks/sampler.py: the engine's
sampler against HF transformers' sampling step on the same logits); the same as
`vllm-lite bench sampler`. `--help` for the options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.sampler import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
