"""What LLM.generate returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    """One completion of a request.

    index: the completion's index among the request's sequences. text / token_ids: the
    generated text and tokens (an EOS token stays in token_ids, as in vLLM).
    cumulative_logprob: sum of the sampled tokens' logprobs. logprobs: when the request
    asked for them, one {token_id: Logprob} dict per generated token. finish_reason:
    "stop", "length", "abort" or None while running; stop_reason: the stop string or stop
    token id that ended it (None for EOS or length).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Any]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's state after a step (finished=True once all its completions ended)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # Why the request finished without running (prompt too long for the cache), else None.
    error: str | None = None
