"""Typed wrappers over the native ops in ``torch.ops.vllm_lite``.

Each wrapper calls its op directly (PyTorch dispatches to the CPU or CUDA kernel by the
tensors' device). Every op has a fake implementation registered here, so the wrappers
trace under ``torch.compile(fullgraph=True)``. Layouts follow vLLM v0.6; see README.md.
"""

from __future__ import annotations

import torch

import vllm_lite

if vllm_lite._C is None:
    raise ImportError(
        "vllm_lite's native extension (vllm_lite._C) is not built or failed to load: "
        f"{vllm_lite._C_IMPORT_ERROR}. Install the package with `pip install .` "
        "(or `pip install --no-build-isolation .` with torch already installed)."
    )

_ops = torch.ops.vllm_lite

#: Tokens per partition of paged_attention_v2 (kPartitionSize in csrc/ops.h).
PARTITION_SIZE = 512


_FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                     "fp8_e5m2": torch.float8_e5m2}


def kv_cache_storage_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the cache tensors: the model ``dtype`` for kv_cache_dtype "auto",
    uint8 for the fp8 ones (as vLLM)."""
    if kv_cache_dtype == "auto":
        return dtype
    if kv_cache_dtype in _FP8_CACHE_DTYPES:
        return torch.uint8
    raise ValueError(f"kv_cache_dtype must be 'auto' or one of {', '.join(_FP8_CACHE_DTYPES)}, "
                     f"got {kv_cache_dtype!r}")


def fp8_cache_dtype(kv_cache_dtype: str) -> torch.dtype:
    """The torch float8 dtype whose bits an fp8 cache (uint8) holds: view the cache as it
    and multiply by the scale to read it."""
    if kv_cache_dtype not in _FP8_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not an fp8 one "
                         f"({', '.join(_FP8_CACHE_DTYPES)})")
    return _FP8_CACHE_DTYPES[kv_cache_dtype]


def kv_cache_x(dtype: torch.dtype) -> int:
    """Elements per 16-byte chunk of the key cache's last dimension."""
    return 16 // torch.tensor([], dtype=dtype).element_size()


def kv_cache_shapes(
    num_blocks: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
    layout: str = "split",
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of the paged key and value caches for one layer; ``dtype`` is the cache
    tensors' (``kv_cache_storage_dtype``: uint8 for fp8, so x = 16). ``layout`` "split"
    (vLLM's paged layout) or "flash" ([num_blocks, block_size, num_kv_heads, head_size] for
    both): the attention kernels tell them apart by the key cache's rank."""
    if layout == "flash":
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        return shape, shape
    if layout != "split":
        raise ValueError(f"kv cache layout must be 'split' or 'flash', got {layout!r}")
    x = kv_cache_x(dtype)
    return (
        (num_blocks, num_kv_heads, head_size // x, block_size, x),
        (num_blocks, num_kv_heads, head_size, block_size),
    )


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention of one query token per sequence over its paged KV cache, in one pass.

    Writes ``out`` [num_seqs, num_heads, head_size]. ``block_tables`` int32
    [num_seqs, max_blocks_per_seq], ``seq_lens`` int32 [num_seqs] (each <= max_seq_len).
    """
    _ops.paged_attention_v1(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
    )


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Paged attention split into 512-token partitions, then reduced.

    ``exp_sums``/``max_logits`` float32 [num_seqs, num_heads, max_num_partitions] and
    ``tmp_out`` [num_seqs, num_heads, max_num_partitions, head_size] (query dtype) receive
    each partition's softmax sum, maximum logit and normalized output.
    """
    _ops.paged_attention_v2(
        out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
        scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
        kv_cache_dtype, k_scale, v_scale,
    )


def use_v2(max_seq_len: int, num_seqs: int, num_heads: int) -> bool:
    """v2 when there is too little parallelism per partition or the sequences are long."""
    num_partitions = (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE
    return max_seq_len > 8192 or (num_partitions > 1 and num_seqs * num_heads <= 512)


def v2_scratch(out: torch.Tensor, max_seq_len: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(exp_sums, max_logits, tmp_out) for paged_attention_v2 into ``out`` [num_seqs,
    num_heads, head_size] when :func:`use_v2` picks it, else None (v1)."""
    num_seqs, num_heads, head_size = out.shape
    if not use_v2(max_seq_len, num_seqs, num_heads):
        return None
    partitions = max(1, (max_seq_len + PARTITION_SIZE - 1) // PARTITION_SIZE)
    exp_sums = torch.empty((num_seqs, num_heads, partitions), dtype=torch.float32,
                           device=out.device)
    tmp_out = out.new_empty((num_seqs, num_heads, partitions, head_size))
    return exp_sums, torch.empty_like(exp_sums), tmp_out


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Paged decode attention; picks v1 or v2 and allocates v2's scratch. Returns ``out``."""
    num_seqs, num_heads, head_size = query.shape
    if out is None:
        out = torch.empty((num_seqs, num_heads, head_size), dtype=query.dtype, device=query.device)
    scratch = v2_scratch(out, max_seq_len)
    if scratch is not None:
        exp_sums, max_logits, tmp_out = scratch
        paged_attention_v2(
            out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
            scale, block_tables, seq_lens, block_size, max_seq_len, alibi_slopes,
            kv_cache_dtype, k_scale, v_scale,
        )
    else:
        paged_attention_v1(
            out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
            block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
        )
    return out


def varlen_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill attention over the paged cache; returns ``out`` [num_tokens, num_heads,
    head_size] (allocated when None).

    ``query`` [num_tokens, num_heads, head_size] holds every sequence's new tokens, flat:
    sequence i's are rows ``query_start_loc[i]:query_start_loc[i + 1]`` (int32
    [num_seqs + 1]); they are the last of its ``seq_lens[i]`` context tokens, whose K/V
    (the new ones too: call reshape_and_cache first) are in the paged caches. Query j of n
    attends to context positions 0 .. seq_lens[i] - n + j (bottom-right causal), so a
    sequence with one query token gets what paged_attention gives it. ``max_query_len`` /
    ``max_seq_len`` bound the per-sequence query counts and lengths. The other arguments
    are paged_attention's.
    """
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    _ops.varlen_paged_attention(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
        query_start_loc, block_size, max_query_len, max_seq_len, alibi_slopes, kv_cache_dtype,
        k_scale, v_scale,
    )
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_size] into the paged caches.

    ``slot_mapping`` int64 [num_tokens]: slot = block * block_size + offset; a negative
    slot is padding and is skipped. The cache stores key / k_scale and value / v_scale:
    in the key's dtype for kv_cache_dtype "auto", else rounded to fp8 ("fp8" =
    "fp8_e4m3", "fp8_e5m2"; uint8 caches) bit for bit as torch's float8 casts.
    """
    _ops.reshape_and_cache(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Like reshape_and_cache, for caches in the flash layout [num_blocks, block_size,
    num_kv_heads, head_size]."""
    _ops.reshape_and_cache_flash(
        key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale
    )


def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,
) -> None:
    """For each (src, dst) row of int64 ``block_mapping`` [n, 2] (on the caches' device),
    copies block src to block dst in every layer's key and value cache."""
    _ops.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copies block src of ``src`` to block dst of ``dst`` for each row of the CPU int64
    ``block_mapping`` [n, 2]; the caches may be on the CPU or a CUDA device, in any mix."""
    _ops.swap_blocks(src, dst, block_mapping)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ (qweight [N, K] int8 * scales[:, None]).T + bias; x float32
    or bfloat16 (y in x's dtype, rounded once), scales and bias float32. ``scales`` may also
    be [N, K / G] (G 32, 64 or 128; GGUF Q8_0): w[n, k] = q[n, k] * scales[n, k // G] (the
    bf16 kernel then uses each w rounded to bf16). ``qweight`` may be packed by
    :func:`pack_linear_weight` ([ceil(N / 48), K, 48]; N from ``scales``): the layers do
    that at load where the selected CPU build has packed_linear's kernels, which then run
    any number of rows. CPU only (quantization="int8" / "gguf",
    vllm_lite.layers.quantization)."""
    return _ops.int8_linear(x, qweight, scales, bias)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` float32 or bfloat16 [N, K] (bfloat16: K even) in packed_linear's layout:
    panels of output columns (csrc/cpu/packed_linear_params.h); also int8_linear's int8
    [N, K] and int4_linear's uint8 [N, K / 2] qweight, in the float32 form ([panels, K or
    K / 2, 48] bytes) those ops take. CPU only."""
    return _ops.pack_linear_weight(weight)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """x [..., K] @ W.T + bias in x's dtype for W [out_features, K] packed by
    :func:`pack_linear_weight` (same dtype as x); bias float32 [out_features] or None;
    float32 accumulation, one rounding. CPU only (models.llama.Linear)."""
    return _ops.packed_linear(x, packed_weight, bias, out_features)


def gated_panel_rows(t: torch.Tensor) -> torch.Tensor:
    """The rows [gate (I) | up (I)] of ``t`` (a SwiGLU MLP's fused gate_up weight [2I, K],
    or its bias [2I]) in the order :func:`packed_gated_linear`'s weight has them: per
    panel of the packed layout, PACKED_PANEL_COLS / 2 gate rows then the same outputs' up
    rows, zero rows past I; [panels * PACKED_PANEL_COLS, ...]. Pack the result with
    :func:`pack_linear_weight`."""
    if t.dim() not in (1, 2) or t.shape[0] % 2 or t.shape[0] == 0:
        raise ValueError(f"gated_panel_rows: t must be [2I] or [2I, K] with I >= 1, got "
                         f"shape {tuple(t.shape)}")
    half = vllm_lite._C.PACKED_PANEL_COLS // 2  # kGatedPanelCols (packed_linear_params.h)
    n = t.shape[0] // 2
    panels = -(-n // half)
    rows = t.new_zeros((2, panels * half, *t.shape[1:]))
    rows[:, :n] = t.reshape(2, n, *t.shape[1:])
    # [gate | up][panel, row] -> [panel][gate | up][row]
    return rows.reshape(2, panels, half, *t.shape[1:]).transpose(0, 1).reshape(
        panels * 2 * half, *t.shape[1:]).contiguous()


def packed_gated_linear(x: torch.Tensor, packed_weight: torch.Tensor,
                        bias: torch.Tensor | None, intermediate_size: int) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) [..., intermediate_size] in x's dtype, for a gate_up
    weight [2 * intermediate_size, K] packed by ``pack_linear_weight(gated_panel_rows(w))``
    and bias ``gated_panel_rows(b)`` float32 or None: one GEMM instead of
    :func:`packed_linear` then :func:`silu_and_mul`, with the same bits where the kernel
    runs (the gate and up outputs rounded to x's dtype first, as those ops do). CPU only
    (models.llama.Linear)."""
    return _ops.packed_gated_linear(x, packed_weight, bias, intermediate_size)


def fused_moe(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """A mixture-of-experts block's output [T, H] in ``hidden``'s dtype
    (vllm_lite.layers.moe states the math and rounding): router softmax over the E logits
    in float32, the ``top_k`` largest (ties to the lower expert id), renormalised to sum 1
    when ``renormalize``; per expert its tokens' rows through its SwiGLU expert; each row
    times its routing weight, summed per token in float32.

    ``hidden`` [T, H] float32, float16 or bfloat16 and ``router_logits`` [T, E] (any of
    those dtypes), contiguous; ``w13`` [E, 2I, H] (each expert's [gate | up] rows) and
    ``w2`` [E, H, I] in hidden's dtype, contiguous, or on the CPU both packed by
    :func:`pack_moe_weights` (float32 / bfloat16). Limits: E <= MOE_MAX_NUM_EXPERTS, top_k
    in [1, min(E, MOE_MAX_TOP_K)]. CPU and CUDA."""
    return _ops.fused_moe(hidden, router_logits, w13, w2, top_k, renormalize)


def pack_moe_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w13`` [E, 2I, H] and ``w2`` [E, H, I] (float32, or bfloat16 with H and I even) in
    the form :func:`fused_moe`'s CPU kernel runs on packed_linear's GEMM kernels: each
    expert's gate_up packed gated (:func:`gated_panel_rows` then
    :func:`pack_linear_weight`), its down projection packed, stacked over experts. Worth it
    where :func:`packed_linear_kernel_selected` holds for the dtype; fused_moe takes either
    form on the CPU."""
    if w13.dim() != 3 or w2.dim() != 3 or w13.shape[0] != w2.shape[0]:
        raise ValueError(f"pack_moe_weights: w13 must be [E, 2I, H] and w2 [E, H, I] with one E, "
                         f"got shapes {tuple(w13.shape)} and {tuple(w2.shape)}")
    return (torch.stack([pack_linear_weight(gated_panel_rows(w)) for w in w13]),
            torch.stack([pack_linear_weight(w) for w in w2]))


#: fused_moe's limits (csrc/moe_limits.h).
MOE_MAX_NUM_EXPERTS: int = vllm_lite._C.MOE_MAX_NUM_EXPERTS
MOE_MAX_TOP_K: int = vllm_lite._C.MOE_MAX_TOP_K


# One projection as llama_decode_layers takes it: (weight, scales, zeros, group_size,
# float32 bias or None): packed_linear on a packed float weight (scales None), int8_linear
# (zeros None), or int4_linear with group_size.
DecodeForm = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None", int,
                   "torch.Tensor | None"]


def llama_decode_layers(hidden: torch.Tensor, residual: torch.Tensor,
                        positions: torch.Tensor, norm_weights: list[torch.Tensor],
                        weights: list[torch.Tensor], scales: list[torch.Tensor | None],
                        zeros: list[torch.Tensor | None], group_sizes: list[int],
                        biases: list[torch.Tensor | None], intermediate_size: int,
                        gated_mlp: bool, key_caches: list[torch.Tensor],
                        value_caches: list[torch.Tensor],
                        cos_sin_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                        max_seq_len: int, num_heads: int, num_kv_heads: int, head_size: int,
                        scale: float, kv_cache_dtype: str, k_scale: float, v_scale: float,
                        epsilon: float) -> torch.Tensor:
    """One decode step (one token per sequence) through a stack of Llama decoder layers in
    one call: per layer the fused/first RMSNorm, the qkv, o, gate_up and down projections
    (2 norm weights and 4 projections per layer, in that order; each projection j is
    (weights[j], scales[j], zeros[j], group_sizes[j], biases[j]) as :data:`DecodeForm`),
    neox rotary, the cache write and paged attention (v1 or v2 as :func:`paged_attention`
    picks) - the kernels models.llama's layers call, in their order, so the same bits.
    ``hidden`` [T, hidden_size] is overwritten; ``residual`` (same shape, contents ignored)
    receives the residual stream, which the first layer starts from ``hidden``.
    ``gated_mlp``: every gate_up projection is a float weight packed gated (see
    :func:`packed_gated_linear`), run as that op. Returns the last layer's MLP output. CPU
    only (csrc/cpu/decode_layers.cpp)."""
    attn_out = hidden.new_empty((hidden.shape[0], num_heads, head_size))
    exp_sums, max_logits, tmp_out = v2_scratch(attn_out, max_seq_len) or (None, None, None)
    return _ops.llama_decode_layers(
        hidden, residual, positions, norm_weights, weights, scales, zeros, group_sizes, biases,
        intermediate_size, gated_mlp, key_caches, value_caches, cos_sin_cache, slot_mapping,
        block_tables, seq_lens, block_size, max_seq_len, num_kv_heads, scale, kv_cache_dtype,
        k_scale, v_scale, attn_out, exp_sums, max_logits, tmp_out, epsilon)


def packed_linear_kernel_selected(dtype: torch.dtype) -> bool:
    """Whether packed_linear runs its own kernel for ``dtype`` in the selected CPU build
    (float32: every build with AVX2 or AVX-512; bfloat16: "avx2", "avx512" (the AVX2
    kernel), "avx512bf16", and "amxbf16" on AMX tiles); elsewhere it computes through
    at::linear, correct but no faster."""
    if dtype not in (torch.float32, torch.bfloat16):
        return False
    return bool(vllm_lite._C.packed_linear_kernel(str(dtype).removeprefix("torch.")))


def packed_quant_linear_kernel_selected() -> bool:
    """Whether :func:`int8_linear` / :func:`int4_linear` run a qweight packed by
    :func:`pack_linear_weight` on packed_linear's tiles in the selected CPU build (builds
    with AVX2 or wider); elsewhere (generic) they unpack it per call, so layers keep the
    row layout."""
    return bool(vllm_lite._C.packed_quant_linear_kernel())


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                zeros: torch.Tensor, group_size: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ w.T + bias, w[n, k] = q[n, k] * scales[n, k // group_size]
    + zeros[n, k // group_size]; q unsigned 4-bit, two per byte of uint8 ``qweight`` [N,
    K / 2] (k = 2j in byte j's low nibble, 2j + 1 in its high one); scales, zeros float32
    [N, K / group_size], group_size 32, 64 or 128; x float32 or bfloat16 (y in x's dtype;
    the bf16 kernel uses each weight rounded to bf16), bias float32. ``qweight`` may be
    packed by :func:`pack_linear_weight` ([ceil(N / 48), K / 2, 48]), as for
    :func:`int8_linear`. CPU only (quantization="int4" / "gguf",
    vllm_lite.layers.quantization)."""
    return _ops.int4_linear(x, qweight, scales, zeros, group_size, bias)


def init_cpu_threads_env(cpu_ids: str) -> str:
    """Binds torch's OpenMP threads one per CPU of ``cpu_ids`` ("0-3,8"; thread i to the
    i-th, the caller's thread being 0) and sets torch's thread count to match; returns one
    line per thread. vLLM v0.6's op (``VLLM_CPU_OMP_THREADS_BIND``); Linux only."""
    return _ops.init_cpu_threads_env(cpu_ids)


def rms_norm(input: torch.Tensor, weight: torch.Tensor, epsilon: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row of ``input`` [..., hidden] (rows at one stride, last dim
    contiguous) with ``weight`` [hidden], in Hugging Face Llama's rounding order:
    round(weight * round(x * rsqrt(mean(x^2) + epsilon))), float32 math. Returns ``out``
    (allocated contiguous when None)."""
    if out is None:
        out = torch.empty(input.shape, dtype=input.dtype, device=input.device)
    _ops.rms_norm(out, input, weight, epsilon)
    return out


def fused_add_rms_norm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       epsilon: float) -> None:
    """In place: ``residual`` = round(input + residual), then ``input`` = rms_norm of the
    new residual (both contiguous [..., hidden], one dtype)."""
    _ops.fused_add_rms_norm(input, residual, weight, epsilon)


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``input`` [..., 2d] = [gate | up] -> round(round(silu(gate)) * up) [..., d] (the
    Llama MLP's activation, HF's rounding). Returns ``out`` (allocated when None)."""
    if out is None:
        out = torch.empty((*input.shape[:-1], input.shape[-1] // 2), dtype=input.dtype,
                          device=input.device)
    _ops.silu_and_mul(out, input)
    return out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool = True) -> None:
    """Rotates ``query`` [T, heads(, )head_size] and ``key`` in place (any token stride:
    column slices of a fused qkv work) by each token's row of ``cos_sin_cache``
    [max_position, rot_dim] = [cos | sin] (float32 or the query dtype; cast to the query
    dtype as HF does). ``is_neox``: HF's rotate_half pairs (i, i + rot_dim / 2), else
    GPT-J's (2i, 2i + 1). ``positions`` int64 [T], each in [0, max_position)."""
    _ops.rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox)


def greedy_sample(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of CPU ``logits`` [rows, vocab] (float32, float16 or bfloat16; rows at any
    stride): (token_ids int64 [rows], logprobs float32 [rows]) = the lowest id among the
    row's maxima (torch.argmax's choice) and its log_softmax, in float32 -- what the
    sampler's greedy rows need, in two passes over the logits instead of a float32 copy,
    log_softmax and argmax. A row whose maximum is not finite (a NaN, +inf, or every logit
    -inf) gets -1 and NaN: torch's argmax and log_softmax define those rows. CPU only."""
    rows = logits.shape[0] if logits.dim() else 0
    token_ids = torch.empty(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _ops.greedy_sample(logits, token_ids, logprobs)
    return token_ids, logprobs


# Fake (meta) implementations: every op but the linear ones only mutates its outputs, so
# tracing needs no shape computation, just the promise that nothing is returned.
def _register_fakes() -> None:
    def _none(*args: object, **kwargs: object) -> None:
        return None

    for name in (
        "paged_attention_v1",
        "paged_attention_v2",
        "reshape_and_cache",
        "reshape_and_cache_flash",
        "copy_blocks",
        "swap_blocks",
        "varlen_paged_attention",
        "rms_norm",
        "fused_add_rms_norm",
        "silu_and_mul",
        "rotary_embedding",
        "greedy_sample",
    ):
        torch.library.register_fake(f"vllm_lite::{name}")(_none)

    @torch.library.register_fake("vllm_lite::int8_linear")
    def _int8_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], scales.shape[0]))  # qweight may be packed

    @torch.library.register_fake("vllm_lite::pack_linear_weight")
    def _pack_linear_weight_fake(weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        cols = vllm_lite._C.PACKED_PANEL_COLS  # kPackedPanelCols (csrc/cpu/packed_linear_params.h)
        panels = -(-n // cols)
        if weight.dtype == torch.bfloat16:
            return weight.new_empty((panels, k // 2, cols, 2))
        return weight.new_empty((panels, k, cols))

    @torch.library.register_fake("vllm_lite::packed_linear")
    def _packed_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor,
                            bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], out_features))

    @torch.library.register_fake("vllm_lite::packed_gated_linear")
    def _packed_gated_linear_fake(x: torch.Tensor, packed_weight: torch.Tensor,
                                  bias: torch.Tensor | None,
                                  intermediate_size: int) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], intermediate_size))

    @torch.library.register_fake("vllm_lite::llama_decode_layers")
    def _llama_decode_layers_fake(hidden: torch.Tensor, *args: object) -> torch.Tensor:
        return torch.empty_like(hidden)

    @torch.library.register_fake("vllm_lite::int4_linear")
    def _int4_linear_fake(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                          zeros: torch.Tensor, group_size: int,
                          bias: torch.Tensor | None) -> torch.Tensor:
        return x.new_empty((*x.shape[:-1], scales.shape[0]))


    @torch.library.register_fake("vllm_lite::fused_moe")
    def _fused_moe_fake(hidden: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor,
                        w2: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        return hidden.new_empty(hidden.shape)


_register_fakes()


def cpu_isas() -> list[str]:
    """Builds of the CPU kernels this CPU can run, widest first (a subset of "amxbf16",
    "avx512bf16", "avx512", "avx2", "generic"; each implies those after it)."""
    return list(vllm_lite._C.cpu_isas())


def cpu_isa() -> str:
    """The build of the CPU kernels in use (VLLM_LITE_CPU_ISA picks it at load)."""
    return str(vllm_lite._C.cpu_isa())


def set_cpu_isa(name: str) -> None:
    """Selects a build of the CPU kernels; ValueError if this CPU can't run it."""
    vllm_lite._C.set_cpu_isa(name)
