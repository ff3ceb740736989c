"""The "emulated" backend of the compat tests: the torch.ops.vllm_lite calls that
vllm_lite.compat.vllm makes (through vllm_lite.ops) are captured and run by the CUDA
kernels of csrc/cuda on the SIMT emulator (tests/cuda_emulation), which writes its results
back into the call's CPU tensors as the op would. So a compat test runs unchanged on CPU
tensors and checks what vLLM's argument mapping + the CUDA kernels compute.

The emulator replays the CUDA launchers' host code but not their argument checks; the
checks here only make sure that the captured call is one the CUDA op would take (the
op's schema, dtypes, contiguous caches), so that emulated data mean the real op's.
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pytest
import torch

import vllm_lite.ops
from cuda_emulation import harness  # tests/ is on sys.path (rootdir-based packages)

CODE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
KV = {"auto": "auto", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2"}
# The multiprocessor count the attention launcher plans for (an H100's).
SMS = 132


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"the captured call is not one the CUDA op takes: {what}")


def _check_schema(name: str, args: tuple) -> None:
    schema = getattr(torch.ops.vllm_lite, name).default._schema
    _check(len(args) == len(schema.arguments),
           f"{name} got {len(args)} arguments, its schema has {len(schema.arguments)}")


def _cache_kind(kv_cache_dtype: str, dtype: torch.dtype, cache: torch.Tensor) -> str:
    _check(kv_cache_dtype in KV, f"kv_cache_dtype {kv_cache_dtype!r}")
    kv = KV[kv_cache_dtype]
    want = dtype if kv == "auto" else torch.uint8
    _check(cache.dtype == want, f"a {kv_cache_dtype} cache of {dtype} holds {want}, "
                                f"got {cache.dtype}")
    return kv


def _attention(cd: harness.CaseDir, version: int, args: tuple) -> dict[str, torch.Tensor]:
    if version == 1:
        (out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
         block_size, max_seq_len, alibi, kv_cache_dtype, k_scale, v_scale) = args
        outs = {"out_v1": out}
    else:
        (out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
         block_tables, seq_lens, block_size, max_seq_len, alibi, kv_cache_dtype, k_scale,
         v_scale) = args
        outs = {"out_v2": out, "exp_sums": exp_sums, "max_logits": max_logits,
                "tmp_out": tmp_out}
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache),
                    ("block_tables", block_tables), ("seq_lens", seq_lens), *outs.items()):
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(block_tables.dtype == torch.int32 and seq_lens.dtype == torch.int32,
           "block_tables and seq_lens are int32")
    _check(alibi is None or alibi.dtype == torch.float32, "alibi_slopes are float32")
    kv = _cache_kind(kv_cache_dtype, query.dtype, key_cache)
    storage, q_off = harness.storage_of(query)
    num_seqs, num_heads, head_size = query.shape
    cd.set(op="attention", dtype=CODE[query.dtype], kv=kv, versions=version,
           num_seqs=num_seqs, num_heads=num_heads, num_kv_heads=int(num_kv_heads),
           head_size=head_size, block_size=int(block_size), num_blocks=key_cache.shape[0],
           max_blocks_per_seq=block_tables.shape[1], q_stride_seq=query.stride(0),
           q_stride_head=query.stride(1), q_offset=q_off, max_seq_len=int(max_seq_len),
           sms=SMS, scale=float(scale), k_scale=float(k_scale), v_scale=float(v_scale),
           flash=int(key_cache.dim() == 4))
    if version == 2:
        cd.set(num_partitions=exp_sums.shape[2])
    cd.buf("query_storage", storage)
    cd.buf("key_cache", key_cache)
    cd.buf("value_cache", value_cache)
    cd.buf("block_tables", block_tables)
    cd.buf("seq_lens", seq_lens)
    if alibi is not None:
        cd.buf("alibi_slopes", alibi)
    return outs


def _reshape_and_cache(cd: harness.CaseDir, flash: bool, args: tuple) -> dict[str, torch.Tensor]:
    key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale = args
    _check(key_cache.is_contiguous() and value_cache.is_contiguous(), "caches contiguous")
    _check(slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous(),
           "slot_mapping int64, contiguous")
    _check(key.stride(-1) == 1 and key.stride(-2) == key.shape[-1] and
           value.stride(-1) == 1 and value.stride(-2) == value.shape[-1],
           "key / value rows [num_kv_heads, head_size] contiguous")
    kv = _cache_kind(kv_cache_dtype, key.dtype, key_cache)
    ks, k_off = harness.storage_of(key)
    vs, v_off = harness.storage_of(value)
    num_tokens, num_kv_heads, head_size = key.shape
    block_size = key_cache.shape[1] if flash else key_cache.shape[3]
    cd.set(op="reshape_and_cache", dtype=CODE[key.dtype], kv=kv, flash=int(flash),
           num_tokens=num_tokens, num_kv_heads=num_kv_heads, head_size=head_size,
           block_size=block_size, num_blocks=key_cache.shape[0], key_stride=key.stride(0),
           value_stride=value.stride(0), k_scale=float(k_scale), v_scale=float(v_scale),
           key_offset=k_off, value_offset=v_off)
    cd.buf("key_storage", ks)
    cd.buf("value_storage", vs)
    cd.buf("slot_mapping", slot_mapping)
    return {"key_cache": key_cache, "value_cache": value_cache}


def _copy_blocks(cd: harness.CaseDir, args: tuple) -> dict[str, torch.Tensor]:
    key_caches, value_caches, mapping = args
    _check(mapping.dtype == torch.int64 and mapping.is_contiguous(), "block_mapping int64")
    num_blocks = key_caches[0].shape[0] if key_caches else 0
    outs = {}
    for i, (k, v) in enumerate(zip(key_caches, value_caches, strict=True)):
        _check(k.is_contiguous() and v.is_contiguous(), "caches contiguous")
        _check(k.shape[0] == num_blocks == v.shape[0], "every cache has num_blocks blocks")
        outs[f"key_cache{i}"], outs[f"value_cache{i}"] = k, v
    cd.set(op="copy_blocks", layers=len(key_caches), num_blocks=num_blocks,
           pairs=mapping.shape[0])
    cd.buf("mapping", mapping)
    return outs


def _swap_blocks(cd: harness.CaseDir, args: tuple) -> dict[str, torch.Tensor]:
    src, dst, mapping = args
    _check(src.is_contiguous() and dst.is_contiguous(), "src / dst contiguous")
    _check(src.dtype == dst.dtype and src.shape[1:] == dst.shape[1:], "src / dst blocks alike")
    _check(mapping.dtype == torch.int64 and mapping.device.type == "cpu",
           "block_mapping int64 on the CPU")
    cd.set(op="swap_blocks", pairs=mapping.shape[0],
           block_bytes=src[0].numel() * src.element_size())
    cd.buf("src", src)
    cd.buf("mapping", mapping.contiguous())
    return {"dst": dst}


_PREPARE = {
    "paged_attention_v1": lambda cd, a: _attention(cd, 1, a),
    "paged_attention_v2": lambda cd, a: _attention(cd, 2, a),
    "reshape_and_cache": lambda cd, a: _reshape_and_cache(cd, False, a),
    "reshape_and_cache_flash": lambda cd, a: _reshape_and_cache(cd, True, a),
    "copy_blocks": _copy_blocks,
    "swap_blocks": _swap_blocks,
}

#: The ops of vllm_lite.compat.vllm that run on the emulator (convert_fp8 is torch code).
OPS = tuple(_PREPARE)


def run(name: str, args: tuple) -> None:
    """Runs op `name` with `args` (CPU tensors, as the op would get them) on the emulator
    and writes its outputs into the argument tensors."""
    if name not in _PREPARE:
        raise NotImplementedError(f"torch.ops.vllm_lite.{name} has no emulated CUDA replay")
    _check_schema(name, args)
    for a in args:
        for t in a if isinstance(a, list) else [a]:
            _check(not isinstance(t, torch.Tensor) or t.device.type == "cpu",
                   "emulated calls take CPU tensors")
    seed = harness.seeds()[0]
    with tempfile.TemporaryDirectory(prefix="compat_emu_") as d:
        cd = harness.CaseDir(Path(d))
        outs = _PREPARE[name](cd, args)
        for buf, t in outs.items():
            cd.buf(buf, t, out=True)
        cd.write()
        res = harness.run_cases([cd.path], [seed])[cd.path]
        assert res.ok, f"emulated {name}: {res.message}"
        for buf, t in outs.items():
            t.copy_(cd.read(buf, seed, t))


class _EmulatedOps:
    """Stands in for torch.ops.vllm_lite: each op runs on the emulator."""

    def __getattr__(self, name: str):
        return lambda *args: run(name, args)


@contextlib.contextmanager
def emulated_ops():
    """Within: vllm_lite.ops (so vllm_lite.compat.vllm) runs its ops on the emulated CUDA
    kernels. Skips the test where this machine cannot build the emulator."""
    try:
        harness.binary()
    except harness.Unavailable as e:
        pytest.skip(f"CUDA emulation unavailable: {e}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_lite.ops, "_ops", _EmulatedOps())
        yield
