"""vllm_lite's benchmarks: in the source checkout, not in the installed package.

Engine: :mod:`.throughput` (offline throughput against HF transformers and llama.cpp, KV
waste, sweeps, prefix caching), :mod:`.latency` (batch 1 and a Poisson request rate),
:mod:`.serving` (a request-rate sweep against the HTTP server), :mod:`.step_profile` (where
a step's time goes), :mod:`.cluster_sim` (1-64 simulated replicas behind routers). Kernels:
:mod:`.kernels` (paged attention against SDPA), :mod:`.linear`, :mod:`.elementwise`,
:mod:`.sampler`. Shared parts: :mod:`.common`, :mod:`.engines`, :mod:`.workload`,
:mod:`.report`, :mod:`.llama_cpp`; :mod:`._checkout` runs a file as a module.

Run one as ``python3 benchmarks/X.py`` or ``vllm-lite bench X`` from the checkout (its
root the working directory, or ``VLLM_LITE_BENCHMARKS`` naming this folder); reports go
to ``benchmarks/results/`` under the working directory by default.
"""

from pathlib import Path

# Where every benchmark writes its reports unless told otherwise (--out): relative to the
# working directory, so a run from a checkout's root lands in its benchmarks/results/.
RESULTS_DIR = Path("benchmarks") / "results"
