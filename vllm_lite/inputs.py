"""Prompt admission steps shared by ``LLM`` and the OpenAI server, so that both apply a
request's prompt options the same way before the prompt's length is checked."""

from __future__ import annotations

from typing import Any
from collections.abc import Sequence

from vllm_lite.detokenizer import decode


def truncate_prompt(prompt: str | None, token_ids: Sequence[int],
                    truncate_prompt_tokens: int | None, tokenizer: Any = None,
                    spaces_between_special_tokens: bool = True
                    ) -> tuple[str | None, list[int]]:
    """(prompt text, prompt ids) after SamplingParams.truncate_prompt_tokens: with k set,
    only the last k prompt tokens are kept (left truncation, as vLLM; a BOS token at the
    start is cut like any other). Callers apply it before the max_model_len check, as
    vLLM does, so a long prompt truncated to fit is admitted.

    When tokens were cut from a text prompt, the text becomes the kept tokens' text (what
    the model sees, so an echo or ``RequestOutput.prompt`` matches ``prompt_token_ids``;
    special tokens kept, joined as ``spaces_between_special_tokens`` says), or None
    without a tokenizer. A prompt already within k tokens comes back unchanged. k is
    checked by SamplingParams and the request model, and here too (an int >= 1, else a
    ValueError naming it): ids[-0:] would keep all.
    """
    ids = list(token_ids)
    k = truncate_prompt_tokens
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
        raise ValueError(f"truncate_prompt_tokens must be an int >= 1, got {k!r}")
    if k is None or len(ids) <= k:
        return prompt, ids
    kept = ids[-k:]
    if prompt is None or tokenizer is None:
        return None, kept
    return decode(tokenizer, kept, skip_special_tokens=False,
                  spaces_between_special_tokens=spaces_between_special_tokens), kept
