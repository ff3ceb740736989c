"""ModelConfig and EngineConfig: everything the engine needs, validated once when built.

The cache and scheduler parts reuse vllm_lite.config's CacheConfig / SchedulerConfig.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import torch

from vllm_lite.config import (
    DEFAULT_MAX_LOGPROBS, GiB, CacheConfig, SchedulerConfig, check_int, check_number,
    total_memory_bytes)


def resolve_device(device: Union[str, torch.device]) -> torch.device:
    if isinstance(device, torch.device):
        dev = device
    elif device == "auto":
        dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(device)
        except RuntimeError as e:
            raise ValueError(f"device {device!r} is not a torch device: {e}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu, cuda or auto, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but torch sees no CUDA device")
    return dev


@dataclass
class ModelConfig:
    """The model folder, its HF config and the serving limits derived from it."""

    model: str
    tokenizer: Optional[str] = None
    dtype: Union[str, torch.dtype] = "auto"
    # None: the model's max_position_embeddings.
    max_model_len: Optional[int] = None
    seed: int = 0
    # The most logprobs / prompt_logprobs one request may ask for (vLLM's max_logprobs).
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    hf_config: Any = field(default=None, repr=False)

    def __post_init__(self) -> None:
        from vllm_lite.models import resolve_model
        from vllm_lite.models.loader import read_hf_config

        self.max_logprobs = check_int("max_logprobs", self.max_logprobs, 0)
        # An alias (smollm2-135m) or a .gguf file becomes its converted, cached HF folder.
        path = resolve_model(self.model)
        self.model = str(path)
        if not path.is_dir() or not (path / "config.json").is_file():
            raise ValueError(
                f"model {self.model!r} is not a local Hugging Face model folder (config.json)"
            )
        if self.tokenizer is None:
            self.tokenizer = self.model
        if self.hf_config is None:
            # Checks config.json's sizes; a bad file is a ValueError naming the key.
            self.hf_config = read_hf_config(path)
        limit = getattr(self.hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            self.max_model_len = int(limit) if limit else 2048
        elif isinstance(self.max_model_len, bool) or not isinstance(self.max_model_len, int) \
                or self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {self.max_model_len!r}")
        elif limit and self.max_model_len > limit:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def eos_token_id(self) -> Optional[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if isinstance(eos, (list, tuple)):
            eos = eos[0] if eos else None
        return eos


@dataclass
class EngineConfig:
    """The whole engine: model, KV cache, scheduler, device and memory budgets."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    # GiB of KV cache when the device is the CPU (vLLM's VLLM_CPU_KVCACHE_SPACE).
    kv_cache_space: float = 4.0
    num_gpu_blocks_override: Optional[int] = None

    def __post_init__(self) -> None:
        self.kv_cache_space = check_number("kv_cache_space", self.kv_cache_space)
        if not self.kv_cache_space > 0:
            raise ValueError(f"kv_cache_space must be > 0 GiB, got {self.kv_cache_space}")
        total = total_memory_bytes()
        if total is not None:
            # Both are host memory: more than the whole machine can never be allocated.
            # (Their sum is not checked: the pools are allocated lazily by the OS, and the
            # defaults, 4 + 4 GiB, must keep working on small machines.)
            for name, gib in (("kv_cache_space", self.kv_cache_space),
                              ("swap_space", self.cache_config.swap_space_gib)):
                if gib * GiB > total:
                    raise ValueError(f"{name} {gib} GiB is more than this machine's memory "
                                     f"({total / GiB:.1f} GiB)")
        if self.num_gpu_blocks_override is not None and (
            isinstance(self.num_gpu_blocks_override, bool)
            or not isinstance(self.num_gpu_blocks_override, int)
            or self.num_gpu_blocks_override < 1
        ):
            raise ValueError(
                f"num_gpu_blocks_override must be a positive int, got "
                f"{self.num_gpu_blocks_override!r}"
            )
        if self.scheduler_config.max_model_len != self.model_config.max_model_len:
            raise ValueError(
                f"scheduler max_model_len {self.scheduler_config.max_model_len} != model "
                f"max_model_len {self.model_config.max_model_len}"
            )
