"""Fixtures for the kernel tests: devices, CPU ISA variants and grid parametrization.

* ``device``  ("cpu", "cuda"): for ops whose CPU kernel has one implementation.
* ``backend`` (Backend): "cpu-<isa>" for every CPU ISA this machine runs (the fixture
  selects it with vllm_lite.ops.set_cpu_isa and restores the previous one afterwards),
  then "cuda". Tests marked ``@pytest.mark.grid(cases)`` get (backend, case) pairs; the
  non-default ISAs run only the cases with ``case.reduced``.

CUDA parameters are skipped, with the reason, when torch sees no GPU or vllm_lite was
built without its CUDA kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

try:
    from vllm_lite import ops as _ops
except ImportError as e:  # each test module then fails to import with this error
    _ops = None
    _OPS_ERROR: ImportError | None = e
else:
    _OPS_ERROR = None


def _has_kernel(op: str, key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_lite::{op}", key)
    except RuntimeError:
        return False


def cuda_skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device visible to torch (torch.cuda.is_available() is False)"
    if _ops is None:
        return f"vllm_lite native ops not importable: {_OPS_ERROR}"
    if not _has_kernel("paged_attention_v1", "CUDA"):
        return "vllm_lite was built without CUDA kernels (no CUDA impl registered)"
    return None


CUDA_SKIP = cuda_skip_reason()
cuda_mark = pytest.mark.skipif(CUDA_SKIP is not None, reason=CUDA_SKIP or "")


def cpu_isas() -> list[str]:
    if _ops is None:
        return ["default"]
    return list(getattr(_ops, "cpu_isas", lambda: ["default"])())


def current_cpu_isa() -> str | None:
    if _ops is None:
        return None
    get = getattr(_ops, "get_cpu_isa", None) or getattr(_ops, "cpu_isa", None)
    if callable(get):
        return get()
    return None


def default_cpu_isa() -> str:
    isas = cpu_isas()
    cur = current_cpu_isa()
    if cur in isas:
        return cur
    return isas[0]  # cpu_isas() lists the widest first


@dataclass(frozen=True)
class Backend:
    device: str
    isa: str | None = None
    reduced: bool = False  # a non-default CPU ISA: grids run their reduced subset

    def __str__(self) -> str:
        return self.device if self.isa is None else f"{self.device}-{self.isa}"


def backends() -> list[Backend]:
    default = default_cpu_isa()
    out = [Backend("cpu", isa, reduced=isa != default) for isa in cpu_isas()]
    # The default first so a plain `-x` run fails on it before the variants.
    out.sort(key=lambda b: b.reduced)
    out.append(Backend("cuda"))
    return out


def _backend_param(b: Backend, *values, id_suffix: str = ""):
    marks = [cuda_mark] if b.device == "cuda" else []
    return pytest.param(b, *values, id=f"{b}{id_suffix}", marks=marks)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    names = metafunc.fixturenames
    if "backend" in names:
        grid = metafunc.definition.get_closest_marker("grid")
        if grid is None:
            metafunc.parametrize(
                "backend", [_backend_param(b) for b in backends()], indirect=True
            )
        else:
            params = []
            for b in backends():
                for case in grid.args[0]:
                    if b.reduced and not case.reduced:
                        continue
                    if b.device == "cuda" and case.cpu_only:
                        continue
                    params.append(_backend_param(b, case, id_suffix=f"-{case.id}"))
            metafunc.parametrize(("backend", "case"), params, indirect=["backend"])
    elif "device" in names:
        metafunc.parametrize(
            "device",
            [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=[cuda_mark])],
        )


def _set_isa(isa: str) -> None:
    setter = getattr(_ops, "set_cpu_isa", None)
    if setter is not None:
        setter(isa)


@pytest.fixture(params=cpu_isas())
def isa(request: pytest.FixtureRequest):
    """Each CPU build this machine runs, selected in turn (set_cpu_isa) and restored after:
    the CPU-only linear kernels (int8_linear, int4_linear, packed_linear) follow the same
    switch as attention."""
    before = current_cpu_isa() or default_cpu_isa()
    _set_isa(request.param)
    try:
        yield request.param
    finally:
        _set_isa(before)


@pytest.fixture
def backend(request: pytest.FixtureRequest):
    b: Backend = request.param
    if b.device != "cpu" or b.isa == "default" or _ops is None:
        yield b
        return
    before = current_cpu_isa() or default_cpu_isa()
    _set_isa(b.isa)
    now = current_cpu_isa()
    assert now in (None, b.isa), f"set_cpu_isa({b.isa!r}) left the ISA at {now!r}"
    try:
        yield b
    finally:
        _set_isa(before)


@contextlib.contextmanager
def nan_filled_buffers() -> Iterator[None]:
    """Every tensor an op allocates on the CPU (its output and scratch) starts as NaN while
    this is open (torch's deterministic mode fills uninitialized memory), so an element it
    leaves unwritten shows whatever block the allocator hands out."""
    mode = torch.are_deterministic_algorithms_enabled()
    warn = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill
