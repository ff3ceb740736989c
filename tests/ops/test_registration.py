"""The ops exist in torch.ops.vllm_lite with the expected schemas, every op has a CPU
kernel, every op has a CUDA kernel when the build had CUDA (vllm_lite._build_info), and the
fake implementations pass torch.library.opcheck."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

import vllm_lite
from vllm_lite import ops

OPS = ("paged_attention_v1", "paged_attention_v2", "reshape_and_cache",
       "reshape_and_cache_flash", "copy_blocks", "swap_blocks")

# Arguments each op writes (Tensor! / Tensor(a!)[] in the schema); all others are read-only.
MUTATED = {
    "paged_attention_v1": {"out"},
    "paged_attention_v2": {"out", "exp_sums", "max_logits", "tmp_out"},
    "reshape_and_cache": {"key_cache", "value_cache"},
    "reshape_and_cache_flash": {"key_cache", "value_cache"},
    "copy_blocks": {"key_caches", "value_caches"},
    "swap_blocks": {"dst"},
}


def has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_lite::{op}", key)


@pytest.mark.parametrize("op", OPS)
def test_cpu_kernel_registered(op):
    assert has_kernel(op, "CPU"), f"vllm_lite::{op} has no CPU kernel"


def test_build_info_cuda_kernels():
    from vllm_lite import _build_info

    missing = [op for op in OPS if not has_kernel(op, "CUDA")]
    if _build_info.WITH_CUDA:
        assert not missing, f"built with CUDA, but no CUDA kernel for {missing}"
    else:
        # The marker must not lie the other way either.
        assert missing == list(OPS), "WITH_CUDA is False but CUDA kernels are registered"


@pytest.mark.parametrize("op", OPS)
def test_schema_mutability(op):
    schema = getattr(torch.ops.vllm_lite, op).default._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and
               a.alias_info.is_write}
    assert written == MUTATED[op], str(schema)
    assert len(schema.returns) == 0, str(schema)


def test_wrapper_constants():
    assert ops.PARTITION_SIZE == 512
    assert [ops.kv_cache_x(t) for t in (torch.float32, torch.float16, torch.bfloat16)] == \
        [4, 8, 8]
    assert ops.kv_cache_shapes(10, 2, 128, 16, torch.float16) == (
        (10, 2, 16, 16, 8), (10, 2, 128, 16))
    assert vllm_lite._C is not None


def _small_args(op: str, device: str):
    g = torch.Generator().manual_seed(0)
    d, h, kvh, bs, nb = 64, 4, 2, 16, 6
    kc = torch.randn(nb, kvh, d // 4, bs, 4, generator=g).to(device)
    vc = torch.randn(nb, kvh, d, bs, generator=g).to(device)
    q = torch.randn(2, h, d, generator=g).to(device)
    tables = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([40, 7], dtype=torch.int32, device=device)
    key = torch.randn(3, kvh, d, generator=g).to(device)
    slots = torch.tensor([5, -1, 70], device=device)
    common = (q, kc, vc, kvh, 0.125, tables, lens, bs, 40, None, "auto", 1.0, 1.0)
    if op == "paged_attention_v1":
        return (torch.empty_like(q),) + common
    if op == "paged_attention_v2":
        return (torch.empty_like(q), torch.empty(2, h, 1, device=device),
                torch.empty(2, h, 1, device=device), torch.empty(2, h, 1, d, device=device)
                ) + common
    if op == "reshape_and_cache":
        return (key, key.clone(), kc, vc, slots, "auto", 1.0, 1.0)
    if op == "reshape_and_cache_flash":
        fk = torch.zeros(nb, bs, kvh, d, device=device)
        return (key, key.clone(), fk, fk.clone(), slots, "auto", 1.0, 1.0)
    if op == "copy_blocks":
        return ([kc], [vc], torch.tensor([[0, 1], [0, 5]], device=device))
    if op == "swap_blocks":
        return (kc, torch.zeros_like(kc), torch.tensor([[0, 2]]))
    raise AssertionError(op)


@pytest.mark.parametrize("op", OPS)
def test_opcheck(device, op):
    """Schema annotations match what the kernel mutates; the fake impl traces."""
    torch.library.opcheck(getattr(torch.ops.vllm_lite, op).default, _small_args(op, device),
                          test_utils=("test_schema", "test_faketensor",
                                      "test_aot_dispatch_static"))


def test_cpu_isa_selection():
    """cpu_isas() lists what this CPU runs (widest first, always "generic"); set_cpu_isa
    switches and rejects names it cannot run."""
    isas = ops.cpu_isas()
    assert isas and isas[-1] == "generic" and set(isas) <= {"amxbf16", "avx512bf16", "avx512", "avx2", "generic"}
    before = ops.cpu_isa()
    assert before in isas
    try:
        for isa in isas:
            ops.set_cpu_isa(isa)
            assert ops.cpu_isa() == isa
        with pytest.raises(ValueError):
            ops.set_cpu_isa("sse9")
        assert ops.cpu_isa() == isas[-1]
    finally:
        ops.set_cpu_isa(before)


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("ldd") is None,
                    reason="the shared libstdc++ check reads ELF dependencies with ldd (Linux)")
def test_extension_shares_torchs_cpp_runtime():
    # A compiler that links libstdc++ statically (the GPU machine's CXX wrapper) put a
    # second copy in _C whose code read the first copy's locale data: every number
    # streamed into an error message segfaulted (the symptom test_bad_inputs.py's
    # "got 12" messages catch). setup.py names the shared one.
    import vllm_lite._C as ext

    deps = subprocess.run(["ldd", ext.__file__], capture_output=True, text=True,
                          check=True).stdout
    assert "libstdc++.so" in deps, f"{ext.__file__} does not load the shared libstdc++:\n{deps}"
