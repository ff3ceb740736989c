#!/usr/bin/env python3
"""Runs vllm_lite's cluster simulation (vllm_lite/benchmarks/cluster_sim.py: 1-64 simulated
replicas, each a real Scheduler driven by a cost model calibrated on this engine, behind
round-robin, least-load and prefix-aware routing). `--help` for the options."""

import sys

from _checkout import use_checkout_if_built

use_checkout_if_built()

from vllm_lite.benchmarks.cluster_sim import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
