"""vllm_lite's kernels inside other engines (``integrations.transformers``: HF models on
vllm_lite's attention). Importing this package imports none of them."""
