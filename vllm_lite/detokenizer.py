"""Turning token ids into text: one-shot ``decode`` and incremental detokenization that
never emits half of a multi-byte character.

``decode`` is vLLM's text for a token sequence. Added tokens (the tokenizer's added
vocabulary: special tokens such as ``<eos>`` and user-added ones such as ``<tool>``) are
pieces of their own; the ordinary tokens between them are decoded run by run; the pieces
are joined with a space when ``spaces_between_special_tokens`` is True (vLLM's default) and
with nothing when False. With ``skip_special_tokens`` the special tokens are dropped first
(their neighbours then join one run). A sequence without added tokens decodes exactly as
``tokenizer.decode`` does. This is vLLM 0.6's ``_convert_tokens_to_string_with_added_encoders``
(the transformers 4 slow-tokenizer rule); vLLM applied it to slow tokenizers only, and
transformers 5 ignores the option, so here it holds for every tokenizer: the option means
the same whatever the tokenizer's kind.

Incrementally, per sequence, the text is extended by decoding a short window of tokens
(vLLM's prefix_offset / read_offset scheme): the new text is decode(window + new tokens)
minus decode(window). Text ending in U+FFFD (an incomplete UTF-8 sequence so far) is held
back until the following tokens complete it; ``flush`` emits what is left when the sequence
ends.

Speed: a transformers fast tokenizer whose ``decode`` is its Rust backend's (no subclass
override, no clean-up pass) is decoded through the backend directly, without transformers'
Python wrapper. While the window holds no added token, one new token at a time is stepped
through the backend's ``DecodeStream``, which runs the same window scheme in Rust (the
text it emits is the text the scheme emits: only a step that emits is taken from it; a
step that holds text back or raises is redone by the scheme here, and the stream is made
again once nothing is held back). A sequence thus costs one Rust call per token instead
of two Python decodes.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any
from collections.abc import Sequence

# Tokens of context decoded before the new ones, so a tokenizer that drops or adds a
# leading space at the start of a decode (SentencePiece) gets the spacing right.
_WINDOW = 5
# The context tokens token_texts_after reads (the rest may be left out).
TEXT_CONTEXT = _WINDOW
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class _AddedTokens:
    """A tokenizer's added vocabulary: id -> text, and which of them are special; and its
    Rust backend when ``tokenizer.decode`` is exactly the backend's decode (else None)."""

    text: dict[int, str]
    special: frozenset[int]
    backend: Any = None
    # The tokenizer's length when read (-1: it has none); ids from it on are new.
    size: int = -1


# Per tokenizer object, (its length when read, its added tokens): reading the added
# vocabulary costs tens of microseconds for a large one, too much for every decode of
# every step. The length check notices tokens added later.
_ADDED_CACHE: weakref.WeakKeyDictionary[Any, tuple[int, _AddedTokens]] = \
    weakref.WeakKeyDictionary()


def _plain_backend(tokenizer: Any) -> Any:
    """The Rust tokenizer whose ``decode(ids, skip_special_tokens)`` returns what
    ``tokenizer.decode(ids, skip_special_tokens=...)`` does, or None: a transformers fast
    tokenizer that overrides neither ``decode`` nor ``_decode`` (on its class or the
    object) and has no clean-up pass (transformers skips the pass for a BPE model)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, TokenizersBackend)
            or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode
            or "decode" in vars(tokenizer) or "_decode" in vars(tokenizer)):
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or not callable(getattr(backend, "decode", None)):
        return None
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        model = getattr(backend, "model", None)
        if type(model).__name__ != "BPE" or getattr(
                tokenizer,
                "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output",
                False):
            return None
    return backend


def _read_added_tokens(tokenizer: Any, size: int = -1) -> _AddedTokens:
    text: dict[int, str] = {}
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if decoder:
        for tid, tok in decoder.items():
            text[int(tid)] = str(getattr(tok, "content", tok))
    else:
        get_added = getattr(tokenizer, "get_added_vocab", None)
        for content, tid in (get_added() if get_added is not None else {}).items():
            text[int(tid)] = content
    special = frozenset(int(t) for t in (getattr(tokenizer, "all_special_ids", None) or ()))
    return _AddedTokens(text=text, special=special, backend=_plain_backend(tokenizer),
                        size=size)


def _added_tokens(tokenizer: Any) -> _AddedTokens:
    try:
        size = len(tokenizer)
    except TypeError:  # a tokenizer-like object without a length: read it each time
        return _read_added_tokens(tokenizer)
    try:
        cached = _ADDED_CACHE.get(tokenizer)
    except TypeError:  # not weak-referenceable / hashable
        return _read_added_tokens(tokenizer)
    if cached is not None and cached[0] == size:
        return cached[1]
    added = _read_added_tokens(tokenizer, size)
    _ADDED_CACHE[tokenizer] = (size, added)
    return added


def decode(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` as vLLM gives it (see the module's docstring)."""
    return _decode(tokenizer, _added_tokens(tokenizer), list(map(int, token_ids)),
                   skip_special_tokens, spaces_between_special_tokens)


def _decode(tokenizer: Any, added: _AddedTokens, ids: list[int], skip_special_tokens: bool,
            spaces_between_special_tokens: bool) -> str:
    """decode() of a list of ints, with the tokenizer's added tokens already read."""
    backend = added.backend
    if added.text.keys().isdisjoint(ids):  # C-level: twice per sequence and step
        if backend is not None:
            return backend.decode(ids, skip_special_tokens)
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    pieces: list[str] = []
    run: list[int] = []

    def end_run() -> None:
        if run:
            text = (backend.decode(run, skip_special_tokens) if backend is not None else
                    tokenizer.decode(run, skip_special_tokens=skip_special_tokens))
            # A run that decodes to nothing (special tokens of the base vocabulary that
            # the tokenizer skips) is no piece: it would only add a doubled space.
            if text:
                pieces.append(text)
            run.clear()

    for t in ids:
        if t in added.text:
            if skip_special_tokens and t in added.special:
                continue  # dropped; the runs on both sides join
            end_run()
            pieces.append(added.text[t])
        else:
            run.append(t)
    end_run()
    return (" " if spaces_between_special_tokens else "").join(pieces)


def token_texts_after(tokenizer: Any, context: Sequence[int], token_ids: Sequence[int],
                      skip_special_tokens: bool = True,
                      spaces_between_special_tokens: bool = True) -> list[str]:
    """For each of ``token_ids``: the text it adds after ``context`` (the tokens before it;
    only the last TEXT_CONTEXT are decoded, for the spacing), e.g. a logprob's
    ``decoded_token``.
    When the context's text is not a prefix of the extended text (a tokenizer that
    rewrites across the boundary), the token's own text."""
    added = _added_tokens(tokenizer)
    window = [int(t) for t in context[-_WINDOW:]]
    prefix = _decode(tokenizer, added, window, skip_special_tokens,
                     spaces_between_special_tokens)
    texts = []
    for tid in token_ids:
        tid = int(tid)
        full = _decode(tokenizer, added, window + [tid], skip_special_tokens,
                       spaces_between_special_tokens)
        texts.append(full[len(prefix):] if full.startswith(prefix)
                     else _decode(tokenizer, added, [tid], skip_special_tokens,
                                  spaces_between_special_tokens))
    return texts


def _decode_stream_class() -> Any:
    """tokenizers' DecodeStream if it takes a starting window (``ids``), else None."""
    try:
        from tokenizers.decoders import DecodeStream
        DecodeStream(ids=[], skip_special_tokens=False)
    except Exception:  # noqa: BLE001  (absent or too old: the scheme runs here)
        return None
    return DecodeStream


_DECODE_STREAM = _decode_stream_class()


class IncrementalDetokenizer:
    """One sequence's text, extended token by token (see the module's docstring).

    ``tokens`` is the window: the tokens from vLLM's prefix_offset on (the ones before it
    are never decoded again, so nothing here grows with the sequence), ``read_offset``
    the end of the window's already-emitted part within it."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.tokens: list[int] = [int(t) for t in prompt_token_ids[-_WINDOW:]]
        self.read_offset = len(self.tokens)
        self.text = ""
        # The backend's DecodeStream in step with the window, or None.
        self._stream: Any = None
        # The added tokens as last read: a one-token step re-reads them only for an id
        # the tokenizer did not have then (a token added since gets a new id).
        self._added = _added_tokens(tokenizer)

    @classmethod
    def for_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int],
                   params: Any) -> IncrementalDetokenizer:
        """A detokenizer with a request's SamplingParams' text options."""
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens,
                   params.spaces_between_special_tokens)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy that continues from this one's state (a forked sequence).
        A stream cannot be copied: the copy makes its own when it next can."""
        child = copy.copy(self)
        child.tokens = list(self.tokens)
        child._stream = None
        return child

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Appends the tokens; returns the text they complete (possibly "")."""
        if len(new_token_ids) == 1:
            added = self._added
            token = int(new_token_ids[0])
            if (added.backend is not None and 0 <= token < added.size
                    and token not in added.text
                    and (self._stream is not None or self._start_stream(added))):
                try:
                    new_text = self._stream.step(added.backend, token)
                except Exception:  # noqa: BLE001  (redone below, where it raises or not)
                    new_text = None
                if new_text is not None:
                    # The scheme's emitting step: the window moves to the new tokens.
                    tokens = self.tokens
                    del tokens[:self.read_offset]
                    tokens.append(token)
                    self.read_offset = len(tokens)
                    self.text += new_text
                    return new_text
        # A step the stream does not take (held-back text, an added token, a rewritten
        # prefix, several tokens): the scheme here; the stream no longer matches.
        self._stream = None
        self.tokens.extend(map(int, new_token_ids))
        added = self._added = _added_tokens(self.tokenizer)
        return self._emit(added, flush=False)

    def _start_stream(self, added: _AddedTokens) -> bool:
        """Makes a DecodeStream equal to the window, where one can be: nothing held back,
        no added token in the window, and a prefix text that the stream takes as is (it
        sets aside a prefix ending in an incomplete character)."""
        tokens = self.tokens
        if (_DECODE_STREAM is None or self.read_offset != len(tokens)
                or not added.text.keys().isdisjoint(tokens)):
            return False
        if added.backend.decode(tokens, self.skip_special_tokens).endswith(_REPLACEMENT):
            return False
        self._stream = _DECODE_STREAM(ids=list(tokens),
                                      skip_special_tokens=self.skip_special_tokens)
        return True

    def _emit(self, added: _AddedTokens, flush: bool) -> str:
        tokens = self.tokens
        prefix_text = _decode(self.tokenizer, added, tokens[:self.read_offset],
                              self.skip_special_tokens, self.spaces_between_special_tokens)
        full_text = _decode(self.tokenizer, added, tokens, self.skip_special_tokens,
                            self.spaces_between_special_tokens)
        if flush:
            new_text = full_text[len(prefix_text):] if full_text.startswith(prefix_text) \
                else ""
            tokens.clear()
        elif len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            new_text = full_text[len(prefix_text):]
            del tokens[:self.read_offset]
        else:
            return ""
        self.read_offset = len(tokens)
        self.text += new_text
        return new_text

    def flush(self) -> str:
        """The held-back text (an incomplete character shows as U+FFFD), at the end."""
        if self.read_offset == len(self.tokens):
            return ""
        self._stream = None
        added = self._added = _added_tokens(self.tokenizer)
        return self._emit(added, flush=True)
