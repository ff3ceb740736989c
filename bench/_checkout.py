"""Which vllm_lite the scripts in bench/ run.

``python3 bench/X.py`` puts bench/ (not the checkout) first on sys.path, so a plain
``import vllm_lite`` finds the installed package: what the README's install gives. A
checkout built in place (``python setup.py build_ext --inplace``, as bench/device_check.sh
does) holds its own compiled ``vllm_lite/_C*``; only then is the checkout put first, so
that build is the one measured. A checkout without ``_C`` is never imported: its kernels
would be missing.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def use_checkout_if_built() -> None:
    if any((ROOT / "vllm_lite").glob("_C*.so")) or any((ROOT / "vllm_lite").glob("_C*.pyd")):
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
