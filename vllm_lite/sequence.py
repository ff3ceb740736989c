"""Sequences and sequence groups: the scheduler's unit of work.

A request becomes a SequenceGroup; it starts with one Sequence holding the prompt and
forks into best_of (or beam-width) sequences at its first sample, the children sharing
the prompt's KV blocks.
"""

from __future__ import annotations

import enum
import itertools
import time
from typing import Any
from collections.abc import Iterable, Sequence as Seq

from vllm_lite.errors import InternalError
from vllm_lite.sampling_params import SamplingParams

# Sequence ids are unique in the process, so block tables keyed by them never collide
# whoever builds the groups (engine, tests, forks inside the scheduler).
_seq_ids = itertools.count()


def next_seq_id() -> int:
    return next(_seq_ids)


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    SWAPPED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    # Could never be scheduled (prompt too long for max_model_len or the whole cache).
    FINISHED_IGNORED = enum.auto()

    @staticmethod
    def is_finished(status: SequenceStatus) -> bool:
        return status in _FINISHED_MEMBERS

    @staticmethod
    def get_finished_reason(status: SequenceStatus) -> str | None:
        if status not in _FINISHED_MEMBERS:
            return None  # running: no dict lookup through the enum's hash
        return _FINISH_REASONS[status]


_FINISHED = frozenset(
    {
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH_CAPPED,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_IGNORED,
    }
)
# The same as a tuple: membership by identity, without the enum's Python-level __hash__
# (asked several times per sequence per step).
_FINISHED_MEMBERS = tuple(_FINISHED)
# vLLM's finish_reason strings; an ignored prompt reports "length" there too.
_FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_IGNORED: "length",
}


class SeqOutputState:
    """A sequence's output as the user sees it: the incremental detokenizer holding its
    text (None until the sequence has text, or when the request does not detokenize) and
    one logprob entry per generated token (when the request asks for logprobs). A fork
    gets its own copy, so a child continues exactly where its parent stood."""

    __slots__ = ("detokenizer", "logprobs")

    def __init__(self, detokenizer: Any = None,
                 logprobs: list[dict[int, Any]] | None = None) -> None:
        self.detokenizer = detokenizer
        self.logprobs: list[dict[int, Any]] = logprobs if logprobs is not None else []

    @property
    def text(self) -> str:
        return self.detokenizer.text if self.detokenizer is not None else ""

    def fork(self) -> SeqOutputState:
        det = self.detokenizer.fork() if self.detokenizer is not None else None
        return SeqOutputState(det, list(self.logprobs))


class Sequence:
    """One token stream (prompt + output) and how much of it the KV cache holds."""

    def __init__(
        self,
        seq_id: int,
        prompt_token_ids: Seq[int],
        cache_salt: bytes | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.prompt_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        # Tokens whose KV is in the cache (prefix-cache hits, earlier chunks, earlier steps).
        self.num_computed_tokens = 0
        self.cumulative_logprob = 0.0
        # Memo of the chained prefix hashes of this sequence's full blocks. Content-derived,
        # so it stays valid across preemption and is copied on fork.
        self.block_hashes: list[bytes] = []
        self.stop_reason: int | str | None = None
        # The sequence this one was forked from (None for a request's first sequence): the
        # engine gives a beam forked this step its parent's logprob history.
        self.parent_seq_id: int | None = None
        # False for a request that wants prompt logprobs: the logits of every prompt
        # position are needed, so its prompt is computed even where the prefix cache has it.
        self.read_prefix_cache = True
        # What the output side keeps of this sequence (its text and logprobs so far); set
        # by the scheduler from the step's updates and carried into forks.
        self.output = SeqOutputState()

    def get_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_output_len(self) -> int:
        return len(self.output_token_ids)

    def get_token_ids(self) -> list[int]:
        """A new list of every token (a copy: not for the per-step path, see token_slice)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, stop: int) -> list[int]:
        """Tokens [start, stop) of prompt + output, copying only those."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_token_ids[start - n:stop - n]
        return prompt[start:] + self.output_token_ids[:stop - n]

    def get_last_token_id(self) -> int:
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def get_num_uncomputed_tokens(self) -> int:
        return self.get_len() - self.num_computed_tokens

    def is_prefill(self) -> bool:
        """True while more than the last token lacks KV (prompt or recompute stage)."""
        return self.get_num_uncomputed_tokens() > 1 or not self.output_token_ids

    def append_token_id(self, token_id: int, logprob: float = 0.0) -> None:
        self.output_token_ids.append(token_id)
        self.cumulative_logprob += logprob

    def is_finished(self) -> bool:
        return self.status in _FINISHED_MEMBERS

    def reset_state_for_recompute(self) -> None:
        """Forget the KV progress; the tokens stay and are recomputed as a prompt."""
        self.num_computed_tokens = 0

    def fork(self, new_seq_id: int) -> Sequence:
        """A copy under a new id: tokens, KV progress, hashes and output state."""
        child = Sequence(new_seq_id, self.prompt_token_ids, self.cache_salt)
        child.output_token_ids = list(self.output_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.cumulative_logprob = self.cumulative_logprob
        child.block_hashes = list(self.block_hashes)
        child.parent_seq_id = self.seq_id
        child.read_prefix_cache = self.read_prefix_cache
        child.output = self.output.fork()
        return child

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id}, status={self.status.name}, "
            f"len={self.get_len()}, computed={self.num_computed_tokens})"
        )


class SequenceGroup:
    """A request in the engine, the one object that holds its state: its sequences (with
    their output state), the prompt text, the prompt logprobs, the seeded sampler's
    random generator, and why it failed. Aborting it in the scheduler forgets all of it."""

    def __init__(
        self,
        request_id: str,
        seqs: Iterable[Sequence],
        sampling_params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        eos_token_id: int | None = None,
        prompt: str | None = None,
    ) -> None:
        self.request_id = request_id
        # The prompt's text as the user gave it (None for a token-id prompt).
        self.prompt = prompt
        self.seqs_dict: dict[int, Sequence] = {seq.seq_id: seq for seq in seqs}
        if not self.seqs_dict:
            raise ValueError("seqs must hold at least one sequence")
        self.sampling_params = sampling_params
        self.plain_seq: Sequence | None = None
        self._find_plain_seq()
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        # Lower value runs first (vLLM's convention).
        self.priority = priority
        self.eos_token_id = eos_token_id
        # Set by the scheduler: arrival order, ties broken by when it was added.
        self.arrival_index = 0
        # Steps spent in the waiting queue since it last entered it (anti-starvation).
        self.waiting_steps = 0
        self.num_preemptions = 0
        # Why the group finished without being served (FINISHED_IGNORED).
        self.error: str | None = None
        # When sampling_params.prompt_logprobs is set: vLLM's PromptLogprobs, filled chunk by
        # chunk as the prompt is computed (None for the first token, then one
        # {token_id: Logprob} dict per prompt token); complete at len(prompt_token_ids).
        self.prompt_logprobs: list[dict[int, Any] | None] | None = None
        # A seeded request's random generator (the sampler creates it at the request's
        # first sampled step; every sequence of the request draws from it, in row order).
        self.generator: Any = None
        # The output processor's screen of the token rules for this request, made once
        # (None until its first plain decode).
        self.stop_limits: Any = None
        self._prompt_copy: list[int] | None = None
        self._prompt_logprobs_copy: list[dict[int, Any] | None] | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return next(iter(self.seqs_dict.values())).prompt_token_ids

    def prompt_token_ids_for_output(self) -> list[int]:
        """A copy of the prompt's ids that every RequestOutput of the request shares: made
        once, not at every step (a caller changing it cannot reach the engine's)."""
        if self._prompt_copy is None:
            self._prompt_copy = list(self.prompt_token_ids)
        return self._prompt_copy

    def prompt_logprobs_for_output(self) -> list[dict[int, Any] | None] | None:
        """prompt_logprobs as a copy that the RequestOutputs share until it grows (a
        chunked prompt adds to it; once the prompt is computed it is made once)."""
        logprobs = self.prompt_logprobs
        if logprobs is None:
            return None
        copy = self._prompt_logprobs_copy
        if copy is None or len(copy) != len(logprobs):
            copy = self._prompt_logprobs_copy = list(logprobs)
        return copy

    def get_seqs(self, status: SequenceStatus | None = None) -> list[Sequence]:
        if status is None:
            return list(self.seqs_dict.values())
        return [seq for seq in self.seqs_dict.values() if seq.status is status]

    def get_unfinished_seqs(self) -> list[Sequence]:
        return [seq for seq in self.seqs_dict.values() if seq.status not in _FINISHED_MEMBERS]

    def num_seqs(self, status: SequenceStatus | None = None) -> int:
        return len(self.get_seqs(status))

    def get_seq(self, seq_id: int) -> Sequence | None:
        return self.seqs_dict.get(seq_id)

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self.seqs_dict:
            raise InternalError(f"seq_id {seq.seq_id} is already in request {self.request_id}")
        self.seqs_dict[seq.seq_id] = seq
        self._find_plain_seq()

    def remove(self, seq_id: int) -> None:
        if seq_id not in self.seqs_dict:
            raise InternalError(f"seq_id {seq_id} is not in request {self.request_id}")
        del self.seqs_dict[seq_id]
        self._find_plain_seq()

    def _find_plain_seq(self) -> None:
        """plain_seq: the request's only sequence when it has one and no beam search
        (what the scheduler's decode lane serves), else None."""
        seqs = self.seqs_dict
        self.plain_seq = (next(iter(seqs.values()))
                          if len(seqs) == 1 and not self.sampling_params.use_beam_search
                          else None)

    def awaiting_first_sample(self) -> bool:
        """No sequence has sampled yet, so best_of children are still to be forked."""
        if len(self.seqs_dict) != 1:
            return False
        for seq in self.seqs_dict.values():
            return not seq.output_token_ids
        return False

    def get_max_num_running_seqs(self) -> int:
        """Sequences this group may run at once: best_of before the fork, else the live ones."""
        if self.awaiting_first_sample():
            return self.sampling_params.best_of
        return len(self.get_unfinished_seqs())

    def is_finished(self) -> bool:
        for seq in self.seqs_dict.values():
            if seq.status not in _FINISHED_MEMBERS:
                return False
        return True

    def __repr__(self) -> str:
        return (
            f"SequenceGroup(request_id={self.request_id!r}, priority={self.priority}, "
            f"seqs={list(self.seqs_dict.values())})"
        )
