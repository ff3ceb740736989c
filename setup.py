"""Builds vllm_lite and its native extension vllm_lite._C.

VLLM_LITE_TARGET picks the kernels: "auto" (default) builds the CUDA kernels when torch is
a CUDA build, nvcc is found and there is a GPU to build for (one is visible, or
TORCH_CUDA_ARCH_LIST names the architectures), else the CPU kernels alone; "cuda" demands
the CUDA kernels (for 8.0;9.0 when no GPU is visible and TORCH_CUDA_ARCH_LIST is unset);
"cpu" builds the CPU kernels alone. A CUDA build that fails fails the install; it never
falls back to CPU silently.

VLLM_LITE_HEAD_SIZES and VLLM_LITE_KV_CACHE_DTYPES limit the CUDA attention kernels
compiled (see csrc/cuda/generate_kernels.py). ccache or sccache, when on PATH, caches every
compile (torch's cpp_extension puts it in front of the compilers; TORCH_NO_COMPILER_WRAPPER=1
turns that off).
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
    if target != "auto":
        return target
    if not have_cuda:
        log.info("building CPU kernels only (%s)",
                 "torch is a CPU build" if torch.version.cuda is None else "nvcc was not found")
        return "cpu"
    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        log.info("no GPU visible and TORCH_CUDA_ARCH_LIST unset: building the CPU kernels "
                 "only (for the CUDA kernels set TORCH_CUDA_ARCH_LIST, e.g. 9.0, or "
                 "VLLM_LITE_TARGET=cuda)")
        return "cpu"
    return "cuda"


def generate_cuda_kernels() -> tuple[list[str], Path]:
    """Runs csrc/cuda/generate_kernels.py (as CMakeLists.txt does); returns the generated
    .cu files (relative to ROOT, like sources.txt's) and the folder of their headers."""
    outdir = ROOT / "build" / "generated" / "cuda"
    r = subprocess.run([sys.executable, str(ROOT / "csrc" / "cuda" / "generate_kernels.py"),
                        str(outdir)], capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(r.stderr.strip() or "csrc/cuda/generate_kernels.py failed")
    files = [os.path.relpath(line, ROOT) for line in r.stdout.split()]
    return files, outdir


def compiler_cache_note(cpp_extension) -> str:
    if os.environ.get("TORCH_NO_COMPILER_WRAPPER"):
        return "off (TORCH_NO_COMPILER_WRAPPER is set)"
    if not hasattr(cpp_extension, "_wrap_compiler"):
        return "none (this torch's cpp_extension does not use one)"
    for wrapper in ("ccache", "sccache"):  # the order cpp_extension tries them
        if shutil.which(wrapper):
            return f"{wrapper} (in front of the C++ compiler and nvcc)"
    return "none (install ccache to make rebuilds fast)"


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

        generated, generated_dir = generate_cuda_kernels()
        files += sources["cuda"] + generated
        include_dirs.append(str(generated_dir))
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
        log.info("building CPU and CUDA kernels (CUDA_HOME=%s, TORCH_CUDA_ARCH_LIST=%s, "
                 "%d generated kernel files)", cuda_home,
                 os.environ.get("TORCH_CUDA_ARCH_LIST", "the visible GPUs'"), len(generated))
    else:
        ext_cls = cpp_extension.CppExtension
    log.info("compiler cache: %s", compiler_cache_note(cpp_extension))
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
