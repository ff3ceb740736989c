"""Which vllm_lite the scripts in bench/ run.

``python3 bench/X.py`` puts bench/ (not the checkout) first on sys.path, so a plain
``import vllm_lite`` finds the installed package: what the README's install gives. A
checkout built in place (``python setup.py build_ext --inplace``, as bench/device_check.sh
does) holds its own compiled ``vllm_lite/_C*``; only then is the checkout put first, so
that build is the one measured. A checkout without ``_C`` is never imported: its kernels
would be missing.

bench/ itself then leaves sys.path: the scripts' names would shadow packages of the same
name for everything they import, and ``kernels`` is one (transformers 5.25 imports the
``kernels`` package when installed, and found bench/kernels.py instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent


def use_checkout_if_built() -> None:
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]
    if any((ROOT / "vllm_lite").glob("_C*.so")) or any((ROOT / "vllm_lite").glob("_C*.pyd")):
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
