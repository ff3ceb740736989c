#!/usr/bin/env python3
"""Runs vllm_lite's linear-layer benchmark (vllm_lite/benchmarks/linear.py: the int8 GEMM
against float32 and torch's int8 op); the same as `vllm-lite bench linear`. `--help` for
the options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.linear import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
