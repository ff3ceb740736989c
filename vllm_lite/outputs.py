"""What LLM.generate returns: vLLM's RequestOutput and CompletionOutput."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from vllm_lite.core.beam_search import beam_score
from vllm_lite.sequence import SequenceGroup, SequenceStatus


class CompletionOutput:
    """One completion of a request.

    index: the completion's index among the request's sequences. text / token_ids: the
    generated text and tokens (an EOS token stays in token_ids, as in vLLM).
    cumulative_logprob: sum of the sampled tokens' logprobs. logprobs: when the request
    asked for them, one {token_id: Logprob} dict per generated token. finish_reason:
    "stop", "length", "abort" or None while running; stop_reason: the stop string or stop
    token id that ended it (None for EOS or length).

    The engine builds one per request per step (CUMULATIVE outputs): it hands over the
    sequence's own token and logprob lists, which only ever grow, with their lengths at
    this step, and ``token_ids`` / ``logprobs`` copy that prefix out on first read. A step
    thus costs the same whatever the sequence's length, and a reader sees a list of its
    own, fixed at the step that made the output.
    """

    __slots__ = ("index", "text", "cumulative_logprob", "finish_reason", "stop_reason",
                 "_token_ids", "_num_tokens", "_logprobs", "_num_logprobs")

    def __init__(self, index: int, text: str, token_ids: list[int],
                 cumulative_logprob: float | None, logprobs: list[dict[int, Any]] | None,
                 finish_reason: str | None = None, stop_reason: int | str | None = None
                 ) -> None:
        self.index = index
        self.text = text
        self.cumulative_logprob = cumulative_logprob
        self.finish_reason = finish_reason
        self.stop_reason = stop_reason
        # A length of -1: the list is the output's own (no prefix to copy out).
        self._token_ids, self._num_tokens = token_ids, -1
        self._logprobs, self._num_logprobs = logprobs, -1

    @classmethod
    def of_live(cls, index: int, text: str, token_ids: list[int],
                cumulative_logprob: float | None, logprobs: list[dict[int, Any]] | None,
                finish_reason: str | None, stop_reason: int | str | None
                ) -> CompletionOutput:
        """The output of a sequence whose ``token_ids`` and ``logprobs`` lists the engine
        keeps appending to: it shows their items as of now, copied out only when read."""
        out = cls.__new__(cls)
        out.index = index
        out.text = text
        out.cumulative_logprob = cumulative_logprob
        out.finish_reason = finish_reason
        out.stop_reason = stop_reason
        out._token_ids, out._num_tokens = token_ids, len(token_ids)
        out._logprobs = logprobs
        out._num_logprobs = -1 if logprobs is None else len(logprobs)
        return out

    @property
    def token_ids(self) -> list[int]:
        if self._num_tokens >= 0:
            self._token_ids, self._num_tokens = self._token_ids[:self._num_tokens], -1
        return self._token_ids

    @token_ids.setter
    def token_ids(self, value: list[int]) -> None:
        self._token_ids, self._num_tokens = value, -1

    @property
    def logprobs(self) -> list[dict[int, Any]] | None:
        if self._num_logprobs >= 0:
            self._logprobs, self._num_logprobs = self._logprobs[:self._num_logprobs], -1
        return self._logprobs

    @logprobs.setter
    def logprobs(self, value: list[dict[int, Any]] | None) -> None:
        self._logprobs, self._num_logprobs = value, -1

    def token_ids_from(self, start: int) -> list[int]:
        """``token_ids[start:]`` without copying out the part before ``start`` (a stream
        sends only what is new)."""
        if self._num_tokens >= 0:
            return self._token_ids[start:self._num_tokens]
        return self._token_ids[start:]

    def finished(self) -> bool:
        return self.finish_reason is not None

    def _fields(self) -> tuple[Any, ...]:
        return (self.index, self.text, self.token_ids, self.cumulative_logprob,
                self.logprobs, self.finish_reason, self.stop_reason)

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._fields() == other._fields()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]  # mutable, as the dataclass it replaces

    def __repr__(self) -> str:
        return ("CompletionOutput(index={!r}, text={!r}, token_ids={!r}, "
                "cumulative_logprob={!r}, logprobs={!r}, finish_reason={!r}, "
                "stop_reason={!r})".format(*self._fields()))

    def __getstate__(self) -> tuple[Any, ...]:
        return self._fields()  # the prefix only, never the live lists

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        self.__init__(*state)  # type: ignore[misc]


_RUNNING = SequenceStatus.RUNNING


# Slotted: one is built per request per step.
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


def request_outputs(groups: Iterable[SequenceGroup]) -> list[RequestOutput]:
    """request_output of each group, in order: the step's outputs in one pass (a streaming
    batch gets one per request per step, so the usual one-sequence request's is built
    here inline, at a cost that does not grow with its length)."""
    outs = []
    append = outs.append
    running = _RUNNING
    new_completion = CompletionOutput.__new__
    for group in groups:
        seqs_dict = group.seqs_dict
        params = group.sampling_params
        if len(seqs_dict) != 1 or params.n != 1:
            append(_forked_output(group))
            continue
        # One sequence (no fork, no beams): CompletionOutput.of_live, inline.
        (seq,) = seqs_dict.values()
        state = seq.output
        det = state.detokenizer
        status = seq.status
        c = new_completion(CompletionOutput)
        c.index = 0
        c.text = det.text if det is not None else ""
        c.cumulative_logprob = seq.cumulative_logprob
        c.finish_reason = reason = (None if status is running
                                    else SequenceStatus.get_finished_reason(status))
        c.stop_reason = seq.stop_reason
        c._token_ids = ids = seq.output_token_ids
        c._num_tokens = len(ids)
        if params.logprobs is None:
            c._logprobs, c._num_logprobs = None, -1
        else:
            c._logprobs = lps = state.logprobs
            c._num_logprobs = len(lps)
        plp = group.prompt_logprobs
        append(RequestOutput(
            group.request_id, group.prompt, group.prompt_token_ids_for_output(), [c],
            reason is not None, group.prompt_logprobs_for_output() if plp is not None else None,
            group.error))
    return outs


def request_output(group: SequenceGroup) -> RequestOutput:
    """A request's output as it stands: its completions (at most n; beams best first,
    others by cumulative logprob when best_of > n), with their text and logprobs. Its cost
    does not grow with the request's length (a streaming request gets one every step)."""
    return request_outputs((group,))[0]


def _forked_output(group: SequenceGroup) -> RequestOutput:
    """request_output of a request of several sequences (n / best_of forks, beams)."""
    params = group.sampling_params
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
        CompletionOutput.of_live(
            index, seq.output.text, seq.output_token_ids, seq.cumulative_logprob,
            seq.output.logprobs if params.logprobs is not None else None,
            SequenceStatus.get_finished_reason(seq.status), seq.stop_reason)
        for index, seq in zip(indices, chosen)
    ]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids_for_output(),
        outputs=completions,
        finished=group.is_finished(),
        prompt_logprobs=(group.prompt_logprobs_for_output()
                         if group.prompt_logprobs is not None else None),
        error=group.error,
    )
