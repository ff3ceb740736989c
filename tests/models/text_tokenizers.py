"""Tokenizers with added and special tokens for the text-option tests
(spaces_between_special_tokens, skip_special_tokens, truncate_prompt_tokens), and an
independent reference for vLLM's decoding rule."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Sequence

# The test checkpoints' vocabulary: every id a model can sample has a token.
VOCAB = 320
NUM_WORDS = 280  # "<eos>" = 0, "<unk>" = 1, then words w2 .. w279
# Added tokens fill the rest of the vocabulary: plain ones (ids 280..299), then special
# ones (ids 300..319, dropped by skip_special_tokens).
PLAIN_ADDED = [f"<p{i}>" for i in range(20)]
SPECIAL_ADDED = [f"<s{i}>" for i in range(20)]
NUM_SPECIAL = NUM_WORDS + len(PLAIN_ADDED)  # the first special added token's id


def make_word_tokenizer(folder: Path) -> Any:
    """A word-level HF fast tokenizer (no decoder: tokens decode joined by one space), with
    added plain and special tokens filling ids up to VOCAB and a chat template. Every token
    sequence decodes to valid text, so a randomly sampled output has a well-defined text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1}
    vocab.update({f"w{i}": i for i in range(2, NUM_WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.add_tokens(PLAIN_ADDED)
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_ADDED})
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(folder)
    return fast


def make_byte_tokenizer(folder: Path) -> Any:
    """tests/models/helpers.make_tokenizer's byte-level BPE plus one plain added token
    ("<tool>") and one special one ("<|sep|>")."""
    from models.helpers import make_tokenizer

    tok = make_tokenizer(folder)
    tok.add_tokens(["<tool>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|sep|>"]})
    tok.save_pretrained(folder)
    return tok


def reference_decode(tokenizer: Any, ids: Sequence[int], skip_special_tokens: bool,
                     spaces_between_special_tokens: bool) -> str:
    """vLLM 0.6's rule, written from its description on token strings (not ids): walk the
    tokens; drop special ones when skipping; an added-vocabulary token is a piece of its
    own, the tokens between them are joined by convert_tokens_to_string; pieces are
    joined by " " or "", empty pieces left out."""
    added = tokenizer.get_added_vocab()
    special = set(tokenizer.all_special_tokens)
    pieces: list[str] = []
    current: list[str] = []
    for token in tokenizer.convert_ids_to_tokens(list(ids)):
        if skip_special_tokens and token in special:
            continue
        if token in added:
            if current:
                pieces.append(tokenizer.convert_tokens_to_string(current))
                current = []
            pieces.append(token)
        else:
            current.append(token)
    if current:
        pieces.append(tokenizer.convert_tokens_to_string(current))
    return (" " if spaces_between_special_tokens else "").join(p for p in pieces if p)
