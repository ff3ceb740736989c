"""The sampler: from one step's logits to tokens, with vLLM 0.6's semantics.

Per row, in vLLM 0.6's order (vllm/model_executor/layers/sampler.py):

1. min_tokens: while len(output) < min_tokens, EOS (unless ignore_eos) and stop_token_ids
   get logit -inf.
2. repetition penalty over prompt + output tokens (logit > 0 divided by it, else multiplied),
   then frequency (times the count in the output) and presence (once if in the output)
   penalties, subtracted.
3. temperature (greedy rows, temperature < 1e-5, divide by 1 instead).
4. top_k then top_p (on the top_k-truncated distribution), then min_p (prob < min_p * max
   prob). Ties at a boundary are kept: top_k keeps every token whose logit equals the k-th
   largest (as vLLM does); top_p keeps every token whose logit equals the smallest one the
   nucleus needs, so the kept set never depends on how a sort orders equal logits. At
   least one token is always kept.
5. greedy rows: argmax (lowest id on ties); random rows: a draw from softmax by inverse
   CDF (one uniform per sample; vLLM races Exponential(1) noise over the whole vocabulary,
   which costs half a decode step on the CPU), the uniform of a seeded request coming from
   its own torch.Generator (seeded with params.seed at its first step, kept across steps,
   held by the request), so its tokens do not depend on its batch mates.

Logprobs are the log_softmax of the *processed* logits (after steps 1-4), as vLLM 0.6
returns them: a token cut by top_k/top_p/min_p has logprob -inf (reported as
``LOGPROB_FLOOR``, -9999.0, as vLLM does: JSON has no infinity), and a temperature
changes them. Greedy rows use temperature 1. The sampled tokens' logprobs (always
computed: the engine sums them into cumulative_logprob) come from the same tensor.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Iterable, Sequence as Seq

import torch

from vllm_lite import ops
from vllm_lite.core.beam_search import BeamCandidate
from vllm_lite.layers.sampling_metadata import SamplingMetadata, SamplingRow
from vllm_lite.sampling_params import _SAMPLING_EPS, SamplingParams, SamplingType
from vllm_lite.errors import InternalError

# What a reported logprob of -inf (a token the processors cut) becomes: a finite number
# every JSON encoder accepts, vLLM's value. Only reported Logprob entries are clamped; the
# sampled tokens' logprobs that sum into cumulative_logprob are never -inf.
LOGPROB_FLOOR = -9999.0

__all__ = [
    "LOGPROB_FLOOR",
    "Logprob",
    "SampleOutput",
    "SamplerOutput",
    "Sampler",
    "apply_min_tokens",
    "apply_penalties",
    "apply_temperature",
    "apply_top_k_top_p",
    "first_argmax",
    "inverse_cdf_sample",
    "apply_min_p",
    "beam_search_candidates",
    "compute_prompt_logprobs",
    "top_logprob_dicts",
]


@dataclass
class Logprob:
    """A token's logprob, its rank in its row (1 = most likely) and its text (filled by
    the engine when it detokenizes), as vLLM's Logprob."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class SampleOutput:
    """What one row sampled.

    token_ids: num_samples tokens (1 except at a best_of group's first step).
    logprobs: each sampled token's logprob (processed distribution).
    top_logprobs: when params.logprobs is not None, one dict per sampled token: that token
        and the row's top params.logprobs tokens -> Logprob (vLLM's SampleLogprobs entry).
    """

    seq_id: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[dict[int, Logprob]] | None = None


@dataclass(slots=True)
class PlainSamples:
    """A step in which every row drew one token and asked for no logprob entries, as
    columns (row i: sequence seq_ids[i] sampled token_ids[i], of logprob logprobs[i]),
    copied to the host in one transfer: what the engine's usual decode step reads
    without an object per row."""

    seq_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]


class SamplerOutput:
    """outputs[i] is row i's SampleOutput, None for a beam-search row; beams: per
    beam-search request, the step's 2 * beam_width best extensions over all its rows
    (beam_search_candidates), best first, with their logprob entries when asked for.
    logprobs: [num_rows, vocab] float32 log_softmax of the processed logits; None after the
    plain greedy path (_plain_greedy), which computes only the chosen tokens'.
    plain: the same samples as columns where the step has them (PlainSamples); then
    ``outputs`` is made from them only when read."""

    __slots__ = ("_outputs", "logprobs", "beams", "plain")

    def __init__(self, outputs: list[SampleOutput | None] | None,
                 logprobs: torch.Tensor | None,
                 beams: dict[str, list[BeamCandidate]] | None = None,
                 plain: PlainSamples | None = None) -> None:
        if outputs is None and plain is None:
            raise InternalError("a SamplerOutput needs its outputs or its plain samples")
        self._outputs = outputs
        self.logprobs = logprobs
        self.beams = beams if beams is not None else {}
        self.plain = plain

    @property
    def outputs(self) -> list[SampleOutput | None]:
        if self._outputs is None:
            p = self.plain
            self._outputs = [SampleOutput(sid, [t], [lp], None)
                             for sid, t, lp in zip(p.seq_ids, p.token_ids, p.logprobs)]
        return self._outputs

    def __repr__(self) -> str:
        return (f"SamplerOutput(outputs={self.outputs!r}, beams={self.beams!r}, "
                f"logprobs={None if self.logprobs is None else tuple(self.logprobs.shape)})")


# ----------------------------------------------------------------------------------------
# Logits processors. Each takes float logits [rows, vocab] and returns the processed tensor
# (in place where it can). Vectorised over rows and vocabulary.
# ----------------------------------------------------------------------------------------


def apply_min_tokens(logits: torch.Tensor, banned: Seq[Seq[int]]) -> torch.Tensor:
    """Set logits[i, t] = -inf for every t in banned[i] (ids outside the vocab ignored)."""
    vocab = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, ids in enumerate(banned):
        for t in ids:
            if 0 <= t < vocab:
                rows.append(i)
                cols.append(t)
    if rows:
        r = torch.tensor(rows, dtype=torch.long, device=logits.device)
        c = torch.tensor(cols, dtype=torch.long, device=logits.device)
        logits[r, c] = -float("inf")
    return logits


def _token_table(token_lists: Seq[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Pad token lists into a [rows, max_len] long tensor; padding and ids >= vocab -> vocab."""
    max_len = max((len(t) for t in token_lists), default=0)
    table = torch.full((len(token_lists), max(max_len, 1)), vocab, dtype=torch.long)
    for i, toks in enumerate(token_lists):
        if len(toks):
            table[i, : len(toks)] = torch.as_tensor(list(toks), dtype=torch.long)
    table[(table < 0) | (table > vocab)] = vocab
    return table.to(device)


def _bin_counts(token_lists: Seq[Seq[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] float counts of each token id in each row's list."""
    table = _token_table(token_lists, vocab, device)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, table, torch.ones_like(table, dtype=torch.float32))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    prompt_tokens: Seq[Seq[int]],
    output_tokens: Seq[Seq[int]],
    presence_penalties: torch.Tensor,
    frequency_penalties: torch.Tensor,
    repetition_penalties: torch.Tensor,
) -> torch.Tensor:
    """vLLM's apply_penalties: repetition over prompt+output, then frequency and presence
    over the output. The penalty tensors are [rows] on logits' device. In place.

    Only the ids a row has seen change, so the logits of those ids are gathered,
    penalized and scattered back (an id seen twice is written twice with one value),
    instead of running the penalties over the whole vocabulary, which is slow on the CPU
    where broadcasting element-wise ops are.
    Per id the arithmetic is the whole-vocabulary version's."""
    vocab = logits.shape[1]
    dev = logits.device
    if logits.shape[0] == 0:
        return logits
    seen = _token_table([list(p) + list(o) for p, o in zip(prompt_tokens, output_tokens)],
                        vocab, dev)
    valid = seen < vocab
    # Padding and out-of-range ids (the sentinel `vocab`) become the row's first seen id,
    # a duplicate write of the same value; a row that saw nothing writes its id 0 back
    # unchanged (repetition 1, no counts).
    first = seen.gather(1, valid.to(torch.int8).argmax(dim=1, keepdim=True))
    any_seen = first < vocab
    ids = torch.where(valid, seen, torch.where(any_seen, first, torch.zeros_like(first)))
    output_counts = _bin_counts(output_tokens, vocab, dev).to(logits.dtype).gather(1, ids)
    rep = torch.where(any_seen.squeeze(1), repetition_penalties.to(logits.dtype),
                      torch.ones_like(repetition_penalties, dtype=logits.dtype)).unsqueeze(1)
    x = logits.gather(1, ids)
    x = torch.where(x > 0, x / rep, x * rep)
    x -= frequency_penalties.to(logits.dtype).unsqueeze(1) * output_counts
    x -= presence_penalties.to(logits.dtype).unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits.scatter_(1, ids, x)


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor,
                      in_place: bool = True) -> torch.Tensor:
    """Divide each row by its temperature ([rows]; greedy rows should pass 1); in place
    unless in_place=False."""
    t = temperatures.to(logits.dtype).unsqueeze(1)
    return logits.div_(t) if in_place else torch.div(logits, t)


# The top_k / top_p fast path first looks at this many best tokens per row (torch.topk,
# far cheaper than a full sort of the vocabulary), then at 16x as many for
# the rows whose nucleus may reach past them, up to the max; past that, a full sort.
_TOP_CANDIDATES = 256
_TOP_CANDIDATES_MAX = 4096


def apply_top_k_top_p(
    logits: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor
) -> torch.Tensor:
    """top_k (ks [rows] long; <= 0 or >= vocab disables) then top_p (ps [rows]; >= 1
    disables) on the top_k-truncated distribution; ties at either boundary kept."""
    vocab = logits.shape[1]
    ks = top_ks.to(device=logits.device, dtype=torch.long)
    ks = torch.where((ks <= 0) | (ks > vocab), torch.full_like(ks, vocab), ks)
    ps = top_ps.to(device=logits.device, dtype=logits.dtype)
    ps = torch.where(ps >= 1.0, torch.full_like(ps, float("inf")), ps)
    enabled_k = ks[ks < vocab]
    max_k = int(enabled_k.max()) if enabled_k.numel() else 0
    if not bool(torch.isfinite(ps).any()):
        if not max_k:
            return logits  # top_k past the vocabulary and no top_p: nothing to cut
        return _top_k_top_p(logits, ks, ps, max_k)  # the k best are all it needs
    count = max(_TOP_CANDIDATES, max_k)
    return _top_k_top_p(logits, ks, ps, count)


def _top_k_top_p(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor,
                 count: int) -> torch.Tensor:
    """From each row's `count` best logits; rows whose nucleus may reach past them again
    with 16x as many, then (past _TOP_CANDIDATES_MAX or the vocabulary) a full sort."""
    if count >= logits.shape[1] or count > _TOP_CANDIDATES_MAX:
        return _top_k_top_p_sorted(logits, ks, ps)
    out, need = _top_k_top_p_candidates(logits, ks, ps, count)
    # Rows that need more candidates than the next round takes skip it for the sort.
    for rows, next_count in ((need > count) & (need <= count * 16), count * 16), (
            need > count * 16, logits.shape[1]):
        if bool(rows.any()):
            idx = rows.nonzero().squeeze(1)
            out[idx] = _top_k_top_p(logits[idx], ks[idx], ps[idx], next_count)
    return out


def _top_k_top_p_candidates(logits: torch.Tensor, ks: torch.Tensor, ps: torch.Tensor,
                            count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_top_k_top_p from each row's `count` best logits, and per row [rows] float
    how many candidates it needs at least: `count` where the result is final; more where
    the nucleus may reach past the candidates (that row's result is not valid): the
    missing mass over the last candidate's probability, which no later token exceeds.
    Exact: every logit above the k-th largest is among the candidates, and the
    softmax's sum runs over the whole (top_k-truncated) row; only the order of that sum
    differs from the sorted path's."""
    vocab = logits.shape[1]
    neg_inf = -float("inf")
    vals = logits.topk(count, dim=-1).values  # sorted, best first
    kth = vals.gather(1, (ks.clamp(max=count) - 1).unsqueeze(1))
    kth = torch.where((ks >= vocab).unsqueeze(1), torch.full_like(kth, neg_inf), kth)
    nucleus = torch.isfinite(ps)
    if not bool(nucleus.any()):
        return logits.masked_fill(logits < kth, neg_inf), torch.full_like(ps, float(count))
    top = vals[:, :1]
    e = torch.sub(logits, top).exp_()
    if bool((ks < vocab).any()):
        e = e.masked_fill_(logits < kth, 0.0)
    total = e.sum(dim=-1, keepdim=True)
    probs = torch.sub(vals, top).exp_().div_(total).masked_fill_(vals < kth, 0.0)
    # Keep a token while the probability mass strictly before it is below p.
    cum = probs.cumsum(dim=-1)
    keep = cum - probs < ps.unsqueeze(1)
    keep[:, 0] = True
    threshold = vals.gather(1, keep.sum(dim=-1, keepdim=True) - 1)
    cut = torch.where(nucleus.unsqueeze(1), torch.maximum(threshold, kth), kth)
    open_rows = nucleus & keep[:, -1]
    missing = ((ps - cum[:, -1]) / probs[:, -1]).nan_to_num(nan=float("inf"), posinf=float("inf"))
    need = torch.where(open_rows, count + missing.clamp_min(1.0),
                       torch.full_like(missing, float(count)))
    return logits.masked_fill(logits < cut, neg_inf), need


def _top_k_top_p_sorted(logits: torch.Tensor, ks: torch.Tensor,
                        ps: torch.Tensor) -> torch.Tensor:
    """apply_top_k_top_p over a full sort of every row (ks, ps already normalized)."""
    neg_inf = -float("inf")
    logits_sort, _ = logits.sort(dim=-1, descending=True)
    kth = logits_sort.gather(1, (ks - 1).unsqueeze(1))  # [rows, 1]
    logits = logits.masked_fill(logits < kth, neg_inf)
    logits_sort = logits_sort.masked_fill(logits_sort < kth, neg_inf)

    probs_sort = logits_sort.softmax(dim=-1)
    # Keep a token while the probability mass strictly before it is below p.
    exclusive_cum = probs_sort.cumsum(dim=-1) - probs_sort
    keep = exclusive_cum < ps.unsqueeze(1)
    keep[:, 0] = True
    threshold = logits_sort.masked_fill(~keep, float("inf")).amin(dim=-1, keepdim=True)
    return logits.masked_fill(logits < threshold, neg_inf)


def apply_min_p(logits: torch.Tensor, min_ps: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose prob is below min_p times the row's top prob (min_ps [rows])."""
    probs = logits.softmax(dim=-1)
    top = probs.amax(dim=-1, keepdim=True)
    scaled = min_ps.to(device=logits.device, dtype=probs.dtype).unsqueeze(1) * top
    return logits.masked_fill(probs < scaled, -float("inf"))


def _penalized(params: SamplingParams) -> bool:
    """Whether step 2 (repetition, frequency, presence penalties) changes the row."""
    return (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
            or params.repetition_penalty != 1.0)


def _temperature(params: SamplingParams) -> float:
    return 1.0 if params.temperature < _SAMPLING_EPS else float(params.temperature)


class RowPlan:
    """What the sampler does with a row, derived from its params, eos_token_id and
    num_samples alone: made once per row (row_plans) and shared by every row with the
    same settings, so a step whose rows share one plan (the usual batch: one
    SamplingParams) takes its decisions and its settings' columns from that one object,
    not from a pass over the rows per setting and step. What changes from step to step
    (the output so far: min_tokens, the penalties' counts) is read from the row.

    samples: tokens drawn from the row this step (greedy 1, random num_samples, beam 0:
    beam rows are ranked per request). min_tokens: the output length below which
    ``banned`` gets -inf (0 where nothing would be banned). plain_greedy: a greedy row
    whose logits no processor changes (greedy rows use temperature 1, and greedy
    SamplingParams reset top_k / top_p / min_p; they are checked all the same, as the
    processors would apply them) and that asks for no logprobs beyond its token's, once
    min_tokens is reached."""

    __slots__ = ("greedy", "random", "beam", "seeded", "samples", "temperature", "top_k",
                 "top_p", "min_p", "penalized", "num_logprobs", "min_tokens", "banned",
                 "plain_greedy")

    def __init__(self, key: tuple[Any, ...]) -> None:
        (kind, self.samples, self.temperature, self.top_k, self.top_p, self.min_p,
         self.penalized, self.num_logprobs, self.min_tokens, self.banned) = key
        self.greedy = kind == SamplingType.GREEDY
        self.random = kind in (SamplingType.RANDOM, SamplingType.RANDOM_SEED)
        self.seeded = kind == SamplingType.RANDOM_SEED
        self.beam = kind == SamplingType.BEAM
        self.plain_greedy = (self.greedy and self.num_logprobs is None and not self.penalized
                             and self.top_k <= 0 and self.top_p >= 1.0 and self.min_p <= 0.0)


# Plans by their settings. Bounded: a server's requests may bring any number of distinct
# settings, and clearing only loses the sharing until the plans are made again.
_PLANS: dict[tuple[Any, ...], RowPlan] = {}
_MAX_PLANS = 4096


def _plan_row(row: SamplingRow) -> RowPlan:
    p = row.params
    kind = p.sampling_type
    banned = list(p.stop_token_ids or [])
    if row.eos_token_id is not None and not p.ignore_eos:
        banned.append(row.eos_token_id)
    samples = (1 if kind == SamplingType.GREEDY else 0 if kind == SamplingType.BEAM
               else row.num_samples)
    key = (kind, samples, _temperature(p), p.top_k, p.top_p, p.min_p, _penalized(p),
           p.logprobs, p.min_tokens if banned else 0, tuple(banned))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = RowPlan(key)
    row.sampler_plan, row.sampler_plan_params = plan, p
    return plan


def row_plans(rows: Seq[SamplingRow]) -> list[RowPlan]:
    """Each row's plan: made at its first step, kept on the row while its params object
    stays the same."""
    return [r.sampler_plan if r.sampler_plan_params is r.params else _plan_row(r)
            for r in rows]


def _common_plan(plans: list[RowPlan]) -> RowPlan | None:
    """The plan every row shares, or None (also for no rows)."""
    if plans and plans.count(plans[0]) == len(plans):  # identity first: no __eq__ calls
        return plans[0]
    return None


def _min_tokens_bans(rows: Seq[SamplingRow], plans: list[RowPlan], one: RowPlan | None
                     ) -> list[tuple[int, tuple[int, ...]]]:
    """(row, banned ids) of the rows below their min_tokens this step (step 1)."""
    if one is not None and not one.min_tokens:
        return []
    if one is None and not any(p.min_tokens for p in plans):
        return []
    return [(i, p.banned) for i, (r, p) in enumerate(zip(rows, plans))
            if p.min_tokens and len(r.output_token_ids) < p.min_tokens]


def _apply_sampling_processors(logits: torch.Tensor, temperatures: float | list[float],
                               top_ks: int | list[int], top_ps: float | list[float],
                               min_ps: float | list[float], in_place: bool = True
                               ) -> torch.Tensor:
    """Steps 3-4 (temperature, top_k/top_p, min_p); each setting one value for every row
    or a list of one per row. in_place=False: logits are not the caller's to write (the
    temperature divides out of place; the other steps always do)."""
    dev = logits.device
    rows = logits.shape[0]

    def column(values: Any, dtype: torch.dtype) -> torch.Tensor:
        if isinstance(values, list):
            return torch.tensor(values, dtype=dtype, device=dev)
        return torch.full((rows,), values, dtype=dtype, device=dev)

    def some(values: Any, test: Callable[[Any], bool]) -> bool:
        return any(map(test, values)) if isinstance(values, list) else test(values)

    if some(temperatures, lambda t: t != 1.0):
        logits = apply_temperature(logits, column(temperatures, logits.dtype), in_place)
    # top_k past the vocabulary keeps everything (vLLM clamps it the same way); clamping
    # here also keeps a huge value such as 2**63 out of the int64 tensor.
    vocab = logits.shape[1]
    top_ks = [min(k, vocab) for k in top_ks] if isinstance(top_ks, list) else min(top_ks, vocab)
    if some(top_ks, lambda k: k > 0) or some(top_ps, lambda p: p < 1.0):
        logits = apply_top_k_top_p(logits, column(top_ks, torch.long),
                                   column(top_ps, logits.dtype))
    if some(min_ps, lambda m: m > 0.0):
        logits = apply_min_p(logits, column(min_ps, logits.dtype))
    return logits


def _check_rows(logits: torch.Tensor, num_rows: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise InternalError(
            f"logits must be [num_rows={num_rows}, vocab], got {tuple(logits.shape)}")


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 1-4 on a float32 copy of logits [rows, vocab]; the input is left untouched."""
    rows = metadata.rows
    _check_rows(logits, len(rows))
    plans = row_plans(rows)
    one = _common_plan(plans)
    return _process(logits, rows, plans, one, _min_tokens_bans(rows, plans, one))


def _process(logits: torch.Tensor, rows: Seq[SamplingRow], plans: list[RowPlan],
             one: RowPlan | None, bans: list[tuple[int, tuple[int, ...]]]) -> torch.Tensor:
    """process_logits with the step's plans (one: the plan all rows share, or None) and
    min_tokens bans."""
    dev = logits.device
    if one is not None:
        pen = list(range(len(rows))) if one.penalized else []
    else:
        pen = [i for i, p in enumerate(plans) if p.penalized]
    # min_tokens and the penalties write in place, so they get a copy; a batch with
    # neither skips copying [rows, vocab] floats every step (the temperature then divides
    # out of place, top_k/top_p/min_p always do).
    x = logits.to(torch.float32, copy=bool(bans or pen))
    owned = x is not logits  # a copy, or another dtype's conversion
    logits = x

    if bans:
        banned: list[Seq[int]] = [()] * len(rows)
        for i, ids in bans:
            banned[i] = ids
        logits = apply_min_tokens(logits, banned)

    if pen:
        idx = torch.tensor(pen, dtype=torch.long, device=dev)
        sub = [rows[i] for i in pen]
        logits[idx] = apply_penalties(
            logits[idx],
            [list(r.prompt_token_ids) for r in sub],
            [list(r.output_token_ids) for r in sub],
            torch.tensor([r.params.presence_penalty for r in sub], device=dev),
            torch.tensor([r.params.frequency_penalty for r in sub], device=dev),
            torch.tensor([r.params.repetition_penalty for r in sub], device=dev),
        )

    if one is not None:
        return _apply_sampling_processors(logits, one.temperature, one.top_k, one.top_p,
                                          one.min_p, owned)
    return _apply_sampling_processors(
        logits, [p.temperature for p in plans], [p.top_k for p in plans],
        [p.top_p for p in plans], [p.min_p for p in plans], owned)


# ----------------------------------------------------------------------------------------
# Logprob helpers
# ----------------------------------------------------------------------------------------


def top_logprob_dicts(
    logprobs: torch.Tensor, chosen: torch.Tensor, num_top: Seq[int]
) -> list[dict[int, Logprob]]:
    """Per row i: {chosen[i]: Logprob(...), top num_top[i] tokens...} from logprobs [n, V]."""
    n, vocab = logprobs.shape
    if n == 0:
        return []
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=1) + 1
    k = min(max(num_top), vocab)
    if k > 0:
        top_vals, top_ids = logprobs.topk(k, dim=-1)
        top_vals_l, top_ids_l = top_vals.tolist(), top_ids.tolist()
    out: list[dict[int, Logprob]] = []
    for i, (tok, lp, rank) in enumerate(zip(chosen.tolist(), chosen_lp.tolist(), ranks.tolist())):
        d: dict[int, Logprob] = {tok: Logprob(max(lp, LOGPROB_FLOOR), rank)}
        for j in range(min(num_top[i], k)):
            t = top_ids_l[i][j]
            if t not in d:
                d[t] = Logprob(max(top_vals_l[i][j], LOGPROB_FLOOR), j + 1)
        out.append(d)
    return out


def compute_prompt_logprobs(
    logits: torch.Tensor,
    prompt_token_ids: Seq[int],
    num_logprobs: int,
    params: SamplingParams | None = None,
    start: int = 0,
) -> list[dict[int, Logprob] | None]:
    """Prompt logprobs of one request (vLLM's PromptLogprobs) for a chunk of its prompt.

    logits [T, vocab] are the model's outputs at prompt positions start .. start+T-1; row i
    predicts the prompt token at position start+i+1 (a row past the prompt's last token is
    ignored). Returns, for each predicted position, {actual token: Logprob, top num_logprobs
    tokens...}, preceded by None for position 0 when start == 0 (the first token has no
    logprob). As vLLM 0.6 does for prompt rows, params' temperature, top_k, top_p and min_p
    are applied (no penalties, no min_tokens) when params is given.
    """
    num_targets = max(0, min(logits.shape[0], len(prompt_token_ids) - 1 - start))
    out: list[dict[int, Logprob] | None] = [None] if start == 0 else []
    if num_targets == 0:
        return out
    x = logits[:num_targets].to(torch.float32, copy=True)
    if params is not None:
        x = _apply_sampling_processors(x, _temperature(params), params.top_k, params.top_p,
                                       params.min_p)
    logprobs = torch.log_softmax(x, dim=-1)
    targets = torch.as_tensor(
        list(prompt_token_ids[start + 1 : start + 1 + num_targets]),
        dtype=torch.long,
        device=logprobs.device,
    )
    out.extend(top_logprob_dicts(logprobs, targets, [num_logprobs] * num_targets))
    return out


def beam_search_candidates(
    logprobs: torch.Tensor, cum_logprobs: Seq[float] | torch.Tensor, beam_width: int
) -> list[tuple[int, int, float]]:
    """The best 2 * beam_width (beam index, token, cumulative logprob) extensions of a
    beam group, best first (ties: lower beam index, then lower token id).

    logprobs [num_beams, vocab]: each live beam's next-token logprobs (one row at the
    prompt step); cum_logprobs [num_beams]: each beam's cumulative logprob so far. The
    engine applies length_penalty when it finishes beams (vLLM's BeamSearch flow).
    """
    num_beams, vocab = logprobs.shape
    cum = torch.as_tensor(cum_logprobs, dtype=logprobs.dtype, device=logprobs.device)
    scores = (logprobs + cum.reshape(num_beams, 1)).flatten()
    k = min(2 * beam_width, scores.numel())
    # A stable descending sort keeps lower flat indices first among equal scores.
    vals, idx = scores.sort(descending=True, stable=True)
    vals, idx = vals[:k].tolist(), idx[:k].tolist()
    return [(i // vocab, i % vocab, v) for i, v in zip(idx, vals)]


@functools.lru_cache(maxsize=8)
def _descending_ids(vocab: int, device: torch.device) -> torch.Tensor:
    """[vocab] float32 vocab - j: exact below 2**24, and largest for the lowest id."""
    return torch.arange(vocab, 0, -1, dtype=torch.float32, device=device)


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of float32 rows [rows, vocab]: the lowest id among a row's maxima (NaN
    counting as the maximum, as torch's). Why not argmax itself: torch's CPU argmax
    reduction runs element by element, while amax, a subtraction and a multiply run
    vectorized, several times faster: the maxima of row i
    are where x - max_i == 0 (exact for finite floats), each weighted by vocab - id, and the
    largest weight names the lowest id. Rows whose maximum is not finite (NaN, +inf, or
    every logit -inf) go to torch's argmax, as does CUDA, where argmax is fast."""
    vocab = x.shape[-1]
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or not x.numel()
            or vocab > 2**24):
        return x.argmax(dim=-1)
    m = x.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(m).all()):
        return x.argmax(dim=-1)
    hit = torch.sub(x, m).eq_(0.0)
    hit.mul_(_descending_ids(vocab, x.device))
    return (vocab - hit.amax(dim=-1)).to(torch.long)


def inverse_cdf_sample(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row i of probs [rows, vocab] (float32, >= 0, not all 0): the first token whose
    cumulative probability exceeds u[i] * total, u [rows] in [0, 1). A token with
    probability 0 (cut by top_k, top_p or min_p) has the same cumulative sum as the token
    before it, so it is never drawn; the target is kept below the row's total (the last
    cumulative sum), so some token always qualifies. The sums are float32, so a token's
    share is exact to about 1e-7 of the row's mass (torch.multinomial's precision).
    A row with NaN (a broken model) gets an id in range, not an error."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    target = (u.unsqueeze(1) * total.to(torch.float64)).to(torch.float32)
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    sampled = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return sampled.clamp_(max=probs.shape[1] - 1)


# ----------------------------------------------------------------------------------------
# The sampler
# ----------------------------------------------------------------------------------------


@dataclass
class RngSnapshot:
    # Each request's generator state (None: it had none yet), keyed by the request.
    requests: list[tuple[Any, torch.Tensor | None]]
    global_: dict[torch.device, torch.Tensor]
    default_cpu: torch.Tensor | None
    default_cuda: list[torch.Tensor] | None


class Sampler:
    """Samples one step's tokens: sampler(logits, metadata) -> SamplerOutput.

    seed: seeds the generator of unseeded random rows; None uses torch's default RNG
    (so torch.manual_seed(engine_seed) makes them reproducible). Seeded requests own a
    torch.Generator, created at their first step and kept on the request (row.request,
    the request's SequenceGroup in the engine), so it lives and dies with the request.
    """

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._global_generators: dict[torch.device, torch.Generator] = {}

    def snapshot(self, requests: Iterable[Any]) -> RngSnapshot:
        """Every random state a step over ``requests`` may advance, so the step can be run
        again exactly (the engine re-runs parts of a failed step to find the request that
        broke it)."""
        return RngSnapshot(
            [(r, r.generator.get_state() if r.generator is not None else None)
             for r in requests],
            {dev: g.get_state() for dev, g in self._global_generators.items()},
            torch.get_rng_state() if self.seed is None else None,
            torch.cuda.get_rng_state_all() if self.seed is None and torch.cuda.is_initialized()
            else None,
        )

    def restore(self, snap: RngSnapshot) -> None:
        for request, state in snap.requests:
            if state is None:
                request.generator = None  # created by the step being undone
            else:
                request.generator.set_state(state)
        for dev in [d for d in self._global_generators if d not in snap.global_]:
            del self._global_generators[dev]
        for dev, state in snap.global_.items():
            self._global_generators[dev].set_state(state)
        if snap.default_cpu is not None:
            torch.set_rng_state(snap.default_cpu)
        if snap.default_cuda is not None:
            torch.cuda.set_rng_state_all(snap.default_cuda)

    def _global_generator(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        gen = self._global_generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._global_generators[device] = gen
        return gen

    def _request_generator(self, row: SamplingRow, device: torch.device) -> torch.Generator:
        gen = row.request.generator
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(row.params.seed)
            row.request.generator = gen
        return gen

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        rows = metadata.rows
        _check_rows(logits, len(rows))
        # The step's decisions, from each row's plan (made once per row), and from one
        # shared plan where every row has the same (no pass over the rows per decision).
        plans = row_plans(rows)
        one = _common_plan(plans)
        bans = _min_tokens_bans(rows, plans, one)
        if not bans and logits.device.type == "cpu" and rows and (
                one.plain_greedy if one is not None else all(p.plain_greedy for p in plans)):
            plain = _plain_greedy(logits, rows)
            if plain is not None:
                return plain
        processed = _process(logits, rows, plans, one, bans)
        logprobs = torch.log_softmax(processed, dim=-1)
        dev = processed.device

        # Every sample in row order (flat_rows[j]: the row of sample j; greedy rows one,
        # their argmax; random rows rows[i].num_samples draws each, _draw; beam rows none).
        n = len(rows)
        if one is not None:
            counts = None if one.samples == 1 else [one.samples] * n
            greedy = list(range(n)) if one.greedy else []
            random_rows = list(range(n)) if one.random else []
        else:
            counts = [p.samples for p in plans]
            greedy = [i for i, p in enumerate(plans) if p.greedy]
            random_rows = [i for i, p in enumerate(plans) if p.random]
        if counts is not None and all(c == 1 for c in counts):
            counts = None
        # counts None: one sample per row, sample j is row j's.
        flat_rows = (list(range(n)) if counts is None
                     else [i for i, c in enumerate(counts) for _ in range(c)])
        beams = (_beam_candidates(rows, plans, logprobs)
                 if (one.beam if one is not None else any(p.beam for p in plans)) else {})
        if not flat_rows:
            return SamplerOutput([None] * n, logprobs, beams)
        flat_tokens = self._tokens(processed, rows, plans, one, greedy, random_rows, counts,
                                   len(flat_rows))
        # One value per sample, no row copies.
        if counts is None:
            flat_lp = logprobs.gather(1, flat_tokens.unsqueeze(1)).squeeze(1)
        else:
            flat_lp = logprobs[torch.tensor(flat_rows, dtype=torch.long, device=dev),
                               flat_tokens]
        if one is not None:
            want_top = list(range(len(flat_rows))) if one.num_logprobs is not None else []
        else:
            want_top = [j for j, i in enumerate(flat_rows) if plans[i].num_logprobs is not None]
        top_dicts: dict[int, dict[int, Logprob]] = {}
        if want_top:
            w = torch.tensor(want_top, dtype=torch.long, device=dev)
            dicts = top_logprob_dicts(
                logprobs[torch.tensor([flat_rows[j] for j in want_top], dtype=torch.long,
                                      device=dev)],
                flat_tokens[w],
                [plans[flat_rows[j]].num_logprobs for j in want_top],
            )
            top_dicts = dict(zip(want_top, dicts))
        toks_l, lps_l = _host_lists(flat_tokens, flat_lp)
        if not beams and not want_top and len(toks_l) == n:
            # One token per row, no entries: the columns (sample j is row j's).
            return SamplerOutput(None, logprobs, beams, plain=PlainSamples(
                [r.seq_id for r in rows], toks_l, lps_l))
        outputs: list[SampleOutput | None] = [None] * n
        j = 0
        for i, c in enumerate(counts if counts is not None else [1] * n):
            if not c:
                continue  # a beam row
            top = ([top_dicts[j + m] for m in range(c)] if plans[i].num_logprobs is not None
                   else None)
            outputs[i] = SampleOutput(rows[i].seq_id, toks_l[j : j + c], lps_l[j : j + c], top)
            j += c
        return SamplerOutput(outputs, logprobs, beams)

    def _tokens(self, processed: torch.Tensor, rows: Seq[SamplingRow], plans: list[RowPlan],
                one: RowPlan | None, greedy: list[int], random_rows: list[int],
                counts: list[int] | None, num_samples: int) -> torch.Tensor:
        """The step's samples in row order [num_samples]: the greedy rows' argmax, the
        random rows' draws (_draw); counts: each row's samples, None for one a row."""
        n = len(rows)
        # One argmax over every row (cheaper than gathering the greedy rows first).
        best = first_argmax(processed) if greedy else None
        sampled = self._draw(processed, rows, plans, one, random_rows) if random_rows else None
        if sampled is None and counts is None:
            return best  # every row greedy
        if best is None and len(random_rows) == n:
            return sampled  # every row random, its draws in row order
        dev = processed.device
        starts = list(range(n)) if counts is None else _starts(counts)
        tokens = torch.empty(num_samples, dtype=torch.long, device=dev)
        if best is not None:
            g = torch.tensor(greedy, dtype=torch.long, device=dev)
            tokens[torch.tensor([starts[i] for i in greedy], dtype=torch.long,
                                device=dev)] = best[g]
        if sampled is not None:
            pos = (random_rows if counts is None else
                   [starts[i] + k for i in random_rows for k in range(counts[i])])
            tokens[torch.tensor(pos, dtype=torch.long, device=dev)] = sampled
        return tokens

    def _draw(self, processed: torch.Tensor, rows: Seq[SamplingRow], plans: list[RowPlan],
              one: RowPlan | None, random_rows: list[int]) -> torch.Tensor:
        """The random rows' tokens, rows[i].num_samples each, in row order: per sample, one
        float64 uniform from the row's generator (its request's when seeded, else the
        sampler's), then inverse_cdf_sample. Why not vLLM's argmax(probs / Exponential(1)
        noise): a noise value per vocabulary entry costs a large share of a CPU decode
        step; one uniform per sample costs nothing and the cumulative sum little."""
        dev = processed.device
        if len(random_rows) == len(rows):
            probs = torch.softmax(processed, dim=-1)  # every row: no gather
        else:
            probs = torch.softmax(
                processed[torch.tensor(random_rows, dtype=torch.long, device=dev)], dim=-1)
        if one is not None:
            counts = [one.samples] * len(random_rows)
            seeded = [one.seeded] * len(random_rows) if one.seeded else []
        else:
            counts = [plans[i].samples for i in random_rows]
            seeded = [plans[i].seeded for i in random_rows]
        total = sum(counts)
        u = torch.empty(total, dtype=torch.float64, device=dev)
        if not any(seeded):
            u.uniform_(generator=self._global_generator(dev))
        else:
            per_sample = [s for s, c in zip(seeded, counts) for _ in range(c)]
            unseeded = [j for j, s in enumerate(per_sample) if not s]
            if unseeded:
                u[torch.tensor(unseeded, dtype=torch.long, device=dev)] = torch.rand(
                    len(unseeded), dtype=torch.float64, device=dev,
                    generator=self._global_generator(dev))
            j = 0
            for i, n, s in zip(random_rows, counts, seeded):
                if s:
                    u[j : j + n].uniform_(generator=self._request_generator(rows[i], dev))
                j += n
        if total != len(random_rows):  # best_of draws: one probability row per sample
            probs = probs.repeat_interleave(torch.tensor(counts, device=dev), dim=0)
        return inverse_cdf_sample(probs, u)


def _starts(counts: list[int]) -> list[int]:
    """Where each row's samples start in the flat order."""
    out, j = [], 0
    for c in counts:
        out.append(j)
        j += c
    return out


def _host_lists(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list[int], list[float]]:
    """tokens (int64) and logprobs as Python lists, in one copy to the host off the CPU
    (the float64 logprobs' bits ride in the tokens' int64 tensor)."""
    if tokens.device.type == "cpu":
        return tokens.tolist(), logprobs.tolist()
    both = torch.stack((tokens, logprobs.to(torch.float64).view(torch.int64))).cpu()
    return both[0].tolist(), both[1].view(torch.float64).tolist()


def _plain_greedy(logits: torch.Tensor, rows: Seq[SamplingRow]) -> SamplerOutput | None:
    """The step's output where every row is plain greedy (RowPlan.plain_greedy, min_tokens
    reached) and the logits are on the CPU: ops.greedy_sample gives each row's token and
    logprob in two passes over the logits, several times faster than the general path's
    float32 copy, log_softmax and argmax. None when a row's maximum is not finite (then
    torch's argmax / log_softmax decide, as before)."""
    tokens, logprobs = ops.greedy_sample(logits)
    toks, lps = tokens.tolist(), logprobs.tolist()
    if min(toks) < 0:
        return None
    return SamplerOutput(None, None, plain=PlainSamples([r.seq_id for r in rows], toks, lps))


def _beam_candidates(rows: Seq[SamplingRow], plans: list[RowPlan], logprobs: torch.Tensor
                     ) -> dict[str, list[BeamCandidate]]:
    """Per beam-search request: the best 2 * beam_width extensions over its rows, each
    with its token's logprob and, when the request asks for logprobs, its entry."""
    by_request: dict[str, list[int]] = {}
    for i, (r, p) in enumerate(zip(rows, plans)):
        if p.beam:
            by_request.setdefault(r.request_id, []).append(i)
    out: dict[str, list[BeamCandidate]] = {}
    dev = logprobs.device
    for rid, idx in by_request.items():
        params = rows[idx[0]].params
        group_lps = logprobs.index_select(0, torch.tensor(idx, dtype=torch.long, device=dev))
        cands = beam_search_candidates(group_lps, [rows[i].cumulative_logprob for i in idx],
                                       params.best_of)
        beam_idx = torch.tensor([b for b, _, _ in cands], dtype=torch.long, device=dev)
        token_idx = torch.tensor([t for _, t, _ in cands], dtype=torch.long, device=dev)
        token_lps = group_lps[beam_idx, token_idx].tolist()
        tops: list[dict[int, Logprob] | None] = [None] * len(cands)
        if params.logprobs is not None:
            tops = list(top_logprob_dicts(group_lps.index_select(0, beam_idx), token_idx,
                                          [params.logprobs] * len(cands)))
        out[rid] = [BeamCandidate(rows[idx[b]].seq_id, t, lp, top)
                    for (b, t, _), lp, top in zip(cands, token_lps, tops)]
    return out
