"""The hostile-file suite's probe runner.

Every load of a hostile file runs in a separate process (spawned once per test module and
reused) under a memory limit, and each probe under a deadline: a file that made the loader
allocate gigabytes or loop for minutes fails its test there, instead of taking the test
run (or the machine) down with it. A probe returns ("ok", value) or ("error", exception
type, message); a probe past its deadline or killed by its memory limit is a failure, and
the runner starts a fresh process for the next one.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

#: The probe process's data limit (heap and anonymous mappings): torch, transformers and a
#: tiny model take well under it; a load that trusts a lying size does not.
PROBE_MEMORY_BYTES = 3 << 30
#: Seconds one probe may take (a tiny model loads in a few; a lying one would run for minutes).
PROBE_TIMEOUT_S = 60.0


def _limit_memory(limit: int, cache: str) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    os.environ["VLLM_LITE_CACHE"] = cache  # converted GGUF folders go to the test's tmp


def _call(fn: Callable[..., Any], args: tuple, kwargs: dict) -> tuple:
    try:
        return ("ok", fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001  (the probe reports what the loader raised)
        return ("error", type(e).__name__, str(e))


class ProbeRunner:
    def __init__(self, cache: str) -> None:
        self.cache = cache
        self.pool: cf.ProcessPoolExecutor | None = None

    def _pool(self) -> cf.ProcessPoolExecutor:
        if self.pool is None:
            self.pool = cf.ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_limit_memory, initargs=(PROBE_MEMORY_BYTES, self.cache))
        return self.pool

    def close(self) -> None:
        if self.pool is not None:
            for proc in list(getattr(self.pool, "_processes", {}).values()):
                proc.kill()
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None

    def __call__(self, fn: Callable[..., Any], *args: Any, timeout: float = PROBE_TIMEOUT_S,
                 **kwargs: Any) -> tuple:
        future = self._pool().submit(_call, fn, args, kwargs)
        try:
            return future.result(timeout=timeout)
        except cf.TimeoutError:
            self.close()
            pytest.fail(f"{fn.__name__}{args} did not finish within {timeout} s")
        except cf.process.BrokenProcessPool:
            self.close()
            pytest.fail(f"{fn.__name__}{args} killed its process (memory limit "
                        f"{PROBE_MEMORY_BYTES >> 30} GiB?)")

    def refuses(self, fn: Callable[..., Any], *args: Any, match: str,
                error: str = "ValueError", **kwargs: Any) -> str:
        """Runs the probe and checks it raised ``error`` whose message contains every
        ``|``-separated word of ``match`` (case-insensitive); returns the message."""
        result = self(fn, *args, **kwargs)
        assert result[0] == "error", f"{fn.__name__}{args} was accepted: {result}"
        assert result[1] == error, f"{fn.__name__}{args} raised {result[1]}: {result[2]}"
        for word in match.split("|"):
            assert word.lower() in result[2].lower(), (word, result[2])
        return result[2]


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProbeRunner]:
    runner = ProbeRunner(str(tmp_path_factory.mktemp("probe_cache")))
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama folder with a tokenizer and chat template: the honest baseline
    each hostile variant is a change of."""
    from models.helpers import make_config, make_tokenizer, save_hf_model

    folder = tmp_path_factory.mktemp("good")
    config = make_config("llama")
    config.vocab_size = 300
    save_hf_model(config, folder, seed=random.randrange(1 << 20))
    make_tokenizer(folder)
    return folder
