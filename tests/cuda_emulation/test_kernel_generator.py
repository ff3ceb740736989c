"""csrc/cuda/generate_kernels.py: every kernel instance compiled exactly once, the build
options (VLLM_LITE_HEAD_SIZES / VLLM_LITE_KV_CACHE_DTYPES) leave out what they should and
nothing else, and a call needing a left-out kernel fails with an error naming them (the
real dispatch headers compiled with g++ against the emulator's stand-in headers)."""

from __future__ import annotations

import importlib.util
import itertools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from . import harness

SCRIPT = harness.CSRC / "cuda" / "generate_kernels.py"
_spec = importlib.util.spec_from_file_location("generate_kernels", SCRIPT)
gk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gk)



@pytest.fixture(autouse=True, scope="session")
def emu_binary():
    """These tests need no emulator binary (overrides the package's autouse fixture)."""
    return None


QTYPES = ["float", "__half", "__nv_bfloat16"]
CTS = {"auto": None, "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}


def _instances(outdir: Path) -> list[tuple[str, ...]]:
    """Every explicit instantiation in the generated .cu files, as (struct, args...)."""
    found = []
    for f in sorted(outdir.glob("*.cu")):
        for m in re.finditer(r"^template struct (\w+)<([^>]*)>;$", f.read_text(), re.M):
            found.append((m.group(1), *[a.strip() for a in m.group(2).split(",")]))
    return found


def _expected(buckets, caches) -> list[tuple[str, ...]]:
    want = []
    for q, c in itertools.product(QTYPES, caches):
        ct = CTS[c] or q
        want += [("AttentionInstance", q, ct, str(bs), str(hb))
                 for bs in (8, 16, 32) for hb in buckets]
        want += [("VarlenInstance", q, ct, str(hb)) for hb in buckets]
        if q != "float":  # the tensor-core kernels: 16-bit queries, head sizes 64, 128
            want += [("AttentionTcInstance", q, ct, str(bs), str(hb))
                     for bs in (8, 16, 32) for hb in buckets if hb in (64, 128)]
            if c == "auto":  # the prefill kernel: caches in the query dtype
                want += [("VarlenTcInstance", q, q, str(hb))
                         for hb in buckets if hb in (64, 128)]
    return want


def _tc_table(outdir: Path, kernel: str = "paged_attention_tc") -> dict[str, list[str]]:
    """The instances a tensor-core kernel's table returns per cache section ("T": caches in
    the query dtype; each section also limited to fp16 / bf16 queries)."""
    text = (outdir / f"{kernel}_table.h").read_text()
    sections = re.split(r"if constexpr \(std::is_same_v<CT, (\w+)> && \((std::is_same_v<T, "
                        r"__half> \|\| std::is_same_v<T, __nv_bfloat16>)\)\)", text)[1:]
    return {cond: re.findall(r"return (\w+<[^>]*>)::get\(\)", body)
            for cond, _, body in zip(sections[::3], sections[1::3], sections[2::3])}


def _table_entries(outdir: Path, name: str) -> dict[str, list[str]]:
    """The cache sections of a generated table and the instances each returns."""
    text = (outdir / f"{name}_table.h").read_text()
    sections = re.split(r"if constexpr \(std::is_same_v<CT, (\w+)>\)", text)[1:]
    return {cond: re.findall(r"return (\w+<[^>]*>)::get\(\)", body)
            for cond, body in zip(sections[::2], sections[1::2])}


def test_default_builds_every_instance_exactly_once(tmp_path):
    units = gk.generate(tmp_path)
    # The SIMT decode kernel's (query dtype, cache element); per query dtype, every cache
    # in one unit, the varlen kernel's and the tensor-core decode kernel's (fp16 / bf16);
    # the tensor-core prefill kernel's (fp16 / bf16, caches in the query dtype)
    assert len(units) == 3 * 3 + 3 + 2 + 2
    got = _instances(tmp_path)
    assert len(got) == len(set(got)), "an instance is compiled twice"
    assert sorted(got) == sorted(_expected((64, 128, 256), CTS))
    paged = _table_entries(tmp_path, "paged_attention")
    assert set(paged) == {"T", "fp8_e4m3", "fp8_e5m2"}
    for entries in paged.values():
        assert sorted(entries) == sorted(f"AttentionInstance<T, CT, {bs}, {hb}>"
                                         for bs in (8, 16, 32) for hb in (64, 128, 256))
    varlen = _table_entries(tmp_path, "varlen_attention")
    assert {k: sorted(v) for k, v in varlen.items()} == {
        k: sorted(f"VarlenInstance<T, CT, {hb}>" for hb in (64, 128, 256)) for k in paged}
    assert {k: sorted(v) for k, v in _tc_table(tmp_path).items()} == {
        k: sorted(f"AttentionTcInstance<T, CT, {bs}, {hb}>" for bs in (8, 16, 32)
                  for hb in (64, 128)) for k in paged}
    assert {k: sorted(v) for k, v in _tc_table(tmp_path, "varlen_attention_tc").items()} == {
        "T": sorted(f"VarlenTcInstance<T, CT, {hb}>" for hb in (64, 128))}
    assert "VLLM_LITE_HEAD_SIZES unset (all) and VLLM_LITE_KV_CACHE_DTYPES unset (all)" in (
        tmp_path / "kernel_build_config.h").read_text()


def test_options_leave_out_exactly_the_unselected(tmp_path):
    # 80 falls in the <= 128 bucket; "fp8" is fp8_e4m3, as kv_cache_dtype reads it.
    gk.generate(tmp_path, "80", "fp8")
    assert sorted(p.name for p in tmp_path.glob("*.cu")) == sorted(
        [f"paged_attention_{q}_fp8_e4m3.cu" for q in ("f32", "f16", "bf16")]
        + [f"varlen_attention_{q}.cu" for q in ("f32", "f16", "bf16")]
        + [f"paged_attention_tc_{q}.cu" for q in ("f16", "bf16")])
    assert sorted(_instances(tmp_path)) == sorted(_expected((128,), ["fp8_e4m3"]))
    assert _table_entries(tmp_path, "paged_attention") == {
        "fp8_e4m3": [f"AttentionInstance<T, CT, {bs}, 128>" for bs in (8, 16, 32)]}
    assert _table_entries(tmp_path, "varlen_attention") == {
        "fp8_e4m3": ["VarlenInstance<T, CT, 128>"]}
    assert _tc_table(tmp_path) == {
        "fp8_e4m3": [f"AttentionTcInstance<T, CT, {bs}, 128>" for bs in (8, 16, 32)]}
    # fp8 caches: no tensor-core prefill kernel
    assert not any(_tc_table(tmp_path, "varlen_attention_tc").values())
    gk.generate(tmp_path / "b", "256", "auto")
    for kernel in ("paged_attention_tc", "varlen_attention_tc"):
        assert not any(_tc_table(tmp_path / "b", kernel).values())  # no kernel for 256
        assert not list((tmp_path / "b").glob(f"{kernel}_*.cu"))
    assert gk.parse_head_sizes("64 256;1") == (64, 256)
    assert gk.parse_cache_dtypes("ALL") == ("auto", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.parametrize("heads,caches,var", [
    ("0", None, "VLLM_LITE_HEAD_SIZES"), ("257", None, "VLLM_LITE_HEAD_SIZES"),
    ("128,x", None, "VLLM_LITE_HEAD_SIZES"), (None, "int8", "VLLM_LITE_KV_CACHE_DTYPES"),
])
def test_bad_option_names_the_variable(tmp_path, heads, caches, var):
    with pytest.raises(gk.SettingError, match=var):
        gk.generate(tmp_path, heads, caches)
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LITE_")}
    env.update({k: v for k, v in (("VLLM_LITE_HEAD_SIZES", heads),
                                  ("VLLM_LITE_KV_CACHE_DTYPES", caches)) if v is not None})
    r = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "cli")], env=env,
                       capture_output=True, text=True)
    assert r.returncode == 2 and var in r.stderr and not r.stdout


def test_cli_reads_the_environment_and_rewrites_only_changes(tmp_path):
    env = {**os.environ, "VLLM_LITE_HEAD_SIZES": "64", "VLLM_LITE_KV_CACHE_DTYPES": "auto"}

    def run() -> list[str]:
        return subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], env=env,
                              capture_output=True, text=True, check=True).stdout.split()

    first = run()
    assert sorted(Path(p).name for p in first) == sorted(
        [f"paged_attention_{q}_auto.cu" for q in ("f32", "f16", "bf16")]
        + [f"varlen_attention_{q}.cu" for q in ("f32", "f16", "bf16")]
        + [f"paged_attention_tc_{q}.cu" for q in ("f16", "bf16")]
        + [f"varlen_attention_tc_{q}_auto.cu" for q in ("f16", "bf16")])
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()}
    os.utime(tmp_path / "kernel_build_config.h", ns=(1, 1))  # would change if rewritten
    assert run() == first
    assert {p: p.stat().st_mtime_ns for p in tmp_path.iterdir()} == {
        **stamps, tmp_path / "kernel_build_config.h": 1}
    # Another configuration replaces the .cu files: no stale unit is left to compile.
    env["VLLM_LITE_KV_CACHE_DTYPES"] = "fp8_e5m2"
    second = run()
    assert sorted(p.name for p in tmp_path.glob("*.cu")) == sorted(Path(p).name for p in second)
    texts = [Path(p).read_text() for p in second]
    assert all("fp8_e5m2" in t and "fp8_e4m3" not in t for t in texts)


# Calls the real dispatch (attention_kernels.cuh / varlen_attention_kernels.cuh with the
# generated tables) for built and left-out cases; get() is a stand-in returning a marker,
# so no kernel is compiled.
DISPATCH_PROBE = r"""
#include <cstdio>
#include <stdexcept>
#include "cuda/attention/varlen_attention_kernels.cuh"

namespace vllm_lite::cuda {
namespace attn {
static void marker(AttentionParams) {}
template <typename T, typename CT, int BS, int HM>
AttentionKernel AttentionInstance<T, CT, BS, HM>::get() { return &marker; }
}  // namespace attn
namespace varlen {
static void marker(VarlenParams) {}
template <typename T, typename CT, int HM>
VarlenKernel VarlenInstance<T, CT, HM>::get() { return &marker; }
}  // namespace varlen
}  // namespace vllm_lite::cuda

using namespace vllm_lite::cuda;

template <typename F>
void probe(const char* name, F f) {
  try {
    std::printf("%s ok %d\n", name, f() != nullptr);
  } catch (const std::runtime_error& e) {
    std::printf("%s error %s\n", name, e.what());
  }
}

int main() {
  probe("paged_bf16_auto_64", [] { return attn::attention_kernel_for<__nv_bfloat16, __nv_bfloat16>(16, 64); });
  probe("paged_f32_auto_48", [] { return attn::attention_kernel_for<float, float>(8, 48); });
  probe("paged_f16_auto_128", [] { return attn::attention_kernel_for<__half, __half>(32, 128); });
  probe("paged_f16_e4m3_64", [] { return attn::attention_kernel_for<__half, fp8_e4m3>(16, 64); });
  probe("paged_f16_e5m2_64", [] { return attn::attention_kernel_for<__half, fp8_e5m2>(16, 64); });
  probe("varlen_f32_auto_64", [] { return varlen::varlen_kernel_for<float, float>(64); });
  probe("varlen_bf16_auto_256", [] { return varlen::varlen_kernel_for<__nv_bfloat16, __nv_bfloat16>(256); });
  probe("varlen_f32_e5m2_32", [] { return varlen::varlen_kernel_for<float, fp8_e5m2>(32); });
}
"""


def test_left_out_kernel_fails_naming_the_options(tmp_path):
    if shutil.which(harness.cxx()) is None:
        pytest.skip(f"no C++ compiler ({harness.cxx()})")
    gen = tmp_path / "gen"
    gk.generate(gen, "64", "auto,fp8_e4m3")
    (tmp_path / "probe.cpp").write_text(DISPATCH_PROBE)
    flags = [f for f in harness.CXXFLAGS if f.startswith("-I") and "generated" not in f]
    subprocess.run([harness.cxx(), "-std=c++20", "-O0", *flags, f"-I{gen}",
                    str(tmp_path / "probe.cpp"), "-o", str(tmp_path / "probe")], check=True)
    out = subprocess.run([str(tmp_path / "probe")], capture_output=True, text=True,
                         check=True).stdout
    res = dict(line.split(" ", 1) for line in out.splitlines())
    for ok in ("paged_bf16_auto_64", "paged_f32_auto_48", "paged_f16_e4m3_64",
               "varlen_f32_auto_64"):
        assert res[ok] == "ok 1", (ok, res[ok])
    settings = ("it was built with VLLM_LITE_HEAD_SIZES=64 and "
                "VLLM_LITE_KV_CACHE_DTYPES=auto,fp8_e4m3")
    for name, msg in [
        ("paged_f16_auto_128", "paged_attention: this build has no CUDA kernel for head_size "
                               "128 with kv_cache_dtype auto"),
        ("paged_f16_e5m2_64", "paged_attention: this build has no CUDA kernel for head_size "
                              "64 with kv_cache_dtype fp8_e5m2"),
        ("varlen_bf16_auto_256", "varlen_paged_attention: this build has no CUDA kernel for "
                                 "head_size 256 with kv_cache_dtype auto"),
        ("varlen_f32_e5m2_32", "varlen_paged_attention: this build has no CUDA kernel for "
                               "head_size 32 with kv_cache_dtype fp8_e5m2"),
    ]:
        assert res[name].startswith(f"error {msg}: {settings}"), (name, res[name])


def test_instance_list_builds_exactly_the_listed(tmp_path):
    listed = tmp_path / "kernels.txt"
    listed.write_text("# the emulator's default set, say\n"
                      "paged_attention bf16 fp8_e4m3 16 64\n"
                      "paged_attention f32 auto 8 256  # a comment\n"
                      "paged_attention_tc f16 auto 32 128\n"
                      "\n"
                      "varlen_attention f16 fp8_e5m2 - 128\n")
    units = gk.generate(tmp_path / "g", instances=listed)
    out = tmp_path / "g"
    assert sorted(p.name for p in units) == sorted([
        "paged_attention_bf16_fp8_e4m3.cu", "paged_attention_f32_auto.cu",
        "paged_attention_tc_f16.cu", "varlen_attention_f16.cu"])
    assert sorted(_instances(out)) == sorted([
        ("AttentionInstance", "__nv_bfloat16", "fp8_e4m3", "16", "64"),
        ("AttentionInstance", "float", "float", "8", "256"),
        ("AttentionTcInstance", "__half", "__half", "32", "128"),
        ("VarlenInstance", "__half", "fp8_e5m2", "128")])
    # One table section per (cache, query dtype) that has an entry, returning only those.
    paged = (out / "paged_attention_table.h").read_text()
    assert re.findall(r"return (\w+<[^>]*>)::get\(\)", paged) == [
        "AttentionInstance<T, CT, 8, 256>", "AttentionInstance<T, CT, 16, 64>"]
    assert "std::is_same_v<CT, T> && (std::is_same_v<T, float>)" in paged
    assert "std::is_same_v<CT, fp8_e4m3> && (std::is_same_v<T, __nv_bfloat16>)" in paged
    tc = (out / "paged_attention_tc_table.h").read_text()
    assert re.findall(r"return (\w+<[^>]*>)::get\(\)", tc) == [
        "AttentionTcInstance<T, CT, 32, 128>"]
    assert "std::is_same_v<CT, T> && (std::is_same_v<T, __half>)" in tc
    assert "::get()" not in (out / "varlen_attention_tc_table.h").read_text()
    assert f"the kernel list {listed.as_posix()}" in (out / "kernel_build_config.h").read_text()
    # The build options still apply on top of the list.
    assert [p.name for p in gk.generate(tmp_path / "h", "64", None, listed)] == [
        "paged_attention_bf16_fp8_e4m3.cu"]


@pytest.mark.parametrize("line,what", [
    ("paged_attention bf16 fp8_e4m3 16", "want <kernel>"),
    ("paged_attention bf16 int8 16 64", "cache one of"),
    ("paged_attention bf16 auto 12 64", "block size 8/16/32"),
    ("varlen_attention bf16 auto 16 64", "block size -"),
    ("paged_attention_tc f16 auto 16 256", "head bucket 64/128"),
    ("paged_attention_tc f32 auto 16 64", "no instance for f32 / auto"),
    ("varlen_attention_tc f16 fp8_e4m3 - 64", "no instance for f16 / fp8_e4m3"),
])
def test_bad_instance_line_names_the_file_and_line(tmp_path, line, what):
    listed = tmp_path / "kernels.txt"
    listed.write_text("paged_attention f16 auto 8 64\n" + line + "\n")
    with pytest.raises(gk.SettingError, match=rf"kernels\.txt:2: .*{re.escape(what)}"):
        gk.generate(tmp_path / "g", instances=listed)
    assert not (tmp_path / "g").exists()


def test_default_kernel_list_is_sorted_and_parses():
    """The emulator's default list: valid for the generator, no line twice."""
    lines = [ln for ln in harness.DEFAULT_KERNELS.read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines == sorted(set(lines))
    assert len(gk.read_instances(harness.DEFAULT_KERNELS)) == len(lines)


def test_kernel_list_from_logged_symbols():
    """CUDA_EMU_KERNEL_LOG's symbols as the generator's instance lines (other kernels left
    out, each instance once)."""
    if shutil.which("c++filt") is None:
        pytest.skip("no c++filt")
    symbols = [
        "_ZN9vllm_lite4cuda4attn22paged_attention_kernelI6__halfNS0_5fp8_tINS_3fp84E5M2EEELi16E"
        "Li128EEEvNS1_15AttentionParamsE",
        "_ZN9vllm_lite4cuda4attn25paged_attention_tc_kernelI6__halfS3_Li16ELi128EEEvNS1_15"
        "AttentionParamsE",
        "_ZN9vllm_lite4cuda6varlen29varlen_paged_attention_kernelIffLi128EEEvNS1_12VarlenParamsE",
        "_ZN9vllm_lite4cuda6varlen29varlen_paged_attention_kernelIffLi128EEEvNS1_12VarlenParamsE",
        "_ZN9vllm_lite4cuda4attn32paged_attention_v2_reduce_kernelI13__nv_bfloat16EEvNS1_12"
        "ReduceParamsE",
    ]
    assert harness.kernel_list(symbols) == [
        "paged_attention f16 fp8_e5m2 16 128",
        "paged_attention_tc f16 auto 16 128",
        "varlen_attention f32 auto - 128",
    ]


def test_emulator_kernel_set_follows_the_selection(monkeypatch):
    """Every instance when the run selected a full_grid test (or CUDA_EMU_KERNELS=all),
    else the default list; each set in its own generated folder."""
    from types import SimpleNamespace

    def session(*full: bool):
        items = [SimpleNamespace(get_closest_marker=lambda name, f=f: object() if f and
                                 name == "full_grid" else None) for f in full]
        return SimpleNamespace(items=items)

    monkeypatch.setattr(harness, "_EVERY_KERNEL", False)  # restored after the test
    monkeypatch.delenv("CUDA_EMU_KERNELS", raising=False)
    harness.use_every_kernel(session(False, False))
    assert not harness.every_kernel() and harness.generated_dir().name == "default"
    assert f"-I{harness.GENERATED / 'default'}" in harness.cxxflags()
    harness.use_every_kernel(session(False, True))
    assert harness.every_kernel() and harness.generated_dir().name == "all"
    monkeypatch.setenv("CUDA_EMU_KERNELS", "default")
    assert not harness.every_kernel()
    harness.use_every_kernel(session(False))
    monkeypatch.setenv("CUDA_EMU_KERNELS", "all")
    assert harness.every_kernel()
    monkeypatch.setenv("CUDA_EMU_KERNELS", "some")
    with pytest.raises(ValueError, match="CUDA_EMU_KERNELS"):
        harness.every_kernel()
