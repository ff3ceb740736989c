"""Where the ranks of a tensor-parallel engine meet: torchrun's environment variables and
one TCPStore hosted by the driver (rank 0).

- One machine (no ``MASTER_ADDR`` set): the driver hosts the store on 127.0.0.1, a free
  port, and starts ranks 1..N-1 itself.
- Several machines: every process gets torchrun's variables: ``MASTER_ADDR`` /
  ``MASTER_PORT`` (the driver's machine and the store's port), ``WORLD_SIZE`` (= the
  engine's tensor_parallel_size), ``RANK``, ``LOCAL_RANK`` (the CUDA device on its
  machine) and, on the driver's machine, ``LOCAL_WORLD_SIZE``: the driver (RANK 0) starts
  ranks 1..LOCAL_WORLD_SIZE-1 beside itself; the other machines run ``vllm-lite worker``
  with their ranks. A worker reads the engine's whole config from the store, so it needs
  no flags of its own.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

CONFIG_KEY = "vllm_lite/config"


def joined_key(rank: int) -> str:
    """Set by a rank once it reached the store (the driver waits on these at start-up)."""
    return f"vllm_lite/joined/{rank}"


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int  # 0: pick a free one (the driver on one machine)
    world_size: int
    rank: int
    local_rank: int
    local_world_size: int

    @classmethod
    def from_env(cls, tensor_parallel_size: int | None = None) -> Rendezvous:
        """The driver's view (``tensor_parallel_size`` given) or a worker's (None), from
        torchrun's variables; ValueError naming a variable that is missing or wrong."""
        env = os.environ
        if tensor_parallel_size is not None and "MASTER_ADDR" not in env:
            return cls("127.0.0.1", 0, tensor_parallel_size, 0, 0, tensor_parallel_size)

        def read(name: str, default: int | None = None) -> int:
            raw = env.get(name)
            if raw is None:
                if default is None:
                    raise ValueError(f"environment variable {name} is not set (torchrun's "
                                     "MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK)")
                return default
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"environment variable {name} must be an int, got {raw!r}") \
                    from None

        if "MASTER_ADDR" not in env:
            raise ValueError("environment variable MASTER_ADDR is not set: a worker joins the "
                             "driver at MASTER_ADDR:MASTER_PORT")
        world = read("WORLD_SIZE", tensor_parallel_size)
        rank = read("RANK", 0 if tensor_parallel_size is not None else None)
        r = cls(env["MASTER_ADDR"], read("MASTER_PORT"), world, rank,
                read("LOCAL_RANK", rank), read("LOCAL_WORLD_SIZE", world))
        if tensor_parallel_size is not None:
            if world != tensor_parallel_size:
                raise ValueError(f"WORLD_SIZE {world} != tensor_parallel_size "
                                 f"{tensor_parallel_size}")
            if rank != 0:
                raise ValueError(f"the engine (the driver) must be RANK 0, got RANK {rank}; "
                                 "other ranks run `vllm-lite worker`")
        if not 0 <= rank < world:
            raise ValueError(f"RANK {rank} is outside WORLD_SIZE {world}")
        if not 1 <= r.local_world_size <= world:
            raise ValueError(f"LOCAL_WORLD_SIZE {r.local_world_size} must be in 1..{world}")
        return r

    def store(self, timeout_s: float) -> Any:
        """The driver hosts the store (rank 0); a worker connects to it."""
        return dist.TCPStore(self.host, self.port, self.world_size, self.rank == 0,
                             timeout=datetime.timedelta(seconds=timeout_s),
                             wait_for_workers=False)

    def worker_env(self, rank: int, port: int) -> dict[str, str]:
        """torchrun's variables for a rank the driver starts on its own machine."""
        return {"MASTER_ADDR": self.host, "MASTER_PORT": str(port),
                "WORLD_SIZE": str(self.world_size), "RANK": str(rank),
                "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.local_world_size)}
