#!/usr/bin/env python3
"""Runs vllm_lite's engine step profile (vllm_lite/benchmarks/step_profile.py: where a
prefill and a decode step's time goes); the same as `vllm-lite bench profile`. `--help` for
the options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.step_profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
