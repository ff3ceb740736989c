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
    """A tokenizer's added vocabulary: id -> text, and which of them are special."""

    text: dict[int, str]
    special: frozenset[int]


# Per tokenizer object, (its length when read, its added tokens): reading the added
# vocabulary costs tens of microseconds for a large one, too much for every decode of
# every step. The length check notices tokens added later.
_ADDED_CACHE: weakref.WeakKeyDictionary[Any, tuple[int, _AddedTokens]] = \
    weakref.WeakKeyDictionary()


def _read_added_tokens(tokenizer: Any) -> _AddedTokens:
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
    return _AddedTokens(text=text, special=special)


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
    added = _read_added_tokens(tokenizer)
    _ADDED_CACHE[tokenizer] = (size, added)
    return added


def decode(tokenizer: Any, token_ids: Sequence[int], skip_special_tokens: bool = True,
           spaces_between_special_tokens: bool = True) -> str:
    """The text of ``token_ids`` as vLLM gives it (see the module's docstring)."""
    ids = list(map(int, token_ids))
    added = _added_tokens(tokenizer)
    if added.text.keys().isdisjoint(ids):  # C-level: twice per sequence and step
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    pieces: list[str] = []
    run: list[int] = []

    def end_run() -> None:
        if run:
            text = tokenizer.decode(run, skip_special_tokens=skip_special_tokens)
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
    window = [int(t) for t in context[-_WINDOW:]]
    prefix = decode(tokenizer, window, skip_special_tokens, spaces_between_special_tokens)
    texts = []
    for tid in token_ids:
        full = decode(tokenizer, window + [int(tid)], skip_special_tokens,
                      spaces_between_special_tokens)
        texts.append(full[len(prefix):] if full.startswith(prefix)
                     else decode(tokenizer, [tid], skip_special_tokens,
                                 spaces_between_special_tokens))
    return texts


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.tokens: list[int] = list(prompt_token_ids)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _WINDOW, 0)
        self.text = ""

    @classmethod
    def for_params(cls, tokenizer: Any, prompt_token_ids: Sequence[int],
                   params: Any) -> IncrementalDetokenizer:
        """A detokenizer with a request's SamplingParams' text options."""
        return cls(tokenizer, prompt_token_ids, params.skip_special_tokens,
                   params.spaces_between_special_tokens)

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy that continues from this one's state (a forked sequence)."""
        child = copy.copy(self)
        # Only the tokens from prefix_offset on are ever decoded again: the copy keeps
        # those, so forking costs the same however long the sequence is.
        child.tokens = self.tokens[self.prefix_offset:]
        child.read_offset = self.read_offset - self.prefix_offset
        child.prefix_offset = 0
        return child

    def _decode(self, ids: Sequence[int]) -> str:
        return decode(self.tokenizer, ids, self.skip_special_tokens,
                      self.spaces_between_special_tokens)

    def add_tokens(self, new_token_ids: Sequence[int]) -> str:
        """Appends the tokens; returns the text they complete (possibly "")."""
        self.tokens.extend(new_token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(_REPLACEMENT):
            new_text = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            self.text += new_text
            return new_text
        return ""

    def flush(self) -> str:
        """The held-back text (an incomplete character shows as U+FFFD), at the end."""
        if self.read_offset == len(self.tokens):
            return ""
        prefix_text = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset:])
        new_text = full_text[len(prefix_text):] if full_text.startswith(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.tokens)
        self.text += new_text
        return new_text
