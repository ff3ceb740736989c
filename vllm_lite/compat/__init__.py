"""Drop-in modules for code written against other engines' kernels (``compat.vllm``)."""
