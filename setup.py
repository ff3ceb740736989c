"""Builds vllm_lite and its native extension vllm_lite._C, through CMakeLists.txt.

The extension is one CMake target (vllm_lite_python) of the build that C++ users run too:
setup.py configures build/cmake with VLLM_LITE_PYTHON_MODULE=ON, builds that target and
copies it into the package. The kernels compile once into an object library that the
extension and the C++ library (vllm_lite_kernels) both link, so `cmake --build build/cmake`
after `pip install .` builds the C++ library and tests without compiling a kernel again.

Environment:
  VLLM_LITE_TARGET   "auto" (default): the CUDA kernels too when torch is a CUDA build, a
                     CUDA toolkit is found and there is a GPU to build for (one is visible,
                     or TORCH_CUDA_ARCH_LIST names the architectures), else the CPU kernels
                     alone (CMake says why in one line); "cuda" demands the CUDA kernels (for
                     8.0;9.0 when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset); "cpu"
                     builds the CPU kernels alone. A CUDA build that fails fails the install;
                     it never falls back to CPU silently. (CMake: VLLM_LITE_CUDA=AUTO|ON|OFF.)
  TORCH_CUDA_ARCH_LIST, CUDA_HOME, VLLM_LITE_HEAD_SIZES, VLLM_LITE_KV_CACHE_DTYPES,
  VLLM_LITE_COMPILER_CACHE, VLLM_LITE_PRECOMPILED_HEADERS
                     passed to CMake on every build (see CMakeLists.txt), so that a value
                     cached by an earlier build never outlives the environment that set it.
  MAX_JOBS           parallel compile jobs (default: the CPU count).
  VLLM_LITE_BUILD_DIR  the CMake build folder (default build/cmake).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
log = logging.getLogger("vllm_lite.setup")
logging.basicConfig(level=logging.INFO, format="[vllm_lite setup] %(message)s")

TARGETS = {"auto": "AUTO", "cuda": "ON", "cpu": "OFF"}
# Environment variables that CMakeLists.txt reads as cache variables of the same name.
PASSED_THROUGH = ("TORCH_CUDA_ARCH_LIST", "VLLM_LITE_HEAD_SIZES", "VLLM_LITE_KV_CACHE_DTYPES",
                  "VLLM_LITE_COMPILER_CACHE", "VLLM_LITE_PRECOMPILED_HEADERS")


def build_dir() -> Path:
    return Path(os.environ.get("VLLM_LITE_BUILD_DIR") or ROOT / "build" / "cmake").resolve()


def cmake_configure_args(folder: Path) -> list[str]:
    import torch

    target = os.environ.get("VLLM_LITE_TARGET", "auto").lower()
    if target not in TARGETS:
        sys.exit(f"VLLM_LITE_TARGET must be auto, cpu or cuda, got {target!r}")
    args = [
        f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
        f"-DPython3_EXECUTABLE={sys.executable}",
        f"-DVLLM_LITE_CUDA={TARGETS[target]}",
        "-DVLLM_LITE_PYTHON_MODULE=ON",
    ]
    for name in PASSED_THROUGH:
        value = os.environ.get(name)
        # Unset: forget what an earlier build cached, so CMake decides afresh.
        args.append(f"-D{name}={value}" if value is not None else f"-U{name}")
    if not (folder / "CMakeCache.txt").exists():
        args.append("-DCMAKE_BUILD_TYPE=Release")
        if shutil.which("ninja"):
            args += ["-G", "Ninja"]  # a folder keeps the generator it was made with
    return args


class CMakeBuild(build_ext):
    """Builds the extension's CMake target and puts it where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        if shutil.which("cmake") is None:
            sys.exit("vllm_lite's build needs cmake >= 3.22 on PATH (pip install cmake)")
        folder = build_dir()
        folder.mkdir(parents=True, exist_ok=True)
        configure = ["cmake", "-S", str(ROOT), "-B", str(folder), *cmake_configure_args(folder)]
        log.info("%s", " ".join(configure))
        subprocess.run(configure, check=True)
        jobs = os.environ.get("MAX_JOBS") or str(os.cpu_count() or 1)
        subprocess.run(["cmake", "--build", str(folder), "--target", "vllm_lite_python",
                        "-j", jobs], check=True)
        built = sorted(folder.glob("_C*" + (".pyd" if os.name == "nt" else ".so")))
        if len(built) != 1:
            sys.exit(f"expected one _C module in {folder}, found {[p.name for p in built]}")
        dest = Path(self.get_ext_fullpath(ext.name))
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(built[0], dest)
        # Beside _C: whether this build promised CUDA kernels, for the tests.
        info = folder / "vllm_lite_build_info.py"
        shutil.copyfile(info, dest.parent / "_build_info.py")
        log.info("built %s (%s)", dest, info.read_text().splitlines()[-2])

    def copy_extensions_to_source(self) -> None:
        """--inplace: setuptools copies _C into the checkout; _build_info.py goes with it."""
        super().copy_extensions_to_source()
        shutil.copyfile(build_dir() / "vllm_lite_build_info.py",
                        ROOT / "vllm_lite" / "_build_info.py")


setup(
    packages=find_packages(include=["vllm_lite", "vllm_lite.*"]),
    ext_modules=[Extension("vllm_lite._C", sources=[])],
    cmdclass={"build_ext": CMakeBuild},
)
