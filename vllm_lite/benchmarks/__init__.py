"""Engine benchmarks: vllm_lite against Hugging Face transformers.

- :mod:`.throughput`: offline throughput on a seeded workload (vllm_lite, HF ``generate``
  on static batches, HF ``generate_batch``), KV waste, block-size / max_num_seqs sweeps
  and prefix caching.
- :mod:`.latency`: batch-1 latency and TTFT / TPOT under a Poisson request rate.

Run them with ``vllm-lite bench throughput|latency`` or ``bench/throughput.py`` /
``bench/latency.py`` from a checkout; reports go to ``bench/results/`` by default.
"""
