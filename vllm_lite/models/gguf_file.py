"""A GGUF file's header, read and checked before anything trusts it.

GGUF files come from anywhere. transformers builds a model straight from a file's metadata
(block count, embedding length, ...) and then reads its tensors, so a small file that
claims a million layers would allocate and loop for as long as it claims. This reader parses
the whole header itself, bounding every count, length and offset by the file's size, and
then checks that the model the metadata describes is the model whose tensors the file
holds: every layer's tensors present, each of the shape the sizes give, and each tensor's
data inside the file. Only a file that passes is handed to the converter.

Layout (GGUF v2 / v3, little-endian): magic ``GGUF``, u32 version, u64 tensor count, u64
metadata count; the metadata (key string, u32 value type, value); the tensor table (name,
u32 dims, u64 extents innermost first, u32 ggml type, u64 offset into the data section);
the data section at the next multiple of ``general.alignment`` (default 32).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: The GGUF versions read (v1 used 32-bit counts and is long gone).
GGUF_VERSIONS = (2, 3)
#: Longest key or tensor name accepted (llama.cpp's are under 100 bytes).
MAX_NAME_BYTES = 1 << 16
#: Deepest array nesting accepted (GGUF files in use have none).
MAX_ARRAY_DEPTH = 2
#: ggml's GGML_MAX_DIMS.
MAX_TENSOR_DIMS = 4
#: The GGUF architectures whose checkpoints the engine runs (llama covers Mistral too, and
#: Mixtral: a llama file whose metadata has an ``expert_count``).
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen2moe", "qwen3moe",
                                "olmoe")
#: The mixture-of-experts architectures (besides llama with experts).
MOE_GGUF_ARCHITECTURES = ("qwen2moe", "qwen3moe", "olmoe")

# Metadata value types: code -> (struct format, size) for the fixed-size ones.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4),
            5: ("<i", 4), 6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8),
            12: ("<d", 8)}
_STRING, _ARRAY = 8, 9
_INT_TYPES = {0, 1, 2, 3, 4, 5, 10, 11}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: innermost (contiguous) extent first
    type_name: str
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
    """ggml type code -> (name, elements per block, bytes per block), from the gguf package
    (the converter's own reader), so a type it knows is a type this accepts."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    return {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType
            if t in GGML_QUANT_SIZES}


class _Cursor:
    """Reads little-endian fields from a buffer, every read bounded by its end."""

    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.end, self.path = buf, 0, len(buf), path

    def fail(self, what: str) -> ValueError:
        return ValueError(f"GGUF file {self.path}: {what}")

    def take(self, n: int, what: str) -> int:
        if n < 0 or n > self.end - self.pos:
            raise self.fail(f"{what} runs past the end of the file (offset {self.pos}, "
                            f"{n} bytes wanted, file {self.end} bytes): truncated or corrupt")
        start = self.pos
        self.pos += n
        return start

    def unpack(self, fmt: str, size: int, what: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(size, what))[0]

    def string(self, what: str, limit: int | None = None) -> str:
        n = self.unpack("<Q", 8, f"the length of {what}")
        if limit is not None and n > limit:
            raise self.fail(f"{what} is {n} bytes long; at most {limit} are accepted")
        start = self.take(n, what)
        try:
            return bytes(self.buf[start:start + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8 text") from None

    def value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self.unpack(fmt, size, what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"{what} nests arrays deeper than {MAX_ARRAY_DEPTH}")
            etype = self.unpack("<I", 4, f"the element type of {what}")
            count = self.unpack("<Q", 8, f"the length of {what}")
            if etype not in _SCALARS and etype not in (_STRING, _ARRAY):
                raise self.fail(f"{what} has elements of unknown type {etype}")
            # Each element takes at least this many bytes: a count the rest of the file
            # cannot hold is refused before anything is read or allocated.
            least = _SCALARS[etype][1] if etype in _SCALARS else (8 if etype == _STRING else 12)
            if count > (self.end - self.pos) // least:
                raise self.fail(f"{what} claims {count} elements, more than the rest of the "
                                "file can hold")
            if etype in _SCALARS:
                # Numbers as one numpy array: as many bytes as the file holds for them, where
                # a list of Python numbers would take 4 to 28 times that.
                import numpy as np

                fmt, size = _SCALARS[etype]
                start = self.take(count * size, what)
                return np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count,
                                     offset=start).copy()
            return [self.value(etype, f"{what}[{i}]", depth + 1) for i in range(count)]
        raise self.fail(f"{what} has unknown value type {vtype}")


def read_header(path: str | Path) -> GGUFHeader:
    """The header of the GGUF file ``path``; ValueError naming the problem for a file that is
    not GGUF, is truncated, lies about a count, length or offset, or uses a tensor type the
    converter does not know."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"GGUF file {path}: {size} bytes, too short for a GGUF header")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(buf, path)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None


def tensor_data(header: GGUFHeader) -> dict[str, np.ndarray]:
    """Every tensor's bytes, mapped read-only from the file (a page is read when touched),
    as uint8 rows of ggml blocks: [outer extents, outermost first..., bytes per innermost row]
    (the form gguf.GGUFReader and gguf.quants.dequantize use). The header's checks bound
    each tensor inside the file. Reading only what this needs: the gguf package's reader
    decodes every metadata array element by element first (seconds for a tokenizer's
    vocabulary), on every load."""
    mapped = np.memmap(header.path, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    for name, t in header.tensors.items():
        outer = t.shape[1:][::-1]
        rows = math.prod(outer)
        out[name] = mapped[t.offset:t.offset + t.nbytes].reshape(*outer, t.nbytes // rows)
    return out


def _parse(buf: Any, path: Path) -> GGUFHeader:
    cur = _Cursor(buf, path)
    if bytes(buf[:4]) != b"GGUF":
        raise cur.fail("does not start with the GGUF magic")
    cur.take(4, "the magic")
    version = cur.unpack("<I", 4, "the version")
    if version not in GGUF_VERSIONS:
        raise cur.fail(f"GGUF version {version} is not supported (versions "
                       f"{', '.join(map(str, GGUF_VERSIONS))}; a big-endian file reads as a "
                       "huge version)")
    n_tensors = cur.unpack("<Q", 8, "the tensor count")
    n_kv = cur.unpack("<Q", 8, "the metadata count")
    # A metadata entry takes >= 13 bytes (key length, type, 1-byte value), a tensor entry
    # >= 28 (name length, dims, one extent, type, offset).
    if n_kv > cur.end // 13 or n_tensors > cur.end // 28:
        raise cur.fail(f"claims {n_kv} metadata entries and {n_tensors} tensors, more than "
                       f"its {cur.end} bytes can hold")
    metadata: dict[str, Any] = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}", MAX_NAME_BYTES)
        vtype = cur.unpack("<I", 4, f"the type of {key!r}")
        metadata[key] = cur.value(vtype, f"metadata {key!r}")
    alignment = metadata.get("general.alignment", 32)
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1 \
            or alignment & (alignment - 1) or alignment > 1 << 20:
        raise cur.fail(f"general.alignment must be a power of two up to 1 MiB, "
                       f"got {alignment!r}")
    kinds = _quant_sizes()
    raw: list[tuple[str, tuple[int, ...], int, int]] = []
    for i in range(n_tensors):
        name = cur.string(f"tensor name #{i}", MAX_NAME_BYTES)
        n_dims = cur.unpack("<I", 4, f"the rank of tensor {name!r}")
        if not 1 <= n_dims <= MAX_TENSOR_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions (1 to "
                           f"{MAX_TENSOR_DIMS} allowed)")
        shape = tuple(cur.unpack("<Q", 8, f"the shape of tensor {name!r}")
                      for _ in range(n_dims))
        ttype = cur.unpack("<I", 4, f"the type of tensor {name!r}")
        offset = cur.unpack("<Q", 8, f"the offset of tensor {name!r}")
        raw.append((name, shape, ttype, offset))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, ttype, offset in raw:
        if name in tensors:
            raise cur.fail(f"tensor {name!r} appears twice")
        if ttype not in kinds:
            raise cur.fail(f"tensor {name!r} has unknown ggml type {ttype}")
        type_name, block, block_bytes = kinds[ttype]
        if any(d < 1 for d in shape):
            raise cur.fail(f"tensor {name!r} has an empty dimension: {list(shape)}")
        if shape[0] % block:
            raise cur.fail(f"tensor {name!r} ({type_name}): its first extent {shape[0]} is not "
                           f"a multiple of the type's block of {block}")
        nbytes = math.prod(shape) // block * block_bytes  # Python ints: no overflow
        if offset % alignment:
            raise cur.fail(f"tensor {name!r}: offset {offset} is not aligned to {alignment}")
        if data_start + offset + nbytes > cur.end:
            raise cur.fail(f"tensor {name!r} ({type_name} {list(shape)}, {nbytes} bytes at "
                           f"data offset {offset}) runs past the end of the file "
                           f"({cur.end} bytes): truncated or lying")
        tensors[name] = TensorInfo(name, shape, type_name, data_start + offset, nbytes)
    return GGUFHeader(path, version, metadata, tensors)


# -- the model the header describes -----------------------------------------------------------

#: Tensor types that are not floating point (ggml's integer types): refused as weights.
_INTEGER_TYPES = ("I8", "I16", "I32", "I64")
#: Each decoder layer's tensors and their shapes (ggml order), from the sizes.
_ATTENTION_TENSORS = (
    ("attn_norm.weight", lambda s: (s["hidden"],)),
    ("ffn_norm.weight", lambda s: (s["hidden"],)),
    ("attn_q.weight", lambda s: (s["hidden"], s["heads"] * s["head_dim"])),
    ("attn_k.weight", lambda s: (s["hidden"], s["kv_heads"] * s["head_dim"])),
    ("attn_v.weight", lambda s: (s["hidden"], s["kv_heads"] * s["head_dim"])),
    ("attn_output.weight", lambda s: (s["heads"] * s["head_dim"], s["hidden"])),
)
_DENSE_FFN_TENSORS = (
    ("ffn_gate.weight", lambda s: (s["hidden"], s["inter"])),
    ("ffn_up.weight", lambda s: (s["hidden"], s["inter"])),
    ("ffn_down.weight", lambda s: (s["inter"], s["hidden"])),
)
_LAYER_TENSORS = _ATTENTION_TENSORS + _DENSE_FFN_TENSORS
#: A mixture-of-experts layer's feed-forward tensors: the router and the experts stacked
#: along the outermost extent (llama.cpp's ``ffn_*_exps``).
_MOE_FFN_TENSORS = (
    ("ffn_gate_inp.weight", lambda s: (s["hidden"], s["experts"])),
    ("ffn_gate_exps.weight", lambda s: (s["hidden"], s["expert_inter"], s["experts"])),
    ("ffn_up_exps.weight", lambda s: (s["hidden"], s["expert_inter"], s["experts"])),
    ("ffn_down_exps.weight", lambda s: (s["expert_inter"], s["hidden"], s["experts"])),
)
#: Qwen2-MoE's shared expert (its sigmoid gate, ffn_gate_inp_shexp, is checked apart: llama.cpp
#: writes it as [hidden] or [hidden, 1]).
_SHARED_FFN_TENSORS = (
    ("ffn_gate_shexp.weight", lambda s: (s["hidden"], s["shared_inter"])),
    ("ffn_up_shexp.weight", lambda s: (s["hidden"], s["shared_inter"])),
    ("ffn_down_shexp.weight", lambda s: (s["shared_inter"], s["hidden"])),
)
#: The q / k norms of the MoE architectures that have them: per head (Qwen3-MoE) or over
#: all heads at once (OLMoE).
_QK_NORM_TENSORS = {
    "qwen3moe": (("attn_q_norm.weight", lambda s: (s["head_dim"],)),
                 ("attn_k_norm.weight", lambda s: (s["head_dim"],))),
    "olmoe": (("attn_q_norm.weight", lambda s: (s["heads"] * s["head_dim"],)),
              ("attn_k_norm.weight", lambda s: (s["kv_heads"] * s["head_dim"],))),
}
#: Qwen2-MoE's q / k / v biases (all three or none).
_QKV_BIAS_TENSORS = (
    ("attn_q.bias", lambda s: (s["heads"] * s["head_dim"],)),
    ("attn_k.bias", lambda s: (s["kv_heads"] * s["head_dim"],)),
    ("attn_v.bias", lambda s: (s["kv_heads"] * s["head_dim"],)),
)
#: The MoE architectures that may have dense layers (HF's mlp_only_layers).
_MOE_WITH_DENSE_LAYERS = ("qwen2moe", "qwen3moe")
#: ggml's expert_gating_func for softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX).
_GATING_SOFTMAX = 1


def _size(header: GGUFHeader, key: str, *, required: bool = True) -> int | None:
    value = header.metadata.get(key)
    if value is None and not required:
        return None
    if value is None:
        raise ValueError(f"GGUF file {header.path}: metadata {key} is missing")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"GGUF file {header.path}: metadata {key} must be a positive "
                         f"integer, got {value!r}")
    return value


def _positive(header: GGUFHeader, key: str) -> None:
    value = header.metadata.get(key)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            not 0 < value < math.inf:
        raise ValueError(f"GGUF file {header.path}: metadata {key} must be a positive "
                         f"finite number, got {value!r}")


def is_moe(header: GGUFHeader) -> bool:
    """Whether the file holds a mixture of experts: a MoE architecture, or llama with an
    ``expert_count`` (how llama.cpp writes Mixtral)."""
    arch = header.metadata.get("general.architecture")
    return arch in MOE_GGUF_ARCHITECTURES or (
        arch == "llama" and header.metadata.get("llama.expert_count") not in (None, 0))


@dataclass(frozen=True)
class GGUFModelSizes:
    """The sizes a checked GGUF file describes (HF config names); the expert fields are
    None (and ``mlp_only_layers`` empty) for a dense model."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    # Layers whose feed-forward block is the dense MLP (Qwen MoEs only).
    mlp_only_layers: tuple[int, ...] = ()
    # Whether the router's top-k weights are renormalised (None: dense model).
    norm_topk_prob: bool | None = None


def _moe_sizes(header: GGUFHeader, arch: str, inter: int) -> dict[str, Any]:
    """The expert settings of a MoE file, checked as the MoE layer's config check does
    (a count past the kernels' limits, top-k above the expert count), and the routing
    settings llama.cpp's graphs fix per architecture (softmax gating, unscaled weights,
    renormalised per ``expert_weights_norm``, else as llama.cpp does for the architecture:
    Mixtral and Qwen3-MoE yes, Qwen2-MoE and OLMoE no). ValueError naming the key."""
    from vllm_lite.layers.moe import check_moe_config

    p = f"{arch}."
    where = f"GGUF file {header.path}"
    experts = header.metadata.get(p + "expert_count")
    top_k = header.metadata.get(p + "expert_used_count")
    inter_key = p + "expert_feed_forward_length"
    if arch in _MOE_WITH_DENSE_LAYERS:
        expert_inter = header.metadata.get(inter_key)  # its own size, always written
    else:  # Mixtral, OLMoE: the experts are feed_forward_length wide unless it says
        expert_inter = header.metadata.get(inter_key, inter)
        inter_key = inter_key if inter_key in header.metadata else p + "feed_forward_length"
    if top_k is None:
        raise ValueError(f"{where}: metadata {p}expert_used_count is missing")
    if expert_inter is None:
        raise ValueError(f"{where}: metadata {inter_key} is missing")
    try:
        check_moe_config((p + "expert_count", experts), (p + "expert_used_count", top_k),
                         (inter_key, expert_inter))
    except ValueError as e:
        raise ValueError(f"{where}: {str(e).replace('config field', 'metadata')}") from None
    gating = header.metadata.get(p + "expert_gating_func")
    if gating is not None and gating != _GATING_SOFTMAX:
        raise ValueError(f"{where}: metadata {p}expert_gating_func {gating!r} is not supported "
                         f"(only {_GATING_SOFTMAX}, softmax)")
    scale = header.metadata.get(p + "expert_weights_scale")
    if scale is not None and scale != 1.0:
        raise ValueError(f"{where}: metadata {p}expert_weights_scale {scale!r} is not "
                         "supported (only 1.0: the routing weights unscaled)")
    shared_count = header.metadata.get(p + "expert_shared_count")
    want_shared = 1 if arch == "qwen2moe" else 0
    if shared_count is not None and shared_count != want_shared:
        raise ValueError(f"{where}: metadata {p}expert_shared_count {shared_count!r} is not "
                         f"supported for {arch} (only {want_shared})")
    norm = header.metadata.get(p + "expert_weights_norm")
    if norm is not None and not isinstance(norm, bool):
        raise ValueError(f"{where}: metadata {p}expert_weights_norm must be a bool, got {norm!r}")
    if norm is None:
        norm = arch in ("llama", "qwen3moe")
    if arch == "llama" and not norm:
        raise ValueError(f"{where}: metadata llama.expert_weights_norm false: Mixtral always "
                         "renormalises its top-k weights")
    shared = (_size(header, p + "expert_shared_feed_forward_length") if arch == "qwen2moe"
              else None)
    return {"experts": experts, "top_k": top_k, "expert_inter": expert_inter,
            "shared_inter": shared, "norm_topk_prob": norm}


def check_model(header: GGUFHeader) -> GGUFModelSizes:
    """The model the header describes, after checking that the file holds exactly it:
    an architecture the engine runs, positive sizes that divide as heads must, rope and norm
    constants positive, every layer's tensors present with the shapes the sizes give (so no
    size can exceed what the file's own bytes hold), no tensor of a layer past the count,
    and no integer-typed weight; for a mixture of experts also the expert settings and the
    router, stacked experts and shared expert of every layer. ValueError naming the key or
    tensor otherwise."""
    arch = header.metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF file {header.path}: general.architecture {arch!r} is not "
                         f"supported; supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    p = f"{arch}."
    layers = _size(header, p + "block_count")
    hidden = _size(header, p + "embedding_length")
    inter = _size(header, p + "feed_forward_length")
    heads = _size(header, p + "attention.head_count")
    kv_heads = _size(header, p + "attention.head_count_kv", required=False) or heads
    context = _size(header, p + "context_length", required=False)
    # transformers takes a Llama's head_dim from rope.dimension_count: it sizes q / k too.
    key_length = _size(header, p + "attention.key_length", required=False)
    rope_dims = _size(header, p + "rope.dimension_count", required=False)
    if key_length and rope_dims and key_length != rope_dims:
        raise ValueError(f"GGUF file {header.path}: {p}rope.dimension_count {rope_dims} differs "
                         f"from {p}attention.key_length {key_length} (partial rotary is not "
                         "supported)")
    head_dim = key_length or rope_dims
    head_dim_from = (p + "attention.key_length" if key_length else
                     p + "rope.dimension_count" if rope_dims else "embedding_length / head_count")
    if heads % kv_heads:
        raise ValueError(f"GGUF file {header.path}: {p}attention.head_count {heads} is not a "
                         f"multiple of {p}attention.head_count_kv {kv_heads}")
    if head_dim is None:
        if hidden % heads:
            raise ValueError(f"GGUF file {header.path}: {p}embedding_length {hidden} is not "
                             f"divisible by {p}attention.head_count {heads}")
        head_dim = hidden // heads
    for key in ("rope.freq_base", "attention.layer_norm_rms_epsilon", "rope.scaling.factor"):
        _positive(header, p + key)
    moe = _moe_sizes(header, arch, inter) if is_moe(header) else None
    embd = header.tensors.get("token_embd.weight")
    if embd is None or len(embd.shape) != 2 or embd.shape[0] != hidden:
        raise ValueError(f"GGUF file {header.path}: token_embd.weight must be "
                         f"[{hidden}, vocab] ({p}embedding_length {hidden}), got "
                         f"{None if embd is None else list(embd.shape)}")
    vocab = embd.shape[1]
    declared_vocab = header.metadata.get(p + "vocab_size")
    if declared_vocab is not None and declared_vocab != vocab:
        raise ValueError(f"GGUF file {header.path}: {p}vocab_size {declared_vocab!r} differs "
                         f"from token_embd.weight's {vocab} rows")
    # Every layer has at least its attention tensors and three feed-forward ones.
    if layers * len(_LAYER_TENSORS) > len(header.tensors):
        raise ValueError(f"GGUF file {header.path}: {p}block_count {layers} needs "
                         f"{len(_LAYER_TENSORS)} tensors per layer; the file holds "
                         f"{len(header.tensors)} tensors in all (blk.N tensors are missing)")
    sizes = {"hidden": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
             "inter": inter, **(moe or {})}
    expected = {"token_embd.weight": (hidden, vocab), "output_norm.weight": (hidden,)}
    if "output.weight" in header.tensors:
        expected["output.weight"] = (hidden, vocab)
    dense_layers: list[int] = []
    for i in range(layers):
        blk = f"blk.{i}."
        parts = list(_ATTENTION_TENSORS)
        if moe is None:
            parts += _DENSE_FFN_TENSORS
        else:
            parts += _QK_NORM_TENSORS.get(arch, ())
            if arch == "qwen2moe" and any(blk + n in header.tensors for n, _ in _QKV_BIAS_TENSORS):
                parts += _QKV_BIAS_TENSORS
            if blk + "ffn_gate_inp.weight" not in header.tensors and \
                    arch in _MOE_WITH_DENSE_LAYERS and blk + "ffn_gate.weight" in header.tensors:
                dense_layers.append(i)  # a dense layer (HF's mlp_only_layers)
                parts += _DENSE_FFN_TENSORS
            else:
                parts += _MOE_FFN_TENSORS
                if arch == "qwen2moe":
                    parts += _SHARED_FFN_TENSORS
                    gate = header.tensors.get(blk + "ffn_gate_inp_shexp.weight")
                    if gate is None or gate.shape not in ((hidden,), (hidden, 1)):
                        raise ValueError(
                            f"GGUF file {header.path}: tensor {blk}ffn_gate_inp_shexp.weight "
                            f"must be [{hidden}] ({p}embedding_length), got "
                            f"{None if gate is None else list(gate.shape)}")
        for part, shape in parts:
            expected[blk + part] = shape(sizes)
    for name, shape in expected.items():
        info = header.tensors.get(name)
        if info is None:
            raise ValueError(f"GGUF file {header.path}: tensor {name} is missing ({p}block_count "
                             f"says {layers} layers)")
        if info.shape != shape:
            expert_sizes = "" if moe is None else (
                f", {moe['experts']} experts of {moe['expert_inter']} features"
                + (f", a shared expert of {moe['shared_inter']}" if moe["shared_inter"] else ""))
            raise ValueError(f"GGUF file {header.path}: tensor {name} is {list(info.shape)}, "
                             f"the metadata's sizes make it {list(shape)} ({p}embedding_length "
                             f"{hidden}, {p}attention.head_count {heads}, "
                             f"{p}attention.head_count_kv {kv_heads}, head size {head_dim} "
                             f"from {head_dim_from}, {p}feed_forward_length {inter}"
                             f"{expert_sizes})")
        if info.type_name in _INTEGER_TYPES:
            raise ValueError(f"GGUF file {header.path}: tensor {name} is stored as "
                             f"{info.type_name}; model weights must be floating point or a "
                             "quantized format")
    for name in header.tensors:
        if name.startswith("blk."):
            index = name.split(".", 2)[1]
            if not index.isdigit() or int(index) >= layers:
                raise ValueError(f"GGUF file {header.path}: tensor {name} lies past "
                                 f"{p}block_count {layers}")
    if moe is None:
        return GGUFModelSizes(arch, layers, hidden, inter, heads, kv_heads, head_dim, vocab,
                              context, "output.weight" not in header.tensors)
    return GGUFModelSizes(arch, layers, hidden, inter, heads, kv_heads, head_dim, vocab, context,
                          "output.weight" not in header.tensors, moe["experts"], moe["top_k"],
                          moe["expert_inter"], moe["shared_inter"], tuple(dense_layers),
                          moe["norm_topk_prob"])
