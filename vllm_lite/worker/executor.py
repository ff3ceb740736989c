"""The engine's view of its workers: what one step asks of them, however many there are.

``Executor`` is the interface LLMEngine calls (:func:`make_executor` picks one):
``UniprocExecutor`` runs one Worker in the engine's own process; ``MultiprocExecutor``
runs rank 0 of a tensor-parallel group here (the driver) and ranks 1..N-1 in their own
processes: block operations and each step's inputs go to them as broadcasts
(vllm_lite.worker.step_broadcast), the driver samples.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import weakref

import torch

from vllm_lite.core.scheduler import SchedulerOutput
from vllm_lite.errors import DistributedError
from vllm_lite.layers.sampler import RngSnapshot
from vllm_lite.worker.model_runner import RunnerOutput
from vllm_lite.worker import step_broadcast
from vllm_lite.worker.step_broadcast import Command
from vllm_lite.worker.worker import Worker

if TYPE_CHECKING:
    from vllm_lite.config.schema import EngineConfig


class Executor(Protocol):
    def determine_num_blocks(self) -> tuple[int, int]: ...

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None: ...

    def execute_cache_ops(self, out: SchedulerOutput) -> None: ...

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput: ...

    def snapshot_rng(self, out: SchedulerOutput) -> RngSnapshot: ...

    def restore_rng(self, snap: RngSnapshot) -> None: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """One Worker, in this process. (MultiprocExecutor reuses its delegation for what
    only the driver's worker does.)"""

    worker: Worker

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

    def snapshot_rng(self, out: SchedulerOutput) -> RngSnapshot:
        return self.worker.snapshot_rng(out)

    def restore_rng(self, snap: RngSnapshot) -> None:
        self.worker.restore_rng(snap)

    def shutdown(self) -> None:
        pass


class MultiprocExecutor(UniprocExecutor):
    """Rank 0 of a tensor-parallel group in this process; the other ranks in theirs.
    Sampling and its random states are rank 0's alone (UniprocExecutor's methods).

    A failed collective (a rank died, hung past distributed_timeout, disconnected), a local
    rank found dead, or a forward that failed after its inputs went out is fatal: every
    process is shut down and the DistributedError is raised, then again on every call."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        from vllm_lite.worker.tp_processes import LocalRanks

        if model is not None:
            raise ValueError("tensor_parallel_size > 1 loads each rank's shards from the "
                             "model's files; pass the model's path, not a module")
        self._failed: DistributedError | None = None
        self.ranks = LocalRanks(config)
        # Kill the local ranks if the engine is dropped or the interpreter exits without a
        # shutdown (the ranks' objects only: the finalizer must not keep self alive).
        self._finalizer = weakref.finalize(self, self.ranks.kill)
        self.tp = self.ranks.group
        try:
            self.worker = Worker(config, tp=self.tp)
        except BaseException:
            self._finalizer()
            raise

    def _guard(self, fn, *args):  # type: ignore[no-untyped-def]
        if self._failed is not None:
            raise self._failed
        try:
            self.ranks.check_alive()
            return fn(*args)
        except DistributedError as e:
            self._fail(e)
            raise
        except KeyboardInterrupt:
            # Maybe mid-step: the other ranks may wait in a collective the driver left, so
            # they cannot be asked to exit; stop them.
            self._fail(DistributedError("interrupted (KeyboardInterrupt) during a step; the "
                                        "tensor-parallel ranks were stopped"))
            raise

    def _fail(self, error: DistributedError) -> None:
        self._failed = error
        self._finalizer()  # the other ranks may be mid-collective: kill, don't ask

    def determine_num_blocks(self) -> tuple[int, int]:
        def run() -> tuple[int, int]:
            step_broadcast.send(self.tp, Command.NUM_BLOCKS, [])
            gpu, cpu = self.tp.min_cpu(list(self.worker.determine_num_blocks()))
            return gpu, cpu
        return self._guard(run)

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int) -> None:
        def run() -> None:
            step_broadcast.send(self.tp, Command.INIT_CACHE, [num_gpu_blocks, num_cpu_blocks])
            self.worker.init_cache(num_gpu_blocks, num_cpu_blocks)
        self._guard(run)

    def execute_cache_ops(self, out: SchedulerOutput) -> None:
        def run() -> None:
            if out.blocks_to_swap_out or out.blocks_to_swap_in or out.blocks_to_copy:
                step_broadcast.send_cache_ops(self.tp, out)
            self.worker.execute_cache_ops(out)
        self._guard(run)

    def execute_model(self, out: SchedulerOutput) -> RunnerOutput:
        return self._guard(self.worker.execute_model, out)

    def shutdown(self) -> None:
        """Tells the other ranks to exit and waits for them (killing stragglers)."""
        if not self._finalizer.alive:
            return
        if self._failed is None:
            try:
                # Bounded: a hung rank never takes the message.
                step_broadcast.send(self.tp, Command.SHUTDOWN, [], timeout_s=5.0)
            except DistributedError:
                pass  # a rank is gone or stuck: killed below
            self.ranks.shutdown()
        self._finalizer()

    @property
    def comm_seconds(self) -> float:
        """Seconds rank 0 spent in the model's all-reduces and gathers so far."""
        return self.tp.comm_seconds


def make_executor(config: EngineConfig, model: torch.nn.Module | None = None) -> Executor:
    if config.parallel_config.tensor_parallel_size > 1:
        return MultiprocExecutor(config, model)
    return UniprocExecutor(config, model)
