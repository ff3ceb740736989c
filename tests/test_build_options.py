"""CMake's VLLM_LITE_PRECOMPILED_HEADERS: the precompiled torch header reaches exactly the
kernel files that include torch (found here by following their own #include lines), AUTO
turns it off when a compiler cache is in use, and a bad value stops the configure naming
the variable. Configure only (CPU kernels, no build): well under a second each."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
_INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.M)

pytestmark = pytest.mark.skipif(shutil.which("cmake") is None, reason="needs cmake")


def _includes_torch(source: Path) -> bool:
    """Whether ``source`` reaches a torch header (<ATen/...>, <torch/...>, <c10/...>)
    through its own and csrc's quoted includes."""
    seen: set[Path] = set()
    todo = [source]
    while todo:
        f = todo.pop()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        for kind, name in _INCLUDE.findall(f.read_text()):
            if kind == "<":
                if name.split("/")[0] in ("ATen", "torch", "c10"):
                    return True
            else:
                todo += [f.parent / name, CSRC / name]
    return False


def _configure(folder: Path, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["cmake", "-S", str(ROOT), "-B", str(folder), "-DVLLM_LITE_CUDA=OFF",
         "-DVLLM_LITE_BUILD_TESTS=OFF", "-DCMAKE_EXPORT_COMPILE_COMMANDS=ON",
         f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", *options],
        capture_output=True, text=True, timeout=300)


def _with_pch(folder: Path) -> dict[str, bool]:
    """Each kernel source -> whether its compile command includes the precompiled header."""
    commands = json.loads((folder / "compile_commands.json").read_text())
    return {Path(c["file"]).name: "cmake_pch" in c["command"] for c in commands
            if Path(c["file"]).suffix == ".cpp" and Path(c["file"]).is_relative_to(CSRC)}


def test_precompiled_header_reaches_the_files_that_include_torch(tmp_path: Path) -> None:
    r = _configure(tmp_path / "on", "-DVLLM_LITE_COMPILER_CACHE=OFF",
                   "-DVLLM_LITE_PRECOMPILED_HEADERS=AUTO")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "precompiled torch headers ON" in r.stdout
    got = _with_pch(tmp_path / "on")
    sources = [line.split()[1] for line in (CSRC / "sources.txt").read_text().splitlines()
               if line.startswith("common ")]
    assert sorted(got) == sorted(Path(s).name for s in sources)
    want = {Path(s).name: _includes_torch(ROOT / s) for s in sources}
    assert got == want
    assert any(want.values()) and not all(want.values())


def test_extension_and_cpp_tests_reuse_the_kernels_header(tmp_path: Path) -> None:
    # The header is compiled once, for the kernels; the extension module and the C++ tests
    # include that one (GCC stops their build if their flags no longer match it).
    r = _configure(tmp_path, "-DVLLM_LITE_COMPILER_CACHE=OFF", "-DVLLM_LITE_BUILD_TESTS=ON",
                   "-DVLLM_LITE_PYTHON_MODULE=ON")
    assert r.returncode == 0, r.stderr[-3000:]
    commands = json.loads((tmp_path / "compile_commands.json").read_text())
    header = str(tmp_path / "CMakeFiles" / "vllm_lite_objects.dir" / "cmake_pch.hxx")
    reusing = [c for c in commands if Path(c["file"]).name == "python_module.cpp"
               or (Path(c["file"]).suffix == ".cpp" and "tests/cpp" in c["file"])]
    assert len(reusing) >= 3, [c["file"] for c in commands]
    for c in reusing:
        assert header in c["command"] and "-Werror=invalid-pch" in c["command"], c


@pytest.mark.parametrize("options", [
    ("-DVLLM_LITE_PRECOMPILED_HEADERS=off", "-DVLLM_LITE_COMPILER_CACHE=OFF"),
    # AUTO with a compiler cache in front of the compiler (configure never runs it).
    ("-DVLLM_LITE_PRECOMPILED_HEADERS=AUTO", "-DVLLM_LITE_COMPILER_CACHE=/bin/true")],
    ids=["off", "auto-with-compiler-cache"])
def test_precompiled_header_off(tmp_path: Path, options: tuple[str, ...]) -> None:
    r = _configure(tmp_path, *options)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "precompiled torch headers OFF" in r.stdout
    got = _with_pch(tmp_path)
    assert got and not any(got.values())


def test_bad_value_is_refused(tmp_path: Path) -> None:
    r = _configure(tmp_path, "-DVLLM_LITE_PRECOMPILED_HEADERS=sometimes")
    assert r.returncode != 0
    assert "VLLM_LITE_PRECOMPILED_HEADERS must be AUTO, ON or OFF, got 'sometimes'" in \
        " ".join(r.stderr.split())
