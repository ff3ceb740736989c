"""Hostile GGUF files against LLM(model=...): each lie in a header (sizes, counts, lengths,
offsets, types) is refused with a ValueError naming it, before transformers builds anything
from the file, and within a probe's memory limit and deadline (conftest.ProbeRunner)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from hostile import probes  # noqa: E402
from hostile.gguf_writer import (  # noqa: E402
    ARRAY, F32, GGML_I32, GGUF, I32, STRING, U32, U64, tiny_llama)
from models.helpers import make_tokenizer  # noqa: E402

A = "llama."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gguf_tokenizer")
    make_tokenizer(folder)
    return folder


@pytest.fixture
def fresh(tok_dir: Path) -> Callable[[], GGUF]:
    """Makes new copies of one tiny random Llama (fresh weights each test)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    return lambda: tiny_llama(tok_dir, seed=seed)


@pytest.fixture
def tiny(fresh: Callable[[], GGUF]) -> GGUF:
    return fresh()


def test_the_honest_file_loads_and_generates(probe, tiny: GGUF, tmp_path: Path) -> None:
    """The baseline every lie below is a change of: it must load, or the refusals below
    would prove nothing."""
    result = probe(probes.load_llm, str(tiny.write(tmp_path / "tiny.gguf")))
    assert result[0] == "ok", result
    assert len(result[1]) == 3


# (metadata key, value type, lie, words the error must hold)
SIZE_LIES = [
    (A + "block_count", U32, 10**6, "block_count|missing"),
    (A + "block_count", U64, 2**40, "block_count|missing"),
    (A + "block_count", U32, 0, A + "block_count|positive"),
    (A + "block_count", I32, -2, A + "block_count|positive"),
    (A + "embedding_length", U64, 10**9, "token_embd.weight"),
    (A + "embedding_length", U32, 0, A + "embedding_length"),
    (A + "feed_forward_length", U64, 10**9, "ffn_gate"),
    (A + "attention.head_count", U32, 0, "head_count"),
    (A + "attention.head_count", U32, 3, "head_count"),  # 64 % 3 and 3 % 2
    (A + "attention.head_count_kv", U32, 3, "head_count_kv"),
    (A + "attention.head_count", U32, 10**6, "head_count"),
    (A + "rope.dimension_count", U32, 10**6, "rope.dimension_count"),
    (A + "vocab_size", U64, 2**40, "vocab_size"),
    (A + "context_length", U64, 2**40, "GiB"),
    (A + "rope.freq_base", F32, 0.0, "rope.freq_base|positive"),
    (A + "rope.freq_base", F32, -1.0, "rope.freq_base"),
    (A + "attention.layer_norm_rms_epsilon", F32, 0.0, "layer_norm_rms_epsilon"),
    ("general.architecture", STRING, "gpt-evil", "general.architecture|not supported"),
    ("general.architecture", STRING, "bert", "general.architecture"),
]


@pytest.mark.parametrize("key,vtype,value,match", SIZE_LIES,
                         ids=[f"{k.split('.', 1)[-1]}={v}" for k, _, v, _ in SIZE_LIES])
def test_lying_sizes_are_refused_before_building(probe, tiny: GGUF, tmp_path: Path, key: str,
                                                 vtype: int, value: object, match: str) -> None:
    tiny.set(key, vtype, value)
    t0 = time.perf_counter()
    probe.refuses(probes.load_llm, str(tiny.write(tmp_path / "lie.gguf")), match=match)
    # Refused from the header: no conversion (seconds) started.
    assert time.perf_counter() - t0 < 30


def test_missing_sizes_are_refused(probe, tiny: GGUF, tmp_path: Path) -> None:
    tiny.drop(A + "embedding_length")
    probe.refuses(probes.load_llm, str(tiny.write(tmp_path / "m.gguf")),
                  match=A + "embedding_length|missing")


def _layer_tensor(g: GGUF, part: str) -> object:
    return g.tensor(f"blk.1.{part}.weight")


def test_tensor_lies(probe, fresh: Callable[[], GGUF], tmp_path: Path) -> None:
    cases = []
    g = fresh()
    # A wrong shape.
    t = _layer_tensor(g, "ffn_up")
    t.data = t.data[:, :32].copy()
    cases.append((g.to_bytes(), "blk.1.ffn_up.weight"))
    # A layer past block_count.
    g = fresh()
    extra = g.tensor("blk.1.attn_norm.weight")
    g.tensors.append(type(extra)("blk.7.attn_norm.weight", extra.data))
    cases.append((g.to_bytes(), "blk.7|block_count"))
    # A missing layer tensor.
    g = fresh()
    g.tensors = [x for x in g.tensors if x.name != "blk.0.attn_v.weight"]
    cases.append((g.to_bytes(), "blk.0.attn_v.weight|missing"))
    # A tensor named twice.
    g = fresh()
    g.tensors.append(g.tensor("output_norm.weight"))
    cases.append((g.to_bytes(), "output_norm.weight|twice"))
    # An integer weight (I32 with the right shape).
    g = fresh()
    t = _layer_tensor(g, "attn_q")
    t.data, t.ggml_type = t.data.astype(np.int32), GGML_I32
    cases.append((g.to_bytes(), "blk.1.attn_q.weight|I32"))
    # An unknown ggml type.
    g = fresh()
    _layer_tensor(g, "attn_k").ggml_type = 1234
    cases.append((g.to_bytes(), "blk.1.attn_k.weight|unknown ggml type"))
    # An offset past the end of the file, and one not aligned.
    g = fresh()
    _layer_tensor(g, "ffn_down").offset = 1 << 40
    cases.append((g.to_bytes(), "blk.1.ffn_down.weight|past the end"))
    g = fresh()
    _layer_tensor(g, "ffn_down").offset = 4
    cases.append((g.to_bytes(), "blk.1.ffn_down.weight|aligned"))
    # Extents that claim more data than the file holds.
    g = fresh()
    _layer_tensor(g, "ffn_gate").shape = (64, 1 << 40)
    cases.append((g.to_bytes(), "blk.1.ffn_gate.weight"))
    g = fresh()
    _layer_tensor(g, "ffn_gate").shape = (64, 0)
    cases.append((g.to_bytes(), "blk.1.ffn_gate.weight|empty"))
    g = fresh()
    _layer_tensor(g, "ffn_gate").shape = (64, 2, 2, 2, 2)
    cases.append((g.to_bytes(), "blk.1.ffn_gate.weight|dimensions"))
    for i, (data, match) in enumerate(cases):
        path = tmp_path / f"t{i}.gguf"
        path.write_bytes(data)
        probe.refuses(probes.load_llm, str(path), match=match)


def test_container_lies(probe, tiny: GGUF, fresh: Callable[[], GGUF], tmp_path: Path) -> None:
    cases: list[tuple[bytes, str]] = []
    good = tiny.to_bytes()
    cases.append((b"GGML" + good[4:], "magic"))
    cases.append((good[:4] + struct.pack("<I", 1) + good[8:], "version 1"))
    cases.append((good[:4] + struct.pack(">I", 3) + good[8:], "big-endian"))
    g = fresh()
    g.n_tensors = 1 << 50
    cases.append((g.to_bytes(), "tensors"))
    g = fresh()
    g.n_kv = 1 << 50
    cases.append((g.to_bytes(), "metadata"))
    g = fresh()
    g.n_kv = len(g.metadata) + 5  # more entries claimed than written: runs into the tensors
    cases.append((g.to_bytes(), "GGUF file"))
    # A key whose length field claims 2**62 bytes.
    body = bytearray(good)
    body[24:32] = struct.pack("<Q", 1 << 62)
    cases.append((bytes(body), "metadata key #0"))
    # A string value longer than the file.
    g = fresh()
    g.set("general.name", STRING, "x")
    raw = bytearray(g.to_bytes())
    at = raw.index(b"general.name") + len(b"general.name") + 4
    raw[at:at + 8] = struct.pack("<Q", 1 << 60)
    cases.append((bytes(raw), "general.name"))
    # An array that claims 2**60 tokens.
    g = fresh()
    raw = bytearray(g.to_bytes())
    at = raw.index(b"tokenizer.ggml.tokens") + len(b"tokenizer.ggml.tokens") + 4 + 4
    raw[at:at + 8] = struct.pack("<Q", 1 << 60)
    cases.append((bytes(raw), "tokenizer.ggml.tokens|elements"))
    # Arrays nested deeper than any real file.
    g = fresh()
    g.set("general.nested", ARRAY, (ARRAY, [(ARRAY, [(U32, [1])])]))
    cases.append((g.to_bytes(), "general.nested|nests"))
    # An unknown metadata value type.
    raw = bytearray(good)
    at = raw.index(b"general.name") + len(b"general.name")
    raw[at:at + 4] = struct.pack("<I", 99)
    cases.append((bytes(raw), "general.name|unknown value type"))
    # Truncated: in the header, the metadata, the tensor table and the data.
    for cut in (10, 200, len(good) // 3, len(good) - 100):
        cases.append((good[:cut], "GGUF file"))
    for i, (data, match) in enumerate(cases):
        path = tmp_path / f"c{i}.gguf"
        path.write_bytes(data)
        probe.refuses(probes.load_llm, str(path), match=match)


def test_header_reader_agrees_with_the_gguf_package(tiny: GGUF, tmp_path: Path) -> None:
    """vllm_lite's reader finds every tensor where the gguf package's reader does."""
    from gguf import GGUFReader

    from vllm_lite.models.gguf_file import read_header

    path = tiny.write(tmp_path / "tiny.gguf")
    ours = read_header(path)
    theirs = GGUFReader(str(path))
    assert len(ours.tensors) == len(theirs.tensors)
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.shape == tuple(int(x) for x in t.shape)
        assert (mine.offset, mine.nbytes, mine.type_name) == (t.data_offset, t.n_bytes,
                                                              t.tensor_type.name)
    for key in ("llama.block_count", "tokenizer.ggml.model", "llama.rope.freq_base"):
        assert ours.metadata[key] == pytest.approx(theirs.fields[key].contents())
    assert list(ours.metadata["tokenizer.ggml.tokens"]) == \
        theirs.fields["tokenizer.ggml.tokens"].contents()
