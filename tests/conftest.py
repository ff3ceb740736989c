"""Shared pytest configuration for vllm_lite's tests."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

# Plain `pytest` from a checkout with an in-place build (`python3 setup.py build_ext
# --inplace`) but no install: make the checkout's vllm_lite importable. An installed
# vllm_lite always wins.
if importlib.util.find_spec("vllm_lite") is None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The benchmarks' tests import the checkout's benchmarks/ (never installed) as the package
# `benchmarks`, from its path: through sys.path another package of that name could shadow it.
_BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
if "benchmarks" not in sys.modules:
    _spec = importlib.util.spec_from_file_location(
        "benchmarks", _BENCHMARKS / "__init__.py", submodule_search_locations=[str(_BENCHMARKS)])
    sys.modules["benchmarks"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["benchmarks"])

# The CUDA kernels' content checks (lengths, block ids, slots) are opt-in; tests want them.
os.environ.setdefault("VLLM_LITE_CHECK_VALUES", "1")

# `pytest -n N` (pytest-xdist): N worker processes share the machine's cores, so each takes
# its share of torch's intra-op threads; N pools of all the cores each would oversubscribe
# them, and a thread pool that loses its core mid-barrier waits a whole time slice.
_XDIST_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _XDIST_WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _XDIST_WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "grid(cases): parametrize a kernel test over (backend, case); non-default CPU ISAs "
        "run only the cases marked reduced, CUDA skips the cases marked cpu_only",
    )
    config.addinivalue_line(
        "markers",
        "cuda_emulated: runs the CUDA kernels on the CPU in the SIMT emulator "
        "(tests/cuda_emulation; needs g++ with ASan/UBSan, no GPU)",
    )
    config.addinivalue_line(
        "markers",
        "full_grid: part of a slow test's full grid, beyond its representative default "
        "cases; runs with --full-grid (or VLLM_LITE_FULL_GRID=1, or -m selecting it)",
    )


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--full-grid", action="store_true", default=False,
                     help="also run the tests marked full_grid (the complete grids of the "
                          "slowest tests; VLLM_LITE_FULL_GRID=1 does the same)")


def full_grid(config: pytest.Config) -> bool:
    """Whether this run includes the full_grid tests: --full-grid, VLLM_LITE_FULL_GRID=1,
    or a -m expression (which then decides alone)."""
    return (config.getoption("--full-grid") or os.environ.get("VLLM_LITE_FULL_GRID") == "1"
            or bool(config.getoption("markexpr")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if full_grid(config):
        return
    dropped = [it for it in items if it.get_closest_marker("full_grid")]
    if dropped:
        items[:] = [it for it in items if not it.get_closest_marker("full_grid")]
        config.hook.pytest_deselected(items=dropped)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"torch {torch.__version__} (CUDA {torch.version.cuda}), "
             f"CUDA device: {torch.cuda.is_available()}"]
    try:
        import vllm_lite
        from vllm_lite import ops

        isas = getattr(ops, "cpu_isas", lambda: ["default"])()
        try:
            from vllm_lite import _build_info

            with_cuda = getattr(_build_info, "WITH_CUDA", "?")
        except ImportError:
            with_cuda = "? (no vllm_lite._build_info)"
        lines.append(f"vllm_lite {vllm_lite.__version__}: CPU ISAs {list(isas)}, "
                     f"built with CUDA: {with_cuda}")
    except Exception as e:  # noqa: BLE001  (the header must never break collection)
        lines.append(f"vllm_lite native ops not importable: {e}")
    if not full_grid(config):
        lines.append("full_grid tests deselected (the representative grid): --full-grid "
                     "runs them too")
    return lines


@pytest.fixture(autouse=True)
def _seed_torch() -> None:
    """Tests draw from explicit generators; this only pins anything that does not."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The server and deployment tests' checkpoint: a tiny random Llama with a tokenizer and
    a chat template (context 256, vocabulary entrypoints.utils.VOCAB)."""
    from entrypoints.utils import EOS, VOCAB
    from models.helpers import make_config, make_tokenizer, save_hf_model

    folder = tmp_path_factory.mktemp("server_llama")
    config = make_config("llama")  # max_position_embeddings 256: the context
    config.vocab_size = VOCAB
    config.eos_token_id = EOS
    save_hf_model(config, folder)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def offline(model_dir: Path) -> Any:
    """An offline LLM on ``model_dir``: the reference for servers' answers."""
    from entrypoints.utils import make_llm

    return make_llm(model_dir)
