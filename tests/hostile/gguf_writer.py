"""Writes GGUF files byte by byte, lies included, for the hostile-file tests.

Written from the GGUF format description, independently of vllm_lite's reader and of the
gguf package's writer, so that every field (counts, lengths, offsets, types) can be set
to whatever a hostile file would hold."""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

U8, I8, U16, I16, U32, I32, F32, BOOL, STRING, ARRAY, U64, I64, F64 = range(13)
_FMT = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
        U64: "<Q", I64: "<q", F64: "<d"}
GGML_F32, GGML_F16, GGML_I8, GGML_I32 = 0, 1, 24, 26
_GGML_BYTES = {GGML_F32: 4, GGML_F16: 2, GGML_I8: 1, GGML_I32: 4}
ALIGN = 32


def _string(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        etype, items = value
        return struct.pack("<IQ", etype, len(items)) + b"".join(_value(etype, v) for v in items)
    return struct.pack(_FMT[vtype], value)


@dataclass
class Tensor:
    name: str
    data: np.ndarray  # numpy (outer, ..., inner); written in ggml order (inner first)
    ggml_type: int = GGML_F32
    shape: tuple[int, ...] | None = None  # the extents written (ggml order); None: the data's
    offset: int | None = None  # the offset written; None: where the data really goes


@dataclass
class GGUF:
    metadata: list[tuple[str, int, Any]] = field(default_factory=list)
    tensors: list[Tensor] = field(default_factory=list)
    version: int = 3
    n_tensors: int | None = None  # the counts written; None: the real ones
    n_kv: int | None = None

    def set(self, key: str, vtype: int, value: Any) -> None:
        self.metadata = [m for m in self.metadata if m[0] != key] + [(key, vtype, value)]

    def drop(self, key: str) -> None:
        self.metadata = [m for m in self.metadata if m[0] != key]

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def to_bytes(self) -> bytes:
        head = b"GGUF" + struct.pack("<IQQ", self.version,
                                     len(self.tensors) if self.n_tensors is None else self.n_tensors,
                                     len(self.metadata) if self.n_kv is None else self.n_kv)
        head += b"".join(_string(k) + struct.pack("<I", t) + _value(t, v)
                         for k, t, v in self.metadata)
        blobs, infos, pos = [], [], 0
        for t in self.tensors:
            raw = np.ascontiguousarray(t.data).tobytes()
            shape = t.shape if t.shape is not None else tuple(reversed(t.data.shape))
            infos.append(_string(t.name) + struct.pack("<I", len(shape))
                         + b"".join(struct.pack("<Q", d) for d in shape)
                         + struct.pack("<IQ", t.ggml_type, pos if t.offset is None else t.offset))
            pad = -len(raw) % ALIGN
            blobs.append(raw + b"\0" * pad)
            pos += len(raw) + pad
        head += b"".join(infos)
        head += b"\0" * (-len(head) % ALIGN)
        return head + b"".join(blobs)

    def write(self, path: Path) -> Path:
        path.write_bytes(self.to_bytes())
        return path


def tiny_llama(tokenizer_folder: Path, layers: int = 2, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, inter: int = 128, seed: int = 0) -> GGUF:
    """A tiny random Llama as llama.cpp lays it out (F32 tensors), with the byte-level BPE
    tokenizer saved in ``tokenizer_folder`` (tests/models/helpers.make_tokenizer)."""
    tok = json.loads((tokenizer_folder / "tokenizer.json").read_text())
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    tokens = [t for t, _ in vocab]
    n_vocab = len(tokens)
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    head_dim = hidden // heads
    g = GGUF()
    a = "llama."
    for key, vtype, value in [
        ("general.architecture", STRING, "llama"), ("general.name", STRING, "tiny"),
        (a + "block_count", U32, layers), (a + "context_length", U32, 256),
        (a + "embedding_length", U32, hidden), (a + "feed_forward_length", U32, inter),
        (a + "attention.head_count", U32, heads), (a + "attention.head_count_kv", U32, kv_heads),
        (a + "rope.freq_base", F32, 10000.0), (a + "attention.layer_norm_rms_epsilon", F32, 1e-6),
        (a + "rope.dimension_count", U32, head_dim), (a + "vocab_size", U32, n_vocab),
        ("tokenizer.ggml.model", STRING, "gpt2"), ("tokenizer.ggml.pre", STRING, "default"),
        ("tokenizer.ggml.tokens", ARRAY, (STRING, tokens)),
        ("tokenizer.ggml.token_type", ARRAY, (I32, [3 if t == "<eos>" else 1 for t in tokens])),
        ("tokenizer.ggml.merges", ARRAY, (STRING, merges)),
        ("tokenizer.ggml.eos_token_id", U32, tok["model"]["vocab"]["<eos>"]),
        ("tokenizer.ggml.bos_token_id", U32, tok["model"]["vocab"]["<eos>"]),
        ("tokenizer.chat_template", STRING,
         "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"),
    ]:
        g.set(key, vtype, value)
    g.tensors.append(Tensor("token_embd.weight", w(n_vocab, hidden)))
    g.tensors.append(Tensor("output_norm.weight", 1 + w(hidden)))
    for i in range(layers):
        b = f"blk.{i}."
        g.tensors += [
            Tensor(b + "attn_norm.weight", 1 + w(hidden)),
            Tensor(b + "ffn_norm.weight", 1 + w(hidden)),
            Tensor(b + "attn_q.weight", w(heads * head_dim, hidden)),
            Tensor(b + "attn_k.weight", w(kv_heads * head_dim, hidden)),
            Tensor(b + "attn_v.weight", w(kv_heads * head_dim, hidden)),
            Tensor(b + "attn_output.weight", w(hidden, heads * head_dim)),
            Tensor(b + "ffn_gate.weight", w(inter, hidden)),
            Tensor(b + "ffn_up.weight", w(inter, hidden)),
            Tensor(b + "ffn_down.weight", w(hidden, inter)),
        ]
    return g
