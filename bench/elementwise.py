#!/usr/bin/env python3
"""Runs vllm_lite's element-wise op benchmark (vllm_lite/benchmarks/elementwise.py: the
native rms_norm / fused_add_rms_norm / silu_and_mul / rotary_embedding against the eager
torch code they replaced); the same as `vllm-lite bench elementwise`. `--help` for the
options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.elementwise import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
