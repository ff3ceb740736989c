"""User-facing entry points."""

from vllm_lite.entrypoints.llm import LLM

__all__ = ["LLM"]
