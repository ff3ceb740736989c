"""What the sampler needs to know about each row of logits it samples from this step.

The engine builds one SamplingMetadata per step, one SamplingRow per row of the logits
tensor (one row per running sequence that samples this step, in the same order).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from collections.abc import Iterable, Sequence as Seq

from vllm_lite.sampling_params import SamplingParams, SamplingType
from vllm_lite.errors import InternalError


class GeneratorHolder:
    """The generator slot of a row built without a request (a request of its own)."""

    __slots__ = ("generator",)

    def __init__(self) -> None:
        self.generator: Any = None


# Identity equality: a row is one sequence's live sampling state, never compared by value
# (and the runner's ``None in rows`` stays a C-level scan).
@dataclass(slots=True, eq=False)
class SamplingRow:
    """One row of logits: the sequence it belongs to and how to sample it.

    seq_id: the sequence sampled (several rows of one request after an n/best_of fork).
    request_id: the request's id (beam rows of one request are ranked together).
    request: what holds a seeded request's torch.Generator (its ``generator`` attribute:
        the request's SequenceGroup in the engine; by default a holder of the row's own),
        so forked sequences of one request draw from one generator, in row order, as in
        vLLM, and the generator goes when the request does.
    prompt_token_ids / output_token_ids: the tokens so far, for the penalties and min_tokens.
    eos_token_id: masked with stop_token_ids while fewer than min_tokens were generated
        (not when params.ignore_eos).
    num_samples: tokens drawn from this row (best_of at a random request's first step,
        multinomial with replacement as vLLM does); 1 otherwise. Greedy rows take 1.
    Beam-search rows of one request (in row order, consecutive) are ranked together.
    """

    seq_id: int
    request_id: str
    params: SamplingParams
    prompt_token_ids: Seq[int]
    output_token_ids: Seq[int] = field(default_factory=list)
    eos_token_id: int | None = None
    num_samples: int = 1
    # The sequence's cumulative logprob so far (beam search ranks extensions by it).
    cumulative_logprob: float = 0.0
    request: Any = field(default_factory=GeneratorHolder, compare=False, repr=False)
    # What the sampler derives from params, eos_token_id and num_samples (its plan of the
    # row, vllm_lite.layers.sampler.row_plans), made at the row's first step and kept for
    # a row the runner reuses across steps, with the params object it was made from (a
    # row given other params gets a new plan; eos_token_id and num_samples are fixed for
    # a row's life: the runner makes a new row where they change).
    sampler_plan: Any = field(default=None, init=False, compare=False, repr=False)
    sampler_plan_params: Any = field(default=None, init=False, compare=False, repr=False)

    @classmethod
    def for_seq(cls, group: Any, seq: Any, first_step_draws: bool = True) -> SamplingRow:
        """The row of one sequence of a vllm_lite.sequence.SequenceGroup: best_of draws at
        a random request's first sample (with first_step_draws), one otherwise."""
        params = group.sampling_params
        first = (
            first_step_draws
            and group.awaiting_first_sample()
            and params.sampling_type in (SamplingType.RANDOM, SamplingType.RANDOM_SEED)
        )
        return cls(
            seq_id=seq.seq_id,
            request_id=group.request_id,
            params=params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            eos_token_id=group.eos_token_id,
            num_samples=params.best_of if first else 1,
            cumulative_logprob=seq.cumulative_logprob,
            request=group,
        )

    def __post_init__(self) -> None:
        if isinstance(self.num_samples, bool) or not isinstance(self.num_samples, int):
            raise InternalError(f"num_samples must be an int, got {self.num_samples!r}")
        if self.num_samples < 1:
            raise InternalError(f"num_samples must be at least 1, got {self.num_samples}")
        if self.num_samples > 1 and self.params.sampling_type in (
            SamplingType.GREEDY,
            SamplingType.BEAM,
        ):
            raise InternalError(
                f"num_samples > 1 needs random sampling, got {self.params.sampling_type.name} "
                f"for seq {self.seq_id}"
            )

    @property
    def sampling_type(self) -> SamplingType:
        return self.params.sampling_type


@dataclass
class SamplingMetadata:
    """The rows sampled this step, in logits-row order."""

    rows: list[SamplingRow]

    def __len__(self) -> int:
        return len(self.rows)

    @classmethod
    def from_seq_groups(cls, seq_groups: Iterable, num_samples_first_step: bool = True) -> SamplingMetadata:
        """One row per unfinished sequence of each vllm_lite.sequence.SequenceGroup, in order.

        With num_samples_first_step, a random-sampling group awaiting its first sample
        (one sequence, no output) gets num_samples = best_of, the engine forking the
        children from the tokens drawn.
        """
        return cls([
            SamplingRow.for_seq(group, seq, num_samples_first_step)
            for group in seq_groups
            for seq in group.get_unfinished_seqs()
        ])
