"""Prefill-attention kernel benchmark (`benchmarks/kernels.py --prefill`): varlen_paged_attention
against the engine's previous prefill path and, on CUDA, FlashAttention's varlen kernel.

Workload per (dtype, heads, cached prefix): --prefill-seqs sequences (8) of
--prefill-new-tokens new tokens (512) after a cached prefix of P tokens (0 and 1024 by
default), the whole context in a paged pool of shuffled blocks (consecutive logical blocks
far apart), ~4x larger than the KV the step reads. Timed on the very same K/V values:

  varlen        torch.ops.vllm_lite.varlen_paged_attention, one call for all sequences
  sdpa/seq      the engine's path before the op: per sequence, index_select of the
                prefix's blocks out of the pool, a transposing copy, torch.cat with the new
                tokens' K/V, a bottom-right causal mask and one SDPA call
  sdpa flash    CUDA: torch SDPA with the flash backend forced, one call per sequence on
                contiguous [heads, tokens, head_size] K/V prepared outside timing (the
                peer of a kernel that reads the paged cache): is_causal without a prefix,
                torch.nn.attention.bias.causal_lower_right with one
  flash_attn    flash_attn_varlen_func with block_table over a pool of 256-token pages
                (CUDA, when the flash_attn package imports)

Each output is checked against the first sequence's float32 SDPA result before timing; a
kernel that disagrees is reported WRONG and not timed. Time: median per call (Timer of
kernels.py: cold last-level cache, CUDA events on a GPU). On CUDA, varlen runs the kernel
attention_path.h picks: the tensor-core kernel on sm_80 and newer for fp16 / bf16 with a
cache of the same dtype and head size 64 or 128, else the SIMT kernel. With
--goal-vs-sdpa RATIO the table ends with whether each row's varlen takes at most RATIO x
SDPA flash's time (reported, not asserted).
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

log = logging.getLogger("bench.prefill")

DEFAULT_PREFIXES = [0, 1024]
REL_TOL = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", action="store_true",
                   help="benchmark prefill attention (varlen_paged_attention) instead of decode")
    p.add_argument("--prefill-seqs", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--prefill-new-tokens", type=int, nargs="+", default=[512],
                   help="new tokens per sequence, one grid row each (default 512)")
    p.add_argument("--prefill-prefixes", type=int, nargs="+", default=DEFAULT_PREFIXES,
                   help=f"cached prefix lengths (default {DEFAULT_PREFIXES})")


def run(args: argparse.Namespace, timer_cls: Any) -> str:
    """Runs the grid; returns the markdown table."""
    import torch
    import torch.nn.functional as F

    from vllm_lite import ops

    dev = args.device
    rows = []
    stopped = ""
    try:
        for dtype_name in args.dtypes:
            dt = getattr(torch, dtype_name)
            for heads in args.head_cfgs:
                for new in args.prefill_new_tokens:
                    for prefix in args.prefill_prefixes:
                        rows.append(_run_shape(torch, F, ops, args, timer_cls, dev, dt, heads,
                                               prefix, new))
    except KeyboardInterrupt:  # a time limit's SIGINT: the rows measured so far are written
        stopped = "- interrupted (SIGINT): the grid's remaining rows were not run"
    head = ("| dtype | heads | seqs x new | prefix | varlen (ms) | varlen TFLOP/s | "
            "sdpa/seq + gather (ms) | varlen / sdpa | sdpa flash (ms) | varlen / sdpa flash | "
            "flash_attn varlen (ms) | flash TFLOP/s | varlen / flash |")
    lines = [_machine_line(torch, ops, dev),
             "- TFLOP/s: 4 * heads * head_size * (query, key) pairs the causal mask keeps, "
             "per second", *([stopped] if stopped else []), "", head, "|" + "---|" * 13]
    for r in rows:
        lines.append(
            f"| {r['dtype']} | {r['heads']} | {r['seqs']} x {r['new']} | {r['prefix']} | "
            f"{_ms(r, 'varlen')} | {_tflops(r, 'varlen')} | {_ms(r, 'sdpa')} | "
            f"{_ratio(r, 'varlen', 'sdpa')} | {_ms(r, 'sdpa_flash')} | "
            f"{_ratio(r, 'varlen', 'sdpa_flash')} | {_ms(r, 'flash')} | {_tflops(r, 'flash')} | "
            f"{_ratio(r, 'varlen', 'flash')} |")
    goal = getattr(args, "goal_vs_sdpa", None)
    if goal is not None:
        lines += ["", "### Goals (reported, not asserted)", "", *goals(rows, goal)]
    return "\n".join(lines)


def goals(rows: list[dict], ratio: float) -> list[str]:
    """Whether each row's varlen takes at most `ratio` x SDPA flash's time."""
    out = [f"varlen <= {ratio}x SDPA flash time:"]
    met, missed = 0, []
    for r in rows:
        name = f"{r['dtype']} {r['heads']} {r['seqs']} x {r['new']} prefix {r['prefix']}"
        t, ref = r["times"].get("varlen"), r["times"].get("sdpa_flash")
        if t is None or ref is None:
            missed.append(f"{name}: not timed ({r['status'].get('varlen') or 'no SDPA flash'})")
        elif t / ref > ratio:
            missed.append(f"{name}: {t / ref:.2f}x")
        else:
            met += 1
    return out + [f"- {met} of {len(rows)} rows met"] + [f"- missed: {m}" for m in missed]


def attention_flops(seqs: int, new: int, prefix: int, heads: int, head_size: int) -> int:
    """FLOPs of causal prefill attention: per kept (query, key) pair a q.k and a p.v dot
    product of head_size multiply-adds each (4 * head_size FLOPs), per query head; query i
    of a sequence (0-based among its new tokens) sees prefix + i + 1 keys."""
    pairs = new * prefix + new * (new + 1) // 2
    return 4 * heads * head_size * pairs * seqs


def _tflops(r: dict, k: str) -> str:
    v = r["times"].get(k)
    return "-" if v is None else f"{r['flops'] / v / 1e12:.3g}"


def _machine_line(torch: Any, ops: Any, dev: str) -> str:
    """What ran: the CPU or GPU, threads, and the CPU kernels' ISA build (the build decides
    the CPU kernel's speed, so a table without it cannot be compared)."""
    from .kernels import cpu_model

    if dev == "cuda":
        return f"- machine: {torch.cuda.get_device_name(0)}; torch {torch.__version__}"
    return (f"- machine: {cpu_model()}; torch {torch.__version__}; threads "
            f"{torch.get_num_threads()}; CPU ISA {ops.cpu_isa()}")


def _ms(r: dict, k: str) -> str:
    v = r["times"].get(k)
    return r["status"].get(k, "-") if v is None else f"{v * 1e3:.2f}"


def _ratio(r: dict, a: str, b: str) -> str:
    ta, tb = r["times"].get(a), r["times"].get(b)
    return "-" if ta is None or tb is None else f"{ta / tb:.2f}x"


def _run_shape(torch, F, ops, args, timer_cls, dev, dt, heads, prefix, N) -> dict:
    S, bs = args.prefill_seqs, args.block_size
    H, KVH, D = heads.q, heads.kv, heads.size
    L = prefix + N
    per_seq = math.ceil(L / bs)
    num_blocks = 4 * S * per_seq
    g = torch.Generator().manual_seed(args.seed)
    x = 16 // torch.empty((), dtype=dt).element_size()
    kc = torch.randn(num_blocks, KVH, D // x, bs, x, generator=g).to(dt).to(dev)
    vc = torch.randn(num_blocks, KVH, D, bs, generator=g).to(dt).to(dev)
    tables = torch.randperm(num_blocks, generator=g)[:S * per_seq].to(torch.int32)
    tables = tables.view(S, per_seq).to(dev)
    q = torch.randn(S * N, H, D, generator=g).to(dt).to(dev)
    seq_lens = torch.full((S,), L, dtype=torch.int32, device=dev)
    qsl = torch.arange(0, S * N + 1, N, dtype=torch.int32, device=dev)
    scale = D ** -0.5
    # The new tokens' K/V as the engine's step has them (also already in the cache).
    pos = torch.arange(prefix, L, device=dev)

    def kv_of(s: int, positions):
        blk = tables[s].long()[positions // bs]
        off = positions % bs
        k = kc[blk, :, :, off, :].reshape(len(positions), KVH, D)
        return k, vc[blk, :, :, off]

    new_kv = [kv_of(s, pos) for s in range(S)]
    gqa = {"enable_gqa": True} if H != KVH else {}

    def varlen():
        return ops.varlen_paged_attention(q, kc, vc, KVH, scale, tables, seq_lens, qsl, bs,
                                          N, L)

    def sdpa():
        out = torch.empty_like(q)
        for s in range(S):
            ki, vi = new_kv[s]
            mask = None
            if prefix:
                nb = math.ceil(prefix / bs)
                blocks = tables[s, :nb].long()
                pk = kc.index_select(0, blocks).permute(0, 3, 1, 2, 4).reshape(nb * bs, KVH, D)
                pv = vc.index_select(0, blocks).permute(0, 3, 1, 2).reshape(nb * bs, KVH, D)
                ki = torch.cat((pk[:prefix], ki))
                vi = torch.cat((pv[:prefix], vi))
                mask = (torch.arange(L, device=dev)[None, :]
                        <= torch.arange(N, device=dev)[:, None] + prefix)
            o = F.scaled_dot_product_attention(
                q[s * N:(s + 1) * N].transpose(0, 1).unsqueeze(0),
                ki.transpose(0, 1).unsqueeze(0), vi.transpose(0, 1).unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=scale, **gqa)
            out[s * N:(s + 1) * N] = o[0].transpose(0, 1)
        return out

    fns = {"varlen": varlen, "sdpa": sdpa}
    sdpa_flash = _sdpa_flash(torch, F, dev, q, kv_of, S, N, L, prefix, scale, gqa)
    if sdpa_flash is not None:
        fns["sdpa_flash"] = sdpa_flash
    flash = _flash_varlen(torch, dev, q, kv_of, S, N, L, KVH, D, scale)
    if flash is not None:
        fns["flash"] = flash
    # Reference: sequence 0 in float32.
    k0, v0 = kv_of(0, torch.arange(L, device=dev))
    mask = torch.arange(L, device=dev)[None, :] <= torch.arange(N, device=dev)[:, None] + prefix
    want = F.scaled_dot_product_attention(
        q[:N].float().transpose(0, 1).unsqueeze(0), k0.float().transpose(0, 1).unsqueeze(0),
        v0.float().transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
        **gqa)[0].transpose(0, 1)
    timer = timer_cls(torch, dev, 0, args)
    row = {"dtype": str(dt).removeprefix("torch."), "heads": heads.name, "seqs": S, "new": N,
           "prefix": prefix, "times": {}, "status": {},
           "flops": attention_flops(S, N, prefix, H, D)}
    for name, fn in fns.items():
        try:
            got = fn()[:N].float()
        except RuntimeError as e:
            row["status"][name] = "error"
            log.warning("%s failed: %s", name, e)
            continue
        err = ((got - want).abs().max() / want.abs().max()).item()
        if not err <= REL_TOL[row["dtype"]]:
            row["status"][name] = f"WRONG ({err:.1e})"
            continue
        row["times"][name], _ = timer.measure(fn, flush=False)
        log.info("%s %s prefix %d: %s %.2f ms", row["dtype"], heads.name, prefix, name,
                 row["times"][name] * 1e3)
    return row


def _sdpa_flash(torch, F, dev, q, kv_of, S, N, L, prefix, scale, gqa):
    """Per sequence, flash-backend SDPA on contiguous K/V made outside timing, or None
    (CPU, or a torch without the backend selector)."""
    if dev != "cuda":
        return None
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return None
    kv = []
    for s in range(S):
        k, v = kv_of(s, torch.arange(L, device=dev))
        kv.append((k.transpose(0, 1).unsqueeze(0).contiguous(),
                   v.transpose(0, 1).unsqueeze(0).contiguous()))
    qs = [q[s * N:(s + 1) * N].transpose(0, 1).unsqueeze(0).contiguous() for s in range(S)]
    bias = causal_lower_right(N, L) if prefix else None

    def run():
        out = torch.empty_like(q)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for s in range(S):
                k, v = kv[s]
                o = F.scaled_dot_product_attention(qs[s], k, v, attn_mask=bias,
                                                   is_causal=bias is None, scale=scale, **gqa)
                out[s * N:(s + 1) * N] = o[0].transpose(0, 1)
        return out

    return run


def _flash_varlen(torch, dev, q, kv_of, S, N, L, KVH, D, scale):
    """flash_attn_varlen_func over 256-token pages holding the same K/V, or None."""
    if dev != "cuda":
        return None
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return None
    page = 256
    pages = math.ceil(L / page)
    k_pages = torch.zeros(S * pages, page, KVH, D, dtype=q.dtype, device=dev)
    v_pages = torch.zeros_like(k_pages)
    perm = torch.randperm(S * pages, device=dev).view(S, pages)
    for s in range(S):
        k, v = kv_of(s, torch.arange(L, device=dev))
        pad = pages * page - L
        k = torch.cat((k, k.new_zeros(pad, KVH, D))).view(pages, page, KVH, D)
        v = torch.cat((v, v.new_zeros(pad, KVH, D))).view(pages, page, KVH, D)
        k_pages[perm[s].long()] = k
        v_pages[perm[s].long()] = v
    cu_q = torch.arange(0, S * N + 1, N, dtype=torch.int32, device=dev)
    cu_k = torch.arange(0, S * L + 1, L, dtype=torch.int32, device=dev)
    table = perm.to(torch.int32)

    def run():
        return flash_attn_varlen_func(q, k_pages, v_pages, cu_q, cu_k, N, L,
                                      softmax_scale=scale, causal=True, block_table=table)

    return run
