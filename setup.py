"""Builds vllm_lite and its native extension vllm_lite._C.

VLLM_LITE_TARGET picks the kernels: "auto" (default) builds CUDA kernels when torch is a
CUDA build and nvcc is found, "cuda" demands them, "cpu" builds the CPU kernels alone. A
CUDA build that fails fails the install; it never falls back to CPU silently.
"""

from __future__ import annotations

import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent.resolve()
log = logging.getLogger("vllm_lite.setup")
logging.basicConfig(level=logging.INFO, format="[vllm_lite setup] %(message)s")


def read_sources() -> dict[str, list[str]]:
    parts: dict[str, list[str]] = {"common": [], "python": [], "cuda": []}
    for line in (ROOT / "csrc" / "sources.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            part, path = line.split()
            parts[part].append(path)
    return parts


def find_cuda_home() -> str | None:
    """CUDA_HOME if set, else the toolkit that the nvcc on PATH really runs.

    nvcc here may be a wrapper script in another folder, so torch's guess (the folder
    above nvcc) can be wrong; nvcc's dry run prints where the real compiler lives.
    """
    if os.environ.get("CUDA_HOME"):
        return os.environ["CUDA_HOME"]
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    try:
        dry = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", os.devnull, "-o", os.devnull],
            capture_output=True, text=True, timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return str(Path(nvcc).resolve().parent.parent)
    m = re.search(r"_HERE_=(\S+)", dry.stdout + dry.stderr)
    here = Path(m.group(1)) if m else Path(nvcc).resolve().parent
    return str(here.resolve().parent)


def loaded_libstdcxx() -> str | None:
    """The path of the shared libstdc++ this process loaded with torch, or None."""
    importlib.import_module("torch")  # libtorch loads the C++ runtime
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split()
        if len(fields) >= 6 and re.fullmatch(r"libstdc\+\+\.so(\.\d+)*", Path(fields[5]).name):
            return fields[5]
    return None


def pick_target(cuda_home: str | None) -> str:
    import torch

    target = os.environ.get("VLLM_LITE_TARGET", "auto").lower()
    if target not in ("auto", "cpu", "cuda"):
        sys.exit(f"VLLM_LITE_TARGET must be auto, cpu or cuda, got {target!r}")
    have_cuda = torch.version.cuda is not None and cuda_home is not None
    if target == "cuda" and not have_cuda:
        sys.exit(
            "VLLM_LITE_TARGET=cuda but "
            + ("torch is a CPU build" if torch.version.cuda is None else "nvcc was not found")
        )
    if target == "auto":
        target = "cuda" if have_cuda else "cpu"
    return target


def extension_modules() -> tuple[list, dict]:
    cuda_home = find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # before cpp_extension reads it at import
    target = pick_target(cuda_home)

    from torch.utils import cpp_extension

    sources = read_sources()
    files = sources["common"] + sources["python"]
    cxx = ["-O3", "-std=c++20", "-fopenmp", "-Wall", "-Wno-unknown-pragmas"]
    extra: dict = {"cxx": cxx}
    include_dirs = [str(ROOT / "csrc")]
    define_macros = []
    if target == "cuda":
        import torch

        files += sources["cuda"]
        define_macros.append(("VLLM_LITE_WITH_CUDA", None))
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
            # No GPU to ask: build for Ampere and Hopper.
            os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0"
        # torch's CUDA headers include cusparse.h and friends, which the pip wheels of
        # the CUDA libraries ship beside torch rather than in the toolkit.
        site = Path(torch.__file__).resolve().parent.parent
        for inc in (site / "nvidia" / "cu13" / "include", site / "nvidia" / "cusparse" / "include"):
            if inc.is_dir():
                include_dirs.append(str(inc))
        threads = os.environ.get("NVCC_THREADS", "2")
        extra["nvcc"] = [
            "-O3", "-std=c++20", "--use_fast_math", "-lineinfo",
            "--expt-relaxed-constexpr", f"--threads={threads}",
            "-DVLLM_LITE_WITH_CUDA",
        ]
        ext_cls = cpp_extension.CUDAExtension
        log.info("building CPU and CUDA kernels (CUDA_HOME=%s, TORCH_CUDA_ARCH_LIST=%s)",
                 cuda_home, os.environ["TORCH_CUDA_ARCH_LIST"])
    else:
        ext_cls = cpp_extension.CppExtension
        log.info("building CPU kernels only")
    # Lets the tests know whether this build promised CUDA kernels.
    (ROOT / "vllm_lite" / "_build_info.py").write_text(
        '"""Written by setup.py at build time."""\n\n'
        f"WITH_CUDA = {target == 'cuda'}\n"
        f"CUDA_ARCH_LIST = {os.environ.get('TORCH_CUDA_ARCH_LIST') if target == 'cuda' else None!r}\n"
    )
    ext = ext_cls(
        name="vllm_lite._C",
        sources=files,
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=extra,
    )
    if sys.platform.startswith("linux"):
        # The C++ runtime must be the shared libstdc++ that torch loads. A compiler that
        # links it statically puts a second copy in _C whose functions read the first
        # copy's locale data: every number streamed into an error message crashed
        # (segfault) or was cut off. "-lstdc++" is not enough: a compiler whose own
        # library folder holds only libstdc++.a (the GPU machine's GCC 13, a wrapper
        # passing -B) resolves it to the archive. So the library torch loaded is named by
        # its path: a path to a shared object always links it dynamically.
        runtime = loaded_libstdcxx()
        if runtime is not None:
            ext.extra_link_args.append(runtime)
        else:
            ext.libraries.append("stdc++")
        log.info("C++ runtime: %s", runtime or "-lstdc++")
    cmdclass = {"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)}
    return [ext], cmdclass


ext_modules, cmdclass = extension_modules()

setup(
    packages=find_packages(include=["vllm_lite", "vllm_lite.*"]),
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
