"""The processes of a tensor-parallel engine: the driver starts and watches its local
ranks; :func:`worker_main` is every other rank's program (``vllm-lite worker``).

Local ranks run :func:`worker_main` in fresh interpreters (what multiprocessing's spawn
does, without re-importing the user's ``__main__``, so a script without an ``if __name__ ==
"__main__"`` guard still works; the driver's vllm_lite first on their path) with
torchrun's variables pointing at the driver's store. Each rank: connect to the store, say it joined, read the
engine's config, join the groups, load its shards, then serve the driver's messages.

Lifetimes: a worker ignores SIGINT (the driver turns Ctrl-C into an orderly shutdown of
all ranks), exits when the driver sends SHUTDOWN, when a collective fails (the driver died
or disconnected) and, for local ranks, when its parent process is gone.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import torch

from vllm_lite.distributed.group import TensorParallelGroup
from vllm_lite.distributed.rendezvous import CONFIG_KEY, Rendezvous, joined_key
from vllm_lite.errors import DistributedError

if TYPE_CHECKING:
    from vllm_lite.config.schema import EngineConfig

logger = logging.getLogger(__name__)

# Env var naming the driver's pid: a local rank exits when that process is gone.
_PARENT_ENV = "VLLM_LITE_DRIVER_PID"
# How often the driver looks at its ranks while waiting for them to join.
_POLL_S = 0.05


class HFConfigValues:
    """A transformers config as the ranks receive it: its attributes' values, no class.
    Unpickling transformers' own config class imports transformers, about 3 CPU-s in each
    rank; the model code reads attributes only."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)

    def __repr__(self) -> str:
        return f"HFConfigValues({self.__dict__!r})"


def _config_values(hf_config: Any) -> HFConfigValues:
    """Every attribute of ``hf_config`` that reading gives (instance values, class
    defaults, properties, attribute_map's aliases), nested configs converted too.
    config_for_ranks checks the result needs no transformers class."""
    names = [n for n in dir(hf_config) if not n.startswith("__")]
    names += list(getattr(hf_config, "attribute_map", {}) or {})
    values: dict[str, Any] = {}
    quiet = logging.getLogger("transformers")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # deprecated aliases (torch_dtype, ...) warn when read
    try:
        for name in names:
            try:
                value = getattr(hf_config, name)
            except Exception:  # noqa: BLE001  (a property that does not apply: absent here too)
                continue
            if callable(value) and not isinstance(value, torch.dtype):
                continue
            if type(value).__module__.startswith("transformers"):
                if not hasattr(value, "to_dict"):
                    continue  # a view object (per-layer configs) the models do not read
                value = _config_values(value)  # a nested config (text_config, ...)
            values[name] = value
    finally:
        quiet.setLevel(level)
    return HFConfigValues(values)


class _WithoutTransformers(pickle.Unpickler):
    """Unpickles what needs no transformers class (what a rank could load cheaply)."""

    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] == "transformers":
            raise pickle.UnpicklingError(f"{module}.{name}")
        return super().find_class(module, name)


def config_for_ranks(config: EngineConfig) -> EngineConfig:
    """``config`` with its transformers config as plain values (HFConfigValues) where that
    is possible, else unchanged."""
    values = _config_values(config.model_config.hf_config)
    try:  # once, for the whole tree: nested configs are HFConfigValues inside it
        _WithoutTransformers(io.BytesIO(pickle.dumps(values))).load()
    except Exception:  # noqa: BLE001  (unpicklable, or it would import transformers)
        return config
    model_config = dataclasses.replace(config.model_config, hf_config=values)
    return dataclasses.replace(config, model_config=model_config)


def rank_device(config: EngineConfig, local_rank: int) -> torch.device:
    """Rank r's device: the CPU, or the CUDA device of its local rank."""
    if config.device.type == "cuda":
        return torch.device("cuda", local_rank)
    return config.device


def threads_per_rank(world_size: int) -> int:
    """CPU ranks share the machine's cores: each gets its share of torch's threads."""
    return max(1, (os.cpu_count() or 1) // world_size)


class LocalRanks:
    """Driver side: the store, the local worker processes, and rank 0's group."""

    def __init__(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.world_size = pc.tensor_parallel_size
        self.timeout_s = pc.distributed_timeout
        rdv = Rendezvous.from_env(self.world_size)
        self.store = rdv.store(self.timeout_s)
        port = self.store.port
        self.store.set(CONFIG_KEY, pickle.dumps(config_for_ranks(config)))
        if config.device.type == "cpu":
            torch.set_num_threads(threads_per_rank(rdv.local_world_size))
        self.procs: dict[int, subprocess.Popen] = {}
        env = dict(os.environ)
        env[_PARENT_ENV] = str(os.getpid())
        # The ranks import the driver's vllm_lite: its folder goes first on sys.path, ahead
        # of the working directory (`python -m` would put a source checkout there, without
        # its compiled extension, before an installed package).
        import vllm_lite

        root = os.path.dirname(os.path.dirname(os.path.abspath(vllm_lite.__file__)))
        program = (f"import sys; sys.path.insert(0, {root!r}); "
                   "from vllm_lite.worker.tp_processes import worker_main; "
                   "sys.exit(worker_main())")
        for rank in range(1, rdv.local_world_size):
            self.procs[rank] = subprocess.Popen(
                [sys.executable, "-c", program], env={**env, **rdv.worker_env(rank, port)})
        logger.info("tensor parallel: %d ranks (%d here), store %s:%d",
                    self.world_size, rdv.local_world_size, rdv.host, port)
        try:
            self._wait_joined()
            self.group = TensorParallelGroup(self.store, 0, self.world_size,
                                             rank_device(config, 0), self.timeout_s)
        except BaseException:
            self.kill()
            raise

    def _wait_joined(self) -> None:
        """Until every rank reached the store; a local rank that exits first, or a rank
        that does not come within the timeout, is a DistributedError naming it."""
        deadline = time.monotonic() + self.timeout_s
        missing = set(range(1, self.world_size))
        while missing:
            self.check_alive()
            missing = {r for r in missing if not self.store.check([joined_key(r)])}
            if missing and time.monotonic() > deadline:
                raise DistributedError(
                    f"tensor-parallel rank(s) {sorted(missing)} did not join within "
                    f"distributed_timeout={self.timeout_s:g}s (remote ranks run `vllm-lite "
                    "worker` with MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK set)")
            if missing:
                time.sleep(_POLL_S)

    def check_alive(self) -> None:
        for rank, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                raise DistributedError(f"tensor-parallel rank {rank} (pid {proc.pid}) exited "
                                       f"with code {code}; see its log above")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Waits for the local ranks to exit (after SHUTDOWN), killing those that don't."""
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _exit_with_parent(parent: int) -> None:
    """A local rank's watchdog: its driver gone (even SIGKILLed), it exits too."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(1)
    threading.Thread(target=watch, name="driver-watchdog", daemon=True).start()


def worker_main() -> int:
    """A rank other than 0: join, load the shards, serve the driver until SHUTDOWN."""
    from vllm_lite.worker.worker import Worker

    logging.basicConfig(level=os.environ.get("VLLM_LITE_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s [rank %(process)d] %(name)s: "
                               "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # `kill -USR1 <pid>` prints where a stuck rank is (every thread's Python stack).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parent = os.environ.get(_PARENT_ENV)
    if parent is not None:
        _exit_with_parent(int(parent))
    rdv = Rendezvous.from_env()
    if rdv.rank == 0:
        raise ValueError("RANK 0 is the engine itself (LLM / vllm-lite serve with "
                         "--tensor-parallel-size); workers are ranks 1..WORLD_SIZE-1")
    # The store's own timeout bounds the wait for a driver that is not up yet.
    store = rdv.store(timeout_s=float(os.environ.get("VLLM_LITE_JOIN_TIMEOUT", "600")))
    store.set(joined_key(rdv.rank), b"1")
    config: EngineConfig = pickle.loads(store.get(CONFIG_KEY))
    pc = config.parallel_config
    if pc.tensor_parallel_size != rdv.world_size:
        raise ValueError(f"WORLD_SIZE {rdv.world_size} != the engine's tensor_parallel_size "
                         f"{pc.tensor_parallel_size}")
    if config.device.type == "cpu":
        torch.set_num_threads(threads_per_rank(rdv.local_world_size))
    group = TensorParallelGroup(store, rdv.rank, rdv.world_size,
                                rank_device(config, rdv.local_rank), pc.distributed_timeout)
    worker = Worker(config, tp=group)
    try:
        worker.serve()
    except DistributedError as e:
        logger.error("%s; exiting", e)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
