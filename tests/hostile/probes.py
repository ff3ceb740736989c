"""What the hostile-file tests run in the probe process (conftest.ProbeRunner): module-level
functions, so the spawned process can import them."""

from __future__ import annotations

from typing import Any


def load_llm(path: str, **options: Any) -> list[int]:
    """LLM(path) on the CPU with a small cache, then 3 greedy tokens of a token-id prompt."""
    from vllm_lite import LLM, SamplingParams

    llm = LLM(path, device="cpu", kv_cache_space=0.01, swap_space=0, **options)
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0),
                       use_tqdm=False)
    return out[0].outputs[0].token_ids


def load_model(path: str) -> str:
    from vllm_lite.models.loader import load_model as load

    model, _ = load(path)
    return type(model).__name__


def chat(path: str, messages: list[dict], **options: Any) -> str:
    """LLM(path).chat(messages): the prompt text the template made."""
    from vllm_lite import LLM, SamplingParams

    llm = LLM(path, device="cpu", kv_cache_space=0.01, swap_space=0, **options)
    out = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)
    return out[0].prompt


def read_gguf_header(path: str) -> int:
    from vllm_lite.models.gguf_file import check_model, read_header

    return check_model(read_header(path)).num_hidden_layers
