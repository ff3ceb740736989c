"""The engine's view of its workers: what one step asks of them, however many there are.

``Executor`` is the interface LLMEngine calls; ``UniprocExecutor`` runs one Worker in the
engine's own process (the only kind today). A multi-process executor (tensor parallel
ranks) would broadcast each SchedulerOutput to its workers and return the driver's
results, behind the same methods.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.layers.sampler import RngSnapshot
from vllm_lite.worker.model_runner import RunnerOutput
from vllm_lite.worker.worker import Worker

if TYPE_CHECKING:
    from vllm_lite.config import EngineConfig


class Executor(Protocol):
    def determine_num_blocks(self) -> tuple[int, int]: ...

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_cache_ops(self, out: SchedulerOutput) -> None: ...

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput: ...

    def snapshot_rng(self) -> RngSnapshot: ...

    def restore_rng(self, snap: RngSnapshot) -> None: ...

    def free_request(self, request_id: str) -> None: ...


class UniprocExecutor:
    """One Worker, in this process."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        self.worker = Worker(config, model)

    def determine_num_blocks(self) -> tuple[int, int]:
        return self.worker.determine_num_blocks()

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        self.worker.init_cache(num_gpu_blocks, num_cpu_blocks)

    def execute_cache_ops(self, out: SchedulerOutput) -> None:
        self.worker.execute_cache_ops(out)

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        return self.worker.execute_model(out)

    def snapshot_rng(self) -> RngSnapshot:
        return self.worker.snapshot_rng()

    def restore_rng(self, snap: RngSnapshot) -> None:
        self.worker.restore_rng(snap)

    def free_request(self, request_id: str) -> None:
        self.worker.free_request(request_id)
