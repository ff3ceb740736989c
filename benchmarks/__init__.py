"""Engine benchmarks: vllm_lite against Hugging Face transformers.

- :mod:`.throughput`: offline throughput on a seeded workload (vllm_lite, HF ``generate``
  on static batches, HF ``generate_batch``), KV waste, block-size / max_num_seqs sweeps
  and prefix caching.
- :mod:`.latency`: batch-1 latency and TTFT / TPOT under a Poisson request rate.
- :mod:`.kernels`: the paged-attention kernels against SDPA (and flash_attn on CUDA).

Run them with ``vllm-lite bench throughput|latency|kernels`` or the thin scripts
``bench/throughput.py``, ``bench/latency.py``, ``bench/kernels.py``; reports go to
``bench/results/`` (under the working directory) by default.
"""

from pathlib import Path

# Where every benchmark writes its reports unless told otherwise (--out): relative to the
# working directory, so a run from a checkout's root lands in its bench/results/.
RESULTS_DIR = Path("bench") / "results"
