"""Running a benchmark as a file: ``python3 benchmarks/X.py`` from a checkout.

The benchmarks are the package ``benchmarks`` (relative imports between them); a file run
directly has no package, so each runnable one starts with::

    if __name__ == "__main__" and not __package__:  # python3 benchmarks/X.py
        import _checkout
        _checkout.run_as_module(__file__)

which runs it again as ``benchmarks.X`` and exits.

Which vllm_lite it measures: ``python3 benchmarks/X.py`` puts benchmarks/ (not the
checkout) first on sys.path, so a plain ``import vllm_lite`` finds the installed package:
what the README's install gives. A checkout built in place (``python setup.py build_ext
--inplace``, as benchmarks/device_check.sh does) holds its own compiled ``vllm_lite/_C*``;
only then is the checkout put first, so that build is the one measured. A checkout without
``_C`` is never imported: its kernels would be missing.

benchmarks/ itself leaves sys.path: the files' names would shadow packages of the same name
for everything they import, and ``kernels`` is one (transformers imports the ``kernels``
package when installed, and would find benchmarks/kernels.py instead).
"""

from __future__ import annotations

import importlib.util
import runpy
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent
ROOT = BENCHMARKS.parent


def use_checkout_if_built() -> None:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCHMARKS]
    if any((ROOT / "vllm_lite").glob("_C*.so")) or any((ROOT / "vllm_lite").glob("_C*.pyd")):
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))


def load_package() -> None:
    """Imports this folder as the package ``benchmarks`` from its path, not through
    sys.path (where another package of that name could shadow it). The same as
    vllm_lite.entrypoints.cli.load_benchmarks, which an installed vllm_lite of another
    version may not have."""
    if "benchmarks" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "benchmarks", BENCHMARKS / "__init__.py", submodule_search_locations=[str(BENCHMARKS)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = module
    spec.loader.exec_module(module)


def run_as_module(path: str) -> None:
    """Runs the file at ``path`` (a module of benchmarks/) as ``benchmarks.<name>`` under
    ``__main__``, then exits with its status."""
    use_checkout_if_built()
    load_package()
    runpy.run_module(f"benchmarks.{Path(path).stem}", run_name="__main__", alter_sys=True)
    sys.exit(0)
