#!/usr/bin/env python3
"""Runs vllm_lite's throughput benchmark (vllm_lite/benchmarks/throughput.py) from the checkout;
`vllm-lite bench throughput` is the same from an installed package. `--help` for the options."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout, not installed

from vllm_lite.benchmarks.throughput import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
