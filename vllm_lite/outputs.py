"""What LLM.generate returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_lite.core.beam_search import beam_score
from vllm_lite.sequence import SequenceGroup, SequenceStatus


# Slotted: one of each is built per request per step.
@dataclass(slots=True)
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


@dataclass(slots=True)
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


def request_output(group: SequenceGroup) -> RequestOutput:
    """A request's output as it stands: its completions (at most n; beams best first,
    others by cumulative logprob when best_of > n), with their text and logprobs."""
    params = group.sampling_params
    if len(group.seqs_dict) == 1 and params.n == 1:
        # One sequence (no fork, no beams): the request's usual output, built directly.
        (seq,) = group.seqs_dict.values()
        status = seq.status
        return RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids_for_output(),
            [CompletionOutput(
                0, seq.output.text, list(seq.output_token_ids), seq.cumulative_logprob,
                list(seq.output.logprobs) if params.logprobs is not None else None,
                SequenceStatus.get_finished_reason(status), seq.stop_reason)],
            SequenceStatus.is_finished(status),
            list(group.prompt_logprobs) if group.prompt_logprobs is not None else None,
            group.error)
    seqs = group.get_seqs()
    if params.use_beam_search:
        # Best first; the index is the rank.
        lp = params.length_penalty
        chosen = sorted(seqs, key=lambda s: beam_score(s.cumulative_logprob,
                                                       s.get_output_len(), lp),
                        reverse=True)[: params.n]
        indices = list(range(len(chosen)))
    else:
        chosen = seqs
        if len(seqs) > params.n:
            chosen = sorted(seqs, key=lambda s: s.cumulative_logprob, reverse=True)[: params.n]
        indices = [seqs.index(seq) for seq in chosen]
    completions = [
        CompletionOutput(
            index=index,
            text=seq.output.text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob,
            logprobs=list(seq.output.logprobs) if params.logprobs is not None else None,
            finish_reason=SequenceStatus.get_finished_reason(seq.status),
            stop_reason=seq.stop_reason,
        )
        for index, seq in zip(indices, chosen)
    ]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids_for_output(),
        outputs=completions,
        finished=group.is_finished(),
        prompt_logprobs=(list(group.prompt_logprobs)
                         if group.prompt_logprobs is not None else None),
        error=group.error,
    )
