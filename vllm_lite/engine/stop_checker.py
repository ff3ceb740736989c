"""Why a sequence stops, in one place: EOS, stop token ids, stop strings, max_tokens and
max_model_len (vLLM's StopChecker).

Token rules are checked on each new token (sampled, or a beam candidate before the beam
policy ranks it); stop strings on the new text once the token is detokenized. The
output processor turns the verdicts into updates (a finish on the token's append) that
the scheduler's apply() carries out.
"""

from __future__ import annotations


from vllm_lite.sampling_params import SamplingParams
from vllm_lite.sequence import SequenceStatus

# A verdict: the finished status and the stop reason (a stop token id, a stop string, or
# None for EOS and the length limits), as RequestOutput reports them.
StopVerdict = tuple[SequenceStatus, int | str | None]


class StopChecker:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len

    def check_token(self, params: SamplingParams, eos_token_id: int | None, token: int,
                    output_len: int, seq_len: int) -> StopVerdict | None:
        """The verdict on a sequence whose last token is ``token``, with ``output_len``
        output and ``seq_len`` tokens in all; None while it runs on."""
        if output_len >= params.min_tokens:
            if not params.ignore_eos and eos_token_id is not None and token == eos_token_id:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if params.max_tokens is not None and output_len >= params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH_CAPPED, None
        if seq_len > self.max_model_len:
            # As vLLM: the model never sees more than max_model_len tokens; the last
            # sampled one is not fed back.
            return SequenceStatus.FINISHED_LENGTH_CAPPED, None
        return None

    def token_limits(self, params: SamplingParams, eos_token_id: int | None,
                     prompt_len: int) -> tuple[int, int]:
        """(cap, eos) for a one-sequence request with no stop_token_ids: check_token can
        only end it on a token that makes it ``cap`` tokens long or more, or on token
        ``eos`` (-1: none); any other token runs on. A screen, computed once per request,
        so the usual decode step runs no check per row."""
        cap = self.max_model_len + 1
        if params.max_tokens is not None:
            cap = min(cap, prompt_len + params.max_tokens)
        eos = -1 if params.ignore_eos or eos_token_id is None else eos_token_id
        return cap, eos

    def max_output_len(self, params: SamplingParams, prompt_len: int) -> int:
        """The most tokens a sequence with this prompt can generate."""
        limit = self.max_model_len + 1 - prompt_len
        return limit if params.max_tokens is None else min(params.max_tokens, limit)

    @staticmethod
    def check_stop_strings(params: SamplingParams, text: str,
                           num_new_chars: int) -> tuple[str, int] | None:
        """(the stop string found, the length the text keeps) when one of params.stop
        ends in the last ``num_new_chars`` characters of ``text``; None otherwise. Only
        the tail that could hold a new match is searched."""
        if not params.stop or not num_new_chars:
            return None
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop)
        longest = max(len(s) for s in stops)
        search_from = max(0, len(text) - num_new_chars - longest + 1)
        for stop in stops:
            idx = text.find(stop, search_from)
            if idx >= 0:
                return stop, (idx + len(stop) if params.include_stop_str_in_output else idx)
        return None
