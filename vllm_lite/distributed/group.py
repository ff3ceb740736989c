"""One tensor-parallel group: the ranks that hold one model's shards, and their collectives.

Built on torch.distributed's process-group backends, used as objects rather than through
``init_process_group``'s process-wide default group: the driver process holds rank 0 of
its engine's group, and a process may hold several engines (tests, a server next to a
benchmark), each with its own group. Three groups over one store (``PrefixStore``):

- ``control`` (gloo, no practical timeout): the driver's one-int64 "what next" broadcast.
  Workers wait on it between steps, however long the engine idles; a dead driver closes
  the connection and the wait fails at once.
- ``cpu`` (gloo, ``distributed_timeout``): the step's inputs (host tensors) and small
  host reductions (the KV block count).
- ``device`` (NCCL on CUDA, the cpu group on CPU, ``distributed_timeout``): the model's
  all-reduces and the logits gather.

A collective that fails or outlasts the timeout raises :class:`DistributedError` naming
the group's ranks: the engine cannot go on (the ranks' states may differ) and shuts down.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Any

import torch
import torch.distributed as dist

from vllm_lite.errors import DistributedError

logger = logging.getLogger(__name__)

# gloo wants a finite timeout; ten years is "never" for an idle engine.
_FOREVER = datetime.timedelta(days=3650)


def _gloo(store: Any, prefix: str, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, timeout)


class TensorParallelGroup:
    """Rank ``rank`` of ``size``; the collectives every rank calls in the same order."""

    def __init__(self, store: Any, rank: int, size: int, device: torch.device,
                 timeout_s: float) -> None:
        self.rank = rank
        self.size = size
        self.device = device
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        self.control = _gloo(store, "control/", rank, size, _FOREVER)
        self.cpu = _gloo(store, "cpu/", rank, size, timeout)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds each rank's communicator to it
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, opts)
        else:
            self.dev = self.cpu
        # Seconds spent in the model's collectives (the benchmark's all-reduce share).
        self.comm_seconds = 0.0

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def _wait(self, work: Any, what: str, timeout_s: float | None = None) -> None:
        try:
            if timeout_s is None:
                work.wait()
            else:
                work.wait(datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # gloo / NCCL raise RuntimeError subclasses of many kinds
            raise DistributedError(
                f"tensor-parallel rank {self.rank}/{self.size}: {what} failed (a rank died, "
                f"hung past distributed_timeout={self.timeout_s:g}s, or disconnected): {e}"
            ) from e

    # -- the model's collectives (device group) ------------------------------------------------
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum of ``t`` over the ranks, in place (t must be contiguous)."""
        start = time.perf_counter()
        self._wait(self.dev.allreduce([t]), "all_reduce")
        self.comm_seconds += time.perf_counter() - start
        return t

    def all_gather_last_dim(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` [..., n] concatenated along the last dim, rank order."""
        start = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self._wait(self.dev.allgather([parts], [t]), "all_gather")
        self.comm_seconds += time.perf_counter() - start
        return torch.cat(parts, dim=-1)

    # -- the driver's messages (control + cpu groups) ------------------------------------------
    def broadcast_header(self, values: list[int] | None, length: int,
                         timeout_s: float | None = None) -> list[int]:
        """Rank 0 sends ``values`` (at most ``length`` ints); the others pass None and wait
        for them without a timeout (an idle engine sends nothing). Rank 0 waits at most
        ``timeout_s`` (default distributed_timeout) for the ranks to take it: a stopped
        rank may never post its receive."""
        t = torch.zeros(length, dtype=torch.int64)
        if values is not None:
            if len(values) > length:
                raise ValueError(f"a header holds {length} ints, got {len(values)}")
            t[:len(values)] = torch.tensor(values, dtype=torch.int64)
        if values is not None and timeout_s is None:
            timeout_s = self.timeout_s
        self._wait(self.control.broadcast(t, 0), "command broadcast", timeout_s)
        return [int(x) for x in t.tolist()]

    def broadcast_cpu(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (rank 0's values; the others pass a buffer of the same shape and dtype)."""
        self._wait(self.cpu.broadcast(t, 0), "step broadcast")
        return t

    def min_cpu(self, values: list[int]) -> list[int]:
        """Element-wise minimum over the ranks of a few ints."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self._wait(self.cpu.allreduce([t], opts), "min all_reduce")
        return [int(x) for x in t.tolist()]


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, length) of rank's equal share of ``total`` (which the size divides)."""
    if total % size:
        raise ValueError(f"{total} does not split over {size} ranks")
    n = total // size
    return rank * n, n


def kv_head_range(num_kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) a rank holds: an equal share when the ranks divide the heads,
    else one head replicated over size / num_kv_heads consecutive ranks (as vLLM)."""
    if num_kv_heads % size == 0:
        return shard_range(num_kv_heads, rank, size)
    if size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads do not split or replicate over {size} ranks")
    return rank // (size // num_kv_heads), 1
