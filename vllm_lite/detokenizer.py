"""Incremental detokenization that never emits half of a multi-byte character.

Per sequence, the text is extended by decoding a short window of tokens (vLLM's
prefix_offset / read_offset scheme): the new text is decode(window + new tokens) minus
decode(window). Text ending in U+FFFD (an incomplete UTF-8 sequence so far) is held back
until the following tokens complete it; ``flush`` emits what is left when the sequence ends.
"""

from __future__ import annotations

from typing import Any, List, Sequence

# Tokens of context decoded before the new ones, so a tokenizer that drops or adds a
# leading space at the start of a decode (SentencePiece) gets the spacing right.
_WINDOW = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: List[int] = list(prompt_token_ids)
        self.read_offset = len(self.tokens)
        self.prefix_offset = max(self.read_offset - _WINDOW, 0)
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

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
