"""POST /v1/chat/completions: the messages go through the tokenizer's chat template, then
the answer comes back as one JSON body or as server-sent events (a role delta first)."""

from __future__ import annotations

import time
from contextlib import aclosing
from typing import Any
from collections.abc import AsyncIterator

from vllm_lite.entrypoints.chat_template import ChatTemplateLimits, render_chat_template
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams

from vllm_lite.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    ChatMessageParam,
    ChoiceLogprobs,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)
from vllm_lite.entrypoints.openai.serving_engine import (
    ChoiceStream,
    OpenAIServing,
    RequestError,
    random_id,
)
from vllm_lite.entrypoints.openai.sse import sse_data


def conversation(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The messages as the chat template wants them: text content only."""
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    conv = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise RequestError(f"content parts of type {part.type!r} are not supported "
                                       "(text only)", param="messages")
                texts.append(part.text)
            content = "".join(texts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        conv.append(msg)
    return conv


def apply_chat_template(tokenizer: Any, messages: list[ChatMessageParam],
                        add_generation_prompt: bool, add_special_tokens: bool,
                        limits: ChatTemplateLimits, name: str) -> tuple[str, list[int]]:
    """(prompt text, prompt ids); the same steps as LLM.chat, the template rendered within
    ``limits`` (the server's chat_template_* options)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise RequestError("the model's tokenizer has no chat template", param="messages")
    try:
        text = render_chat_template(tokenizer, conversation(messages), add_generation_prompt,
                                    limits, name)
    except ValueError as e:  # the template failed, or passed a limit: the request's 400
        raise RequestError(str(e), param="messages") from None
    return text, list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


class OpenAIServingChat(OpenAIServing):
    def prepare(self, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        """Every check, before anything reaches the engine."""
        self.check_model(req.model)
        if req.tools:
            raise RequestError("tools are not supported", param="tools")
        if req.tool_choice not in (None, "none", "auto"):
            # Without tools only "none" / "auto" (no tool call) can be honoured.
            raise RequestError("tool_choice needs tools, which are not supported",
                               param="tool_choice")
        if req.response_format is not None and req.response_format.type != "text":
            raise RequestError("only the text response_format is supported",
                               param="response_format")
        self.check_priority(req.priority)
        self.check_options(req)
        self.check_strings(req)
        self.check_messages(req.messages)
        tok = self.need_tokenizer("chat")
        text, ids = apply_chat_template(tok, req.messages, req.add_generation_prompt,
                                        req.add_special_tokens, *self.chat_template_limits)
        # truncate_prompt_tokens first: a prompt cut to fit is admitted (as vLLM).
        truncated, ids = self.truncate(text, ids, req)
        text = truncated if truncated is not None else text
        self.check_prompt(ids, param="messages")
        if req.top_logprobs is not None and not req.logprobs:
            raise RequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if req.top_logprobs is not None and req.top_logprobs < 0:
            raise RequestError(f"top_logprobs must be non-negative, got {req.top_logprobs}",
                               param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        if req.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(req.max_completion_tokens, len(ids),
                                                 "max_completion_tokens")
        else:
            max_tokens = self.resolve_max_tokens(req.max_tokens, len(ids))
        return text, ids, self.sampling_params(req, len(ids), max_tokens, logprobs,
                                               "top_logprobs")

    def _logprobs(self, c: CompletionOutput, start: int, token_ids: list[int], k: int,
                  as_ids: bool) -> ChoiceLogprobs:
        content = []
        for j, tid in enumerate(token_ids):
            entry = c.logprobs[start + j] if c.logprobs and start + j < len(c.logprobs) else None
            tok = self.token_text(tid, as_ids)
            lp = entry[tid].logprob if entry is not None and tid in entry else float("nan")
            top = [TopLogprob(token=t, logprob=v, bytes=list(t.encode("utf-8")))
                   for t, v in (self.ranked_logprobs(entry, k, as_ids) if entry else [])]
            content.append(TokenLogprob(token=tok, logprob=lp, bytes=list(tok.encode("utf-8")),
                                        top_logprobs=top))
        return ChoiceLogprobs(content=content)

    def _choice_logprobs(self, req: ChatCompletionRequest, c: CompletionOutput, start: int,
                         token_ids: list[int]) -> ChoiceLogprobs | None:
        if not req.logprobs:
            return None
        return self._logprobs(c, start, token_ids, req.top_logprobs or 0,
                              req.return_tokens_as_token_ids)

    async def complete(self, req: ChatCompletionRequest, text: str, ids: list[int],
                       params: SamplingParams) -> ChatCompletionResponse:
        request_id = random_id("chatcmpl")
        final: RequestOutput | None = None
        async with aclosing(self.run(request_id, text, ids, params, req.priority)) as outs:
            async for out in outs:
                final = out
        assert final is not None and final.finished
        choices = [
            ChatCompletionChoice(
                index=pos, message=ChatMessage(role="assistant", content=c.text),
                logprobs=self._choice_logprobs(req, c, 0, c.token_ids),
                finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for pos, c in enumerate(final.outputs)
        ]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        usage = UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                          total_tokens=len(ids) + completion_tokens)
        return ChatCompletionResponse(id=request_id, model=self.served_model, choices=choices,
                                      usage=usage)

    async def stream(self, req: ChatCompletionRequest, text: str, ids: list[int],
                     params: SamplingParams) -> AsyncIterator[str]:
        request_id = random_id("chatcmpl")
        created = int(time.time())

        def chunk(choices: list[ChatCompletionStreamChoice],
                  usage: UsageInfo | None = None) -> str:
            return sse_data(ChatCompletionStreamResponse(
                id=request_id, created=created, model=self.served_model, choices=choices,
                usage=usage))

        states: dict[int, ChoiceStream] = {}
        last: RequestOutput | None = None
        yield chunk([ChatCompletionStreamChoice(
            index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(params.n)])
        async with aclosing(self.run(request_id, text, ids, params, req.priority)) as outs:
            async for out in outs:
                last = out
                for c in out.outputs:
                    state = states.setdefault(c.index, ChoiceStream(params))
                    delta = state.delta(c)
                    if delta is None:
                        continue
                    new_text, new_ids, start = delta
                    yield chunk([ChatCompletionStreamChoice(
                        index=c.index, delta=DeltaMessage(content=new_text),
                        logprobs=self._choice_logprobs(req, c, start, new_ids),
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason)])
        if req.stream_options is not None and req.stream_options.include_usage and last:
            completion_tokens = sum(len(c.token_ids) for c in last.outputs)
            yield chunk([], UsageInfo(prompt_tokens=len(ids),
                                      completion_tokens=completion_tokens,
                                      total_tokens=len(ids) + completion_tokens))
