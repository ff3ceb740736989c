#!/usr/bin/env python3
"""Runs vllm_lite's throughput benchmark (vllm_lite/benchmarks/throughput.py); the same as
`vllm-lite bench throughput`. `--help` for the options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
