"""IncrementalDetokenizer's text stream (the backend's DecodeStream where it applies, the
window scheme in Python elsewhere) against the scheme written out here on an independent
decode, over random token streams: special and added tokens, multi-byte characters split
across tokens, byte fallback, a SentencePiece-style leading space, several tokens at once,
forks, prompts that end inside a character; and against one decode of the whole output."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any
from collections.abc import Callable, Sequence

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from models.text_tokenizers import (  # noqa: E402
    make_byte_tokenizer,
    make_word_tokenizer,
    reference_decode,
)
from vllm_lite.detokenizer import IncrementalDetokenizer  # noqa: E402

FLAGS = [(skip, spaces) for skip in (False, True) for spaces in (True, False)]


class ReferenceScheme:
    """vLLM's prefix_offset / read_offset scheme over the whole token list, decoding with
    tests/models/text_tokenizers.reference_decode (token strings, not the backend)."""

    def __init__(self, tok: Any, prompt: Sequence[int], skip: bool, spaces: bool) -> None:
        self.decode: Callable[[Sequence[int]], str] = \
            lambda ids: reference_decode(tok, ids, skip, spaces)
        self.tokens = list(prompt)
        self.read = len(self.tokens)
        self.prefix = max(self.read - 5, 0)
        self.text = ""

    def fork(self) -> ReferenceScheme:
        child = object.__new__(ReferenceScheme)
        child.__dict__.update(self.__dict__, tokens=list(self.tokens))
        return child

    def add(self, ids: Sequence[int]) -> str:
        self.tokens.extend(ids)
        head = self.decode(self.tokens[self.prefix:self.read])
        full = self.decode(self.tokens[self.prefix:])
        if len(full) > len(head) and not full.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.tokens)
            self.text += full[len(head):]
            return full[len(head):]
        return ""

    def flush(self) -> str:
        if self.read == len(self.tokens):
            return ""
        head = self.decode(self.tokens[self.prefix:self.read])
        full = self.decode(self.tokens[self.prefix:])
        new = full[len(head):] if full.startswith(head) else ""
        self.prefix = self.read = len(self.tokens)
        self.text += new
        return new


def make_sentencepiece_tokenizer(folder: Path) -> Any:
    """A Llama-style BPE: "▁" for spaces, byte-fallback tokens <0x00>..<0xFF>, a decoder
    that strips the text's leading space; <s>, </s> special, "<tool>" added."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for word in ["▁", "▁the", "▁cat", "sat", "▁on", "é", "▁na", "ï", "ve", "▁hello", "a", "b",
                 "▁▁", "mat", "."]:
        vocab[word] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.add_tokens([AddedToken("<tool>", normalized=False)])
    fast.save_pretrained(folder)
    return fast


def _smollm2_tokenizer() -> Any:
    """The default model's tokenizer where its converted GGUF is in the cache, else None."""
    from transformers import AutoTokenizer

    cache = Path(os.environ.get("VLLM_LITE_CACHE") or Path.home() / ".cache" / "vllm_lite")
    for folder in sorted(cache.glob("SmolLM2-135M-Instruct*")):
        if (folder / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(folder)
    return None


TOKENIZERS = ["byte", "word", "sentencepiece", "smollm2"]


@pytest.fixture(scope="module", params=TOKENIZERS)
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "byte":
        return make_byte_tokenizer(folder)
    if request.param == "word":
        return make_word_tokenizer(folder)
    if request.param == "sentencepiece":
        return make_sentencepiece_tokenizer(folder)
    t = _smollm2_tokenizer()
    if t is None:
        pytest.skip("the default model's tokenizer is not in the cache (vllm-lite pulls it)")
    return t


def _pool(tok: Any) -> list[int]:
    """Ids to draw from: a slice of the vocabulary, every added and special token, and
    the tokens of text with 2-, 3- and 4-byte characters."""
    size = len(tok)
    pool = list(range(min(size, 400)))
    pool += list(tok.added_tokens_decoder) + list(tok.all_special_ids)
    pool += tok.encode("café naïve — 日本 😀 the cat", add_special_tokens=False)
    return [t for t in pool if 0 <= t < size]


def _run(det: Any, chunks: list[list[int]]) -> list[str]:
    pieces = [det.add(c) if isinstance(det, ReferenceScheme) else det.add_tokens(c)
              for c in chunks]
    pieces.append(det.flush())
    return pieces


@pytest.mark.parametrize("skip,spaces", FLAGS)
def test_stream_equals_the_scheme(tok: Any, skip: bool, spaces: bool) -> None:
    rng = random.Random(hash((len(tok), skip, spaces)) & 0xffff)
    pool = _pool(tok)
    for case in range(40):
        prompt = [rng.choice(pool) for _ in range(rng.choice([0, 1, 3, 8]))]
        out = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        # Mostly one token per call (the decode step), sometimes several (a catch-up).
        chunks, i = [], 0
        while i < len(out):
            k = 1 if rng.random() < 0.85 else rng.randint(2, 4)
            chunks.append(out[i:i + k])
            i += k
        ref = ReferenceScheme(tok, prompt, skip, spaces)
        det = IncrementalDetokenizer(tok, prompt, skip, spaces)
        cut = rng.randint(0, len(chunks))
        head_ref = [ref.add(c) for c in chunks[:cut]]
        head_det = [det.add_tokens(c) for c in chunks[:cut]]
        assert head_det == head_ref, (prompt, out)
        # A fork continues from the same state with its own tokens; the parent goes on.
        tail = [[rng.choice(pool)] for _ in range(rng.randint(1, 8))]
        ref_child, det_child = ref.fork(), det.fork()
        assert _run(det_child, tail) == _run(ref_child, tail), (prompt, out, tail)
        assert _run(det, chunks[cut:]) == _run(ref, chunks[cut:]), (prompt, out)
        assert det.text == ref.text and det_child.text == ref_child.text


@pytest.mark.parametrize("skip,spaces", FLAGS)
def test_text_is_one_decode_of_the_output(tok: Any, skip: bool, spaces: bool) -> None:
    """Valid text token by token after a prompt: the stream adds up to the decode of
    prompt + output less the prompt's, and no piece holds half a character."""
    rng = random.Random(7)
    words = ["the", " cat", " café", " naïve", "日本", " 😀", "—", " mat.", " hello"]
    specials = [t for t in tok.added_tokens_decoder if t in tok.all_special_ids]
    for case in range(20):
        prompt = tok.encode("".join(rng.choice(words) for _ in range(3)),
                            add_special_tokens=False)
        out: list[int] = []
        for _ in range(rng.randint(1, 8)):
            if specials and rng.random() < 0.2:
                out.append(rng.choice(specials))
            out += tok.encode(rng.choice(words), add_special_tokens=False)
        det = IncrementalDetokenizer(tok, prompt, skip, spaces)
        pieces = _run(det, [[t] for t in out])
        full = reference_decode(tok, prompt + out, skip, spaces)
        head = reference_decode(tok, prompt, skip, spaces)
        if not full.startswith(head) or (out and out[0] in specials):
            # The prompt's text changes with what follows it (a leading-space rule or a
            # joining space): then only the scheme's own stream is defined.
            continue
        assert "".join(pieces) == det.text == full[len(head):], (prompt, out)
        assert all("\ufffd" not in p for p in pieces)


def test_fast_tokenizer_steps_in_rust_and_an_override_is_honoured(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain fast tokenizer's single-token steps go through the stream (no Python
    decode per token); a tokenizer whose decode is overridden is decoded by it."""
    tok = make_byte_tokenizer(tmp_path)
    ids = tok.encode("the cat sat on the mat")
    calls = []
    real = type(tok).decode
    det = IncrementalDetokenizer(tok, ids[:2])
    monkeypatch.setattr(type(tok), "decode", lambda self, *a, **k: calls.append(1) or
                        real(self, *a, **k))
    # The class changed after the detokenizer read it: it still takes the backend's path.
    pieces = [det.add_tokens([t]) for t in ids[2:]]
    assert det._stream is not None and not calls
    assert "".join(pieces) == tok.decode(ids)[len(tok.decode(ids[:2])):]
    # Read now (a new tokenizer object): the override is seen, every decode goes through it.
    tok2 = make_byte_tokenizer(tmp_path / "again")
    det2 = IncrementalDetokenizer(tok2, ids[:2])
    pieces2 = [det2.add_tokens([t]) for t in ids[2:]]
    assert pieces2 == pieces and det2._stream is None and len(calls) >= len(ids) - 2


def test_clean_up_pass_keeps_transformers_decode(tmp_path: Path) -> None:
    """A tokenizer whose decode cleans up spaces (a non-BPE model with
    clean_up_tokenization_spaces) is decoded by transformers, clean-up included; a BPE
    one, where transformers skips the pass, by its backend."""
    from vllm_lite.detokenizer import _plain_backend

    word = make_word_tokenizer(tmp_path / "word")
    assert _plain_backend(word) is not None
    word.clean_up_tokenization_spaces = True
    assert _plain_backend(word) is None
    bpe = make_byte_tokenizer(tmp_path / "bpe")
    bpe.clean_up_tokenization_spaces = True
    assert _plain_backend(bpe) is bpe.backend_tokenizer
