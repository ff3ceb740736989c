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
from collections.abc import Iterable, Sequence as Seq

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
    plain greedy path (Sampler._plain_greedy), which computes only the chosen tokens'.
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


def apply_temperature(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """Divide each row by its temperature ([rows]; greedy rows should pass 1)."""
    return logits.div_(temperatures.to(logits.dtype).unsqueeze(1))


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


def _apply_sampling_processors(
    logits: torch.Tensor, params_list: Seq[SamplingParams]
) -> torch.Tensor:
    """Steps 3-4 (temperature, top_k/top_p, min_p) for rows with the given params."""
    dev = logits.device
    temps = [_temperature(p) for p in params_list]
    if any(t != 1.0 for t in temps):
        logits = apply_temperature(logits, torch.tensor(temps, dtype=logits.dtype, device=dev))
    # top_k past the vocabulary keeps everything (vLLM clamps it the same way); clamping
    # here also keeps a huge value such as 2**63 out of the int64 tensor.
    vocab = logits.shape[1]
    top_ks = [min(p.top_k, vocab) for p in params_list]
    top_ps = [p.top_p for p in params_list]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = apply_top_k_top_p(
            logits,
            torch.tensor(top_ks, dtype=torch.long, device=dev),
            torch.tensor(top_ps, dtype=logits.dtype, device=dev),
        )
    min_ps = [p.min_p for p in params_list]
    if any(m > 0.0 for m in min_ps):
        logits = apply_min_p(logits, torch.tensor(min_ps, dtype=logits.dtype, device=dev))
    return logits


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Steps 1-4 on a float32 copy of logits [rows, vocab]; the input is left untouched."""
    if logits.dim() != 2 or logits.shape[0] != len(metadata.rows):
        raise InternalError(
            f"logits must be [num_rows={len(metadata.rows)}, vocab], got {tuple(logits.shape)}"
        )
    rows = metadata.rows
    dev = logits.device
    banned = [r.min_tokens_banned_ids() for r in rows]
    pen = [i for i, r in enumerate(rows) if _penalized(r.params)]
    # min_tokens, the penalties and temperature write in place, so they get a copy; a
    # batch with none of them (greedy, or top_k/top_p/min_p alone, which are out of place)
    # skips copying [rows, vocab] floats every step.
    in_place = any(banned) or pen or any(_temperature(r.params) != 1.0 for r in rows)
    logits = logits.to(torch.float32, copy=bool(in_place))

    if any(banned):
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

    return _apply_sampling_processors(logits, [r.params for r in rows])


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
        x = _apply_sampling_processors(x, [params] * num_targets)
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
        plain = _plain_greedy(logits, rows)
        if plain is not None:
            return plain
        processed = process_logits(logits, metadata)
        logprobs = torch.log_softmax(processed, dim=-1)
        dev = processed.device

        # Greedy rows: argmax; random rows: num_samples draws each (_draw).
        greedy = [i for i, r in enumerate(rows) if r.sampling_type == SamplingType.GREEDY]
        random_rows = [
            i for i, r in enumerate(rows)
            if r.sampling_type in (SamplingType.RANDOM, SamplingType.RANDOM_SEED)
        ]
        tokens: dict[int, torch.Tensor] = {}
        if greedy:
            # One argmax over every row (cheaper than gathering the greedy rows first).
            best = first_argmax(processed)
            for i in greedy:
                tokens[i] = best[i:i + 1]
        if random_rows:
            sampled = self._draw(processed, rows, random_rows)
            j = 0
            for i in random_rows:
                n = rows[i].num_samples
                tokens[i] = sampled[j : j + n]
                j += n

        order = sorted(tokens)
        outputs: list[SampleOutput | None] = [None] * len(rows)
        beams = _beam_candidates(rows, logprobs)
        if not order:
            return SamplerOutput(outputs, logprobs, beams)
        flat_rows = [i for i in order for _ in range(tokens[i].numel())]
        fr = torch.tensor(flat_rows, dtype=torch.long, device=dev)
        flat_tokens = torch.cat([tokens[i] for i in order])
        flat_lp = logprobs[fr, flat_tokens]  # one value per sample, no row copies
        want_top = [j for j, i in enumerate(flat_rows) if rows[i].params.logprobs is not None]
        top_dicts: dict[int, dict[int, Logprob]] = {}
        if want_top:
            w = torch.tensor(want_top, dtype=torch.long, device=dev)
            dicts = top_logprob_dicts(
                logprobs[fr[w]],
                flat_tokens[w],
                [rows[flat_rows[j]].params.logprobs for j in want_top],
            )
            top_dicts = dict(zip(want_top, dicts))
        # One copy to the host for the step's tokens and their logprobs (float64 holds
        # every token id exactly, and every float32 logprob).
        toks_f, lps_l = torch.stack((flat_tokens.to(torch.float64),
                                     flat_lp.to(torch.float64))).tolist()
        toks_l = [int(t) for t in toks_f]
        if not beams and not want_top and len(order) == len(toks_l) == len(rows):
            # One token per row, no entries: the columns (order is every row, in order).
            return SamplerOutput(None, logprobs, beams, plain=PlainSamples(
                [r.seq_id for r in rows], toks_l, lps_l))
        j = 0
        for i in order:
            n = tokens[i].numel()
            top = None
            if rows[i].params.logprobs is not None:
                top = [top_dicts[j + m] for m in range(n)]
            outputs[i] = SampleOutput(rows[i].seq_id, toks_l[j : j + n], lps_l[j : j + n], top)
            j += n
        return SamplerOutput(outputs, logprobs, beams)


    def _draw(self, processed: torch.Tensor, rows: Seq[SamplingRow],
              random_rows: list[int]) -> torch.Tensor:
        """The random rows' tokens, rows[i].num_samples each, in row order: per sample, one
        float64 uniform from the row's generator (its request's when seeded, else the
        sampler's), then inverse_cdf_sample. Why not vLLM's argmax(probs / Exponential(1)
        noise): a noise value per vocabulary entry costs a large share of a CPU decode
        step; one uniform per sample costs nothing and the cumulative sum little."""
        dev = processed.device
        if random_rows == list(range(len(rows))):
            probs = torch.softmax(processed, dim=-1)  # every row: no gather
        else:
            probs = torch.softmax(
                processed[torch.tensor(random_rows, dtype=torch.long, device=dev)], dim=-1)
        counts = [rows[i].num_samples for i in random_rows]
        u = torch.empty(sum(counts), dtype=torch.float64, device=dev)
        sample_rows = [i for i, n in zip(random_rows, counts) for _ in range(n)]
        unseeded = [j for j, i in enumerate(sample_rows) if rows[i].params.seed is None]
        if len(unseeded) == len(u):
            u.uniform_(generator=self._global_generator(dev))
        elif unseeded:
            u[torch.tensor(unseeded, dtype=torch.long, device=dev)] = torch.rand(
                len(unseeded), dtype=torch.float64, device=dev,
                generator=self._global_generator(dev))
        j = 0
        for i, n in zip(random_rows, counts):
            if rows[i].params.seed is not None:
                u[j : j + n].uniform_(generator=self._request_generator(rows[i], dev))
            j += n
        if len(u) != len(random_rows):  # best_of draws: one probability row per sample
            probs = probs.repeat_interleave(torch.tensor(counts, device=dev), dim=0)
        return inverse_cdf_sample(probs, u)


def _is_plain_greedy(row: SamplingRow) -> bool:
    """A greedy row whose logits no processor changes (steps 1-4 leave them as they are:
    greedy rows use temperature 1, and greedy SamplingParams reset top_k / top_p / min_p;
    they are checked all the same, as process_logits would apply them) and that asks for
    no logprobs beyond its token's."""
    p = row.params
    static = row.params_plain_greedy
    if static is None:
        static = row.params_plain_greedy = (
            row.sampling_type == SamplingType.GREEDY and p.logprobs is None
            and not _penalized(p) and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)
    return static and (len(row.output_token_ids) >= p.min_tokens
                       or not row.min_tokens_banned_ids())


def _plain_greedy(logits: torch.Tensor, rows: Seq[SamplingRow]) -> SamplerOutput | None:
    """The step's output where every row is plain greedy (_is_plain_greedy) and the logits
    are on the CPU: ops.greedy_sample gives each row's token and logprob in two passes over
    the logits, several times faster than the general path's float32 copy, log_softmax and
    argmax. None otherwise, or
    when a row's maximum is not finite (then torch's argmax / log_softmax decide, as
    before)."""
    if (logits.device.type != "cpu" or logits.dim() != 2 or logits.shape[0] != len(rows)
            or not rows or not all(_is_plain_greedy(r) for r in rows)):
        return None
    tokens, logprobs = ops.greedy_sample(logits)
    # One copy to the host for the tokens and their logprobs (float64 holds every token
    # id exactly, and every float32 logprob).
    toks_f, lps = torch.stack((tokens.to(torch.float64), logprobs.to(torch.float64))).tolist()
    if min(toks_f) < 0:
        return None
    return SamplerOutput(None, None, plain=PlainSamples(
        [r.seq_id for r in rows], list(map(int, toks_f)), lps))


def _beam_candidates(rows: Seq[SamplingRow], logprobs: torch.Tensor
                     ) -> dict[str, list[BeamCandidate]]:
    """Per beam-search request: the best 2 * beam_width extensions over its rows, each
    with its token's logprob and, when the request asks for logprobs, its entry."""
    by_request: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        if r.sampling_type == SamplingType.BEAM:
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
