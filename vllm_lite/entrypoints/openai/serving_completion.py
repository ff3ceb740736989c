"""POST /v1/completions: one or several prompts (text or token ids), n completions each,
as one JSON body or as server-sent events."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any
from collections.abc import AsyncIterator

from vllm_lite.detokenizer import decode
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams

from vllm_lite.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from vllm_lite.entrypoints.openai.serving_engine import (
    ChoiceStream,
    OpenAIServing,
    RequestError,
    merge,
    random_id,
)
from vllm_lite.entrypoints.openai.sse import sse_data

Prompt = tuple[str | None, list[int]]


class OpenAIServingCompletion(OpenAIServing):
    def _prompts(self, req: CompletionRequest) -> list[Prompt]:
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif not p:
            raise RequestError("the prompt is empty", param="prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        if len(items) > self.limits.max_prompts_per_request:
            raise RequestError(f"prompt holds {len(items)} prompts; at most "
                               f"{self.limits.max_prompts_per_request} per request "
                               "(--max-prompts-per-request)", param="prompt")
        for item in items:  # every text checked before any is tokenized
            if isinstance(item, str):
                self.check_text(item, "prompt")
        prompts: list[Prompt] = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise RequestError("the prompt is empty", param="prompt")
                tok = self.need_tokenizer("a text prompt")
                ids = list(tok.encode(item, add_special_tokens=req.add_special_tokens))
                prompts.append((item, ids))
            else:
                prompts.append((None, list(item)))
        # truncate_prompt_tokens first: a prompt cut to fit is admitted (as vLLM).
        prompts = [self.truncate(text, ids, req) for text, ids in prompts]
        for _, ids in prompts:
            self.check_prompt(ids)
        return prompts

    def prepare(self, req: CompletionRequest) -> tuple[list[Prompt], list[SamplingParams]]:
        """Every check, before anything reaches the engine."""
        self.check_model(req.model)
        if req.suffix:
            raise RequestError("suffix is not supported", param="suffix")
        self.check_priority(req.priority)
        self.check_options(req)
        self.check_strings(req)
        if req.logprobs is not None and req.logprobs < 0:
            raise RequestError(f"logprobs must be non-negative, got {req.logprobs}",
                               param="logprobs")
        prompts = self._prompts(req)
        params = []
        for _, ids in prompts:
            max_tokens = self.resolve_max_tokens(req.max_tokens, len(ids))
            # Echoed prompts come with their tokens' logprobs too.
            prompt_logprobs = req.logprobs if req.echo else None
            params.append(self.sampling_params(req, len(ids), max_tokens, req.logprobs,
                                               "logprobs", prompt_logprobs))
        return prompts, params

    def _streams(self, req: CompletionRequest, request_id: str, prompts: list[Prompt],
                 params: list[SamplingParams]) -> list[AsyncIterator[RequestOutput]]:
        return [self.run(f"{request_id}-{i}", text, ids, p, req.priority)
                for i, ((text, ids), p) in enumerate(zip(prompts, params))]

    def _echo_text(self, req: CompletionRequest, prompt: Prompt) -> str:
        text, ids = prompt
        if text is not None:
            return text
        if self.tokenizer is None:
            return ""
        # The prompt's special tokens are echoed, joined as the request asks.
        return decode(self.tokenizer, ids, skip_special_tokens=False,
                      spaces_between_special_tokens=req.spaces_between_special_tokens)

    def _logprobs(self, lp: CompletionLogProbs, entries: list[dict[int, Any] | None],
                  token_ids: list[int], k: int, as_ids: bool, offset: int) -> None:
        """Appends one position per token to ``lp`` (entries[j]: token j's logprobs)."""
        for tid, entry in zip(token_ids, entries):
            tok = self.token_text(tid, as_ids)
            lp.tokens.append(tok)
            lp.text_offset.append(offset)
            offset += len(tok)
            if entry is None:  # the first prompt token has no logprob
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
                continue
            lp.token_logprobs.append(entry[tid].logprob if tid in entry else None)
            top = dict(self.ranked_logprobs(entry, k, as_ids))
            if tid in entry:  # the chosen token is always listed, as in vLLM
                top.setdefault(tok, entry[tid].logprob)
            lp.top_logprobs.append(top)

    def _choice_logprobs(self, req: CompletionRequest, out: RequestOutput, c: CompletionOutput,
                         start: int, new_ids: list[int], with_prompt: bool,
                         offset: int) -> CompletionLogProbs | None:
        """Logprobs of the new tokens (from index ``start``), after the prompt's when it
        is echoed; ``offset``: where the new text starts in the choice's text."""
        if req.logprobs is None:
            return None
        k, as_ids = req.logprobs, req.return_tokens_as_token_ids
        lp = CompletionLogProbs()
        if with_prompt:
            ids = out.prompt_token_ids
            plp = out.prompt_logprobs or []
            self._logprobs(lp, [plp[j] if j < len(plp) else None for j in range(len(ids))],
                           ids, k, as_ids, 0)
        clp = c.logprobs or []
        entries = [clp[j] if j < len(clp) else None for j in range(start, start + len(new_ids))]
        self._logprobs(lp, entries, new_ids, k, as_ids, offset)
        return lp

    # -- plain response ----------------------------------------------------------------------
    async def complete(self, req: CompletionRequest, prompts: list[Prompt],
                       params: list[SamplingParams]) -> CompletionResponse:
        request_id = random_id("cmpl")
        finals: dict[int, RequestOutput] = {}
        async with aclosing(merge(self._streams(req, request_id, prompts, params))) as outs:
            async for i, out in outs:
                if out.finished:
                    finals[i] = out
        choices: list[CompletionChoice] = []
        usage = UsageInfo()
        for i, prompt in enumerate(prompts):
            out = finals[i]
            usage.prompt_tokens += len(out.prompt_token_ids)
            echo = self._echo_text(req, prompt) if req.echo else ""
            for pos, c in enumerate(out.outputs):
                usage.completion_tokens += len(c.token_ids)
                logprobs = self._choice_logprobs(req, out, c, 0, c.token_ids, req.echo,
                                                 len(echo))
                choices.append(CompletionChoice(
                    index=i * req.n + pos, text=echo + c.text, logprobs=logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
        return CompletionResponse(id=request_id, model=self.served_model, choices=choices,
                                  usage=usage)

    # -- server-sent events ------------------------------------------------------------------
    def _stream_choices(self, req: CompletionRequest, i: int, out: RequestOutput,
                        prompt: Prompt, params: SamplingParams,
                        states: dict[tuple[int, int], ChoiceStream]) -> list[CompletionChoice]:
        """The new part of each of prompt i's completions; the first carries the echo."""
        choices = []
        for c in out.outputs:
            key = (i, c.index)
            first = key not in states
            state = states.setdefault(key, ChoiceStream(params))
            delta = state.delta(c)
            if delta is None:
                if first:
                    del states[key]  # nothing sent yet: the echo still goes with the first
                continue
            text, new_ids, start = delta
            echo = self._echo_text(req, prompt) if req.echo else ""
            logprobs = self._choice_logprobs(req, out, c, start, new_ids, req.echo and first,
                                             len(echo) + state.sent_chars - len(text))
            choices.append(CompletionChoice(
                index=i * req.n + c.index, text=(echo if first else "") + text,
                logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return choices

    async def stream(self, req: CompletionRequest, prompts: list[Prompt],
                     params: list[SamplingParams]) -> AsyncIterator[str]:
        request_id = random_id("cmpl")
        created = int(time.time())
        states: dict[tuple[int, int], ChoiceStream] = {}
        last: dict[int, RequestOutput] = {}

        def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
            return sse_data(CompletionResponse(id=request_id, created=created,
                                               model=self.served_model, choices=choices,
                                               usage=usage))

        async with aclosing(merge(self._streams(req, request_id, prompts, params))) as outs:
            async for i, out in outs:
                last[i] = out
                for choice in self._stream_choices(req, i, out, prompts[i], params[i], states):
                    yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            usage = UsageInfo()
            for out in last.values():
                usage.prompt_tokens += len(out.prompt_token_ids)
                usage.completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
            yield chunk([], usage)
