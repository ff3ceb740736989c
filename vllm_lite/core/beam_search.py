"""The beam-search policy of one step: which candidates live on, which end as hypotheses.

Pure Python over plain numbers; the scheduler applies the decision to sequences and
blocks. It follows vLLM 0.6's flow (2 * beam_width candidates over all live beams; the best
beam_width unfinished ones continue; finished ones compete with the hypotheses kept so far
by length-penalised score; early_stopping True / False / "never"), with two details taken
from HF transformers' beam search, whose outputs vLLM's own tests compare against:

- a hypothesis' score is cumulative_logprob / (generated_len ** length_penalty), where
  generated_len counts the output tokens, EOS included (vLLM 0.6 divides by prompt + output
  length less EOS, which ranks hypotheses differently whenever length_penalty != 0);
- only a candidate ranked within the best beam_width may end as a hypothesis; one further
  down (kept only so that beam_width beams can continue) is dropped, as in HF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Sequence as Seq

from vllm_lite.sampling_params import SamplingParams


@dataclass(frozen=True)
class BeamCandidate:
    """One extension of a live beam: its parent sequence, the token and the token's logprob.
    A step's candidates come best first (by parent cumulative logprob + logprob).
    top_logprobs: when the request asks for logprobs, the token's entry (the token and the
    parent row's top tokens -> Logprob), as a sampled token's."""

    parent_seq_id: int
    token_id: int
    logprob: float
    top_logprobs: dict[int, Any] | None = field(default=None, compare=False, hash=False)


@dataclass(frozen=True)
class ScoredCandidate:
    """A candidate with what the policy needs: the extended beam's cumulative logprob and
    output length, and its finish (a finished status and stop reason) or None."""

    candidate: BeamCandidate
    cumulative_logprob: float
    output_len: int
    finish: tuple[Any, int | str | None] | None = None


@dataclass
class Hypothesis:
    """A finished beam kept so far: key identifies it to the caller (a seq id)."""

    key: int
    cumulative_logprob: float
    output_len: int


@dataclass
class BeamDecision:
    """continue_: candidates that run on (at most beam_width, best first); new_hypotheses:
    finished candidates kept as hypotheses; dropped_hypotheses: keys of earlier hypotheses
    pushed out of the best beam_width; done: the beam search is over (nothing continues)."""

    continue_: list[ScoredCandidate] = field(default_factory=list)
    new_hypotheses: list[ScoredCandidate] = field(default_factory=list)
    dropped_hypotheses: list[int] = field(default_factory=list)
    done: bool = False


def beam_score(cumulative_logprob: float, output_len: int, length_penalty: float) -> float:
    """A beam's length-penalised score (see the module docstring for the length).

    Never raises: SamplingParams bounds length_penalty so that the divisor stays in float
    range, but a divisor past it (an extreme penalty or length) gives the score's limit,
    -0.0 for an infinite divisor and -inf for a zero one, the same for every beam.
    """
    cum = float(cumulative_logprob)
    try:
        base = float(max(output_len, 1))
    except OverflowError:  # a length past float range
        base = math.inf
    try:
        divisor = base ** length_penalty
    except OverflowError:  # base > 1 to a large positive power
        divisor = math.inf
    if divisor == 0.0:  # the power underflowed: cum / (a positive tiny) -> -inf
        return cum * math.inf if cum != 0.0 else cum
    return cum / divisor


def select_beams(
    candidates: Seq[ScoredCandidate],
    hypotheses: Seq[Hypothesis],
    params: SamplingParams,
    max_output_len: int,
) -> BeamDecision:
    """Decide one step of a beam group.

    candidates: the step's scored candidates, best first. hypotheses: the finished beams
    kept from earlier steps. max_output_len: the most tokens a beam may generate (for
    early_stopping="never" with a positive length_penalty, as HF's max_length).
    """
    width = params.best_of
    lp = params.length_penalty
    running = [c for c in candidates if c.finish is None]
    finished_new = [c for rank, c in enumerate(candidates) if c.finish is not None and rank < width]

    # The best `width` hypotheses, old ones first among equal scores.
    pool: list[tuple[float, int, Hypothesis | ScoredCandidate]] = []
    for h in hypotheses:
        pool.append((beam_score(h.cumulative_logprob, h.output_len, lp), 0, h))
    for c in finished_new:
        pool.append((beam_score(c.cumulative_logprob, c.output_len, lp), 1, c))
    order = sorted(range(len(pool)), key=lambda i: (-pool[i][0], pool[i][1], i))
    kept = [pool[i] for i in order[:width]]
    decision = BeamDecision()
    decision.new_hypotheses = [item for _, is_new, item in kept if is_new]
    decision.dropped_hypotheses = [item.key for _, is_new, item in (pool[i] for i in order[width:])
                                   if not is_new]

    if not running:
        done = True
    elif len(pool) < width:
        done = False
    elif params.early_stopping is True:
        done = True
    else:
        best = running[0]
        length = best.output_len
        if params.early_stopping == "never" and lp > 0.0:
            # A positive penalty favours longer beams: the best a beam can still reach is
            # bounded by the longest it may grow.
            length = max_output_len
        done = kept[-1][0] >= beam_score(best.cumulative_logprob, length, lp)
    decision.done = done
    if not done:
        decision.continue_ = running[:width]
    return decision
