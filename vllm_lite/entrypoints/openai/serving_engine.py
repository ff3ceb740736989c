"""What completions and chat share: checking a request before it reaches the engine
(model name, prompt, sampling values, limits), building its SamplingParams, running it
on the AsyncLLMEngine and turning step outputs into stream deltas and logprob tokens."""

from __future__ import annotations

import asyncio
import logging
import uuid
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any
from collections.abc import AsyncIterator, Sequence

from pydantic import BaseModel

from vllm_lite.engine.async_engine import AsyncLLMEngine, EngineError
from vllm_lite.entrypoints.chat_template import ChatTemplateLimits
from vllm_lite.inputs import truncate_prompt
from vllm_lite.outputs import CompletionOutput, RequestOutput
from vllm_lite.sampling_params import SamplingParams

from vllm_lite.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, SamplingFields
from vllm_lite.entrypoints.openai.sse import DONE, sse_data
from vllm_lite.entrypoints.openai.tokenizer_pool import TokenizerPool

logger = logging.getLogger(__name__)

# Request fields a SamplingParams error may name (its messages start with the field).
_SAMPLING_FIELDS = frozenset(
    ("n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
     "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "logprobs",
     "stop", "stop_token_ids", "length_penalty", "early_stopping", "truncate_prompt_tokens",
     "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
     "ignore_eos", "use_beam_search"))


class RequestError(Exception):
    """A request the server refuses, with the HTTP status and the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 err_type: str = "BadRequestError") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def error_body(message: str, err_type: str, status: int,
               param: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param,
                                         code=status)).model_dump()


def from_value_error(e: ValueError) -> RequestError:
    msg = str(e)
    first = msg.split(" ", 1)[0]
    return RequestError(msg, param=first if first in _SAMPLING_FIELDS else None)


@dataclass(frozen=True)
class ServingLimits:
    """Per-request caps the server enforces on top of the engine's own checks (their
    defaults live in ServerConfig)."""

    max_n: int
    max_logprobs: int
    max_prompts_per_request: int
    max_chat_messages: int


def _longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (vocabulary entries are written as
    their bytes, one character a byte, for byte-level BPE; as text for others)."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # noqa: BLE001  (a tokenizer without a vocabulary view)
        return 64
    longest = max((len(t) for t in vocab), default=1)
    # Added tokens (<|im_start|>...) are in the vocabulary too; 4: a byte-fallback or
    # normalizer that expands a character never shrinks the token count below this.
    return max(longest, 4)


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, served_model: str, limits: ServingLimits,
                 tokenizers: TokenizerPool) -> None:
        self.engine = engine
        self.served_model = served_model
        self.limits = limits
        llm_engine = engine.engine
        self.model_config = llm_engine.config.model_config
        self.max_model_len: int = self.model_config.max_model_len
        cc = llm_engine.cache_config
        self.cache_tokens: int = cc.num_gpu_blocks * cc.block_size
        self.tokenizers = tokenizers
        # (limits, the name errors give the template): what apply_chat_template takes.
        self.chat_template_limits = (
            ChatTemplateLimits(self.model_config.chat_template_timeout,
                               self.model_config.chat_template_max_chars),
            f"the model {served_model!r}")
        # A text longer than this can never tokenize into max_model_len tokens: refused
        # before the tokenizer spends time (and memory) on it.
        self.max_prompt_chars: int | None = None
        if llm_engine.tokenizer is not None:
            self.max_prompt_chars = _longest_token_chars(llm_engine.tokenizer) * self.max_model_len
        # The engine's request checks (engine/admission.py): the same as add_request's.
        self.admission = llm_engine.admission

    @property
    def tokenizer(self) -> Any:
        """This thread's tokenizer: the engine thread detokenizes with its own meanwhile,
        and a fast tokenizer must not be used from two threads at once."""
        return self.tokenizers.current()

    # -- checks ----------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.served_model:
            raise RequestError(f"the model {model!r} does not exist; this server serves "
                               f"{self.served_model!r}", param="model")

    def need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise RequestError(f"{what} needs a tokenizer, and the model has none; "
                               "send token ids")
        return self.tokenizer

    def check_text(self, text: str, param: str) -> None:
        """Before tokenizing: valid Unicode (a lone surrogate in the JSON cannot be
        encoded) and not longer than any prompt that could fit the context."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{param} is not valid Unicode text: {e.reason} at position "
                               f"{e.start}", param=param) from None
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise RequestError(f"{param} has {len(text)} characters; no text longer than "
                               f"{self.max_prompt_chars} fits the context of "
                               f"{self.max_model_len} tokens", param=param)

    def check_strings(self, req: Any) -> None:
        """Every string of the request (stop strings, names, user...) is valid Unicode."""
        def walk(value: Any, param: str) -> None:
            if isinstance(value, str):
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError as e:
                    raise RequestError(f"{param} is not valid Unicode text: {e.reason}",
                                       param=param) from None
            elif isinstance(value, dict):
                for v in value.values():
                    walk(v, param)
            elif isinstance(value, (list, tuple)):
                for v in value:
                    walk(v, param)

        for name, value in req:
            if isinstance(value, BaseModel):
                value = value.model_dump()
            elif isinstance(value, list):
                value = [v.model_dump() if isinstance(v, BaseModel) else v for v in value]
            walk(value, name)

    def check_messages(self, messages: list[Any]) -> None:
        """Before templating: the count, and the total text against max_prompt_chars."""
        if len(messages) > self.limits.max_chat_messages:
            raise RequestError(f"messages holds {len(messages)} messages; at most "
                               f"{self.limits.max_chat_messages} per request "
                               "(--max-chat-messages)", param="messages")
        total = 0
        for m in messages:
            content = m.content
            if isinstance(content, list):
                total += sum(len(part.text or "") for part in content)
            elif content:
                total += len(content)
        if self.max_prompt_chars is not None and total > self.max_prompt_chars:
            raise RequestError(f"messages hold {total} characters; no text longer than "
                               f"{self.max_prompt_chars} fits the context of "
                               f"{self.max_model_len} tokens", param="messages")

    def check_priority(self, priority: int) -> None:
        try:
            self.admission.priority(priority)
        except ValueError as e:
            raise RequestError(str(e), param="priority") from None

    def check_options(self, req: SamplingFields) -> None:
        """Request options that would otherwise be accepted and have no effect."""
        if req.stream_options is not None and not req.stream:
            # As vLLM (and OpenAI): usage chunks exist only in a stream.
            raise RequestError("stream_options can only be set when stream is true",
                               param="stream_options")
        for name in req.unsupported_fields:
            value = getattr(req, name)
            if value is not None and value is not False:
                raise RequestError(f"{name} is not supported by this server", param=name)

    def truncate(self, text: str | None, ids: list[int],
                 req: SamplingFields) -> tuple[str | None, list[int]]:
        """The prompt after truncate_prompt_tokens (its last k tokens), before the length
        checks: the same helper LLM.generate / chat use."""
        try:
            return truncate_prompt(text, ids, req.truncate_prompt_tokens, self.tokenizer,
                                   req.spaces_between_special_tokens)
        except ValueError as e:
            raise RequestError(str(e), param="truncate_prompt_tokens") from None

    def check_prompt(self, ids: list[int], param: str = "prompt") -> None:
        try:
            self.admission.prompt(ids)
        except ValueError as e:
            raise RequestError(str(e), param=param) from None

    def resolve_max_tokens(self, max_tokens: int | None, prompt_len: int,
                           param: str = "max_tokens") -> int:
        room = self.max_model_len - prompt_len
        if max_tokens is None:
            if room < 1:
                raise RequestError(f"the prompt ({prompt_len} tokens) leaves no room to generate "
                                   f"within the context of {self.max_model_len} tokens",
                                   param="prompt")
            return room
        if isinstance(max_tokens, int) and max_tokens > room:
            raise RequestError(f"{param} {max_tokens} is too large: the prompt has {prompt_len} "
                               f"tokens and the context holds {self.max_model_len}, so at most "
                               f"{max(room, 0)} can be generated", param=param)
        if isinstance(max_tokens, int) and prompt_len + max_tokens > self.cache_tokens:
            raise RequestError(f"prompt ({prompt_len} tokens) plus {param} {max_tokens} exceed "
                               f"the KV cache ({self.cache_tokens} tokens)", param=param)
        return max_tokens

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int,
                        logprobs: int | None, logprobs_param: str,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        if logprobs is not None and logprobs > self.limits.max_logprobs:
            raise RequestError(f"{logprobs_param} must be at most {self.limits.max_logprobs}, "
                               f"got {logprobs}", param=logprobs_param)
        if req.logit_bias:
            raise RequestError("logit_bias is not supported", param="logit_bias")
        if req.stream and req.best_of is not None and req.best_of != req.n:
            raise RequestError("best_of must equal n when streaming", param="best_of")
        try:
            params = SamplingParams(
                n=req.n, best_of=req.best_of,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=req.top_k, min_p=req.min_p,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty,
                seed=req.seed, stop=req.stop, stop_token_ids=req.stop_token_ids,
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos, max_tokens=max_tokens, min_tokens=req.min_tokens,
                logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                use_beam_search=req.use_beam_search,
                length_penalty=req.length_penalty, early_stopping=req.early_stopping,
                skip_special_tokens=req.skip_special_tokens,
                spaces_between_special_tokens=req.spaces_between_special_tokens,
                # The prompt is already truncated (self.truncate); kept so the request's
                # params say what was applied, and truncating again changes nothing.
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                detokenize=self.tokenizer is not None,
            )
            self.admission.params(params, max_n=self.limits.max_n)
        except ValueError as e:
            raise from_value_error(e) from None
        try:
            self.admission.fits(prompt_len, params)
        except ValueError as e:
            raise RequestError(str(e), param="max_tokens" if req.n == params.best_of
                               else "best_of") from None
        if params.use_beam_search and req.stream:
            raise RequestError("beam search cannot stream: its beams change until the end",
                               param="use_beam_search")
        return params

    # -- running -----------------------------------------------------------------------------
    async def run(self, request_id: str, prompt: str | None, prompt_ids: list[int],
                  params: SamplingParams, priority: int) -> AsyncIterator[RequestOutput]:
        """The request's step outputs; a prompt the scheduler could never run (too long
        for the cache) is a RequestError."""
        gen = self.engine.generate(request_id, prompt, params, prompt_token_ids=prompt_ids,
                                   priority=priority)
        try:
            async for out in gen:
                if out.error is not None and not any(c.token_ids for c in out.outputs):
                    raise RequestError(out.error, param="prompt")
                yield out
        except ValueError as e:
            raise from_value_error(e) from None
        finally:
            # Left early (client gone, an error elsewhere): the engine drops the request now.
            await gen.aclose()

    # -- output helpers ----------------------------------------------------------------------
    def token_text(self, token_id: int, as_ids: bool) -> str:
        if as_ids or self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def ranked_logprobs(self, entry: dict[int, Any], k: int,
                        as_ids: bool) -> list[tuple[str, float]]:
        """The k most likely tokens of one position, most likely first."""
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0))
        return [(self.token_text(t, as_ids), lp.logprob) for t, lp in ranked[:k]]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoiceStream:
    """Per completion: what was already sent, so each chunk carries only the new part.

    With stop strings, the last (longest stop - 1) characters are held back until the
    completion ends: the engine cuts a stop string out of the text once it is complete,
    and a prefix of it must not have been sent by then.
    """

    def __init__(self, params: SamplingParams) -> None:
        stops = params.stop or []
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent_chars = 0
        self.sent_tokens = 0
        self.done = False

    def delta(self, c: CompletionOutput) -> tuple[str, list[int], int] | None:
        """(new text, new token ids, index of the first new token) or None if nothing
        new; after the finishing delta, always None."""
        if self.done:
            return None
        finished = c.finish_reason is not None
        end = len(c.text) if finished else max(self.sent_chars, len(c.text) - self.holdback)
        new_tokens = c.token_ids_from(self.sent_tokens)
        if end <= self.sent_chars and not new_tokens and not finished:
            return None
        text = c.text[self.sent_chars:end]
        start = self.sent_tokens
        self.sent_chars = max(end, self.sent_chars)
        self.sent_tokens = start + len(new_tokens)
        self.done = finished
        return text, new_tokens, start


async def sse_stream(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """A stream's events, then ``data: [DONE]``; a failure mid-stream becomes an error
    event (the request's 400 or 500 body) before it."""
    try:
        async with aclosing(events) as it:
            async for event in it:
                yield event
    except RequestError as e:
        yield sse_data(e.body())
    except EngineError as e:
        logger.error("a streamed request failed: %s", e)
        yield sse_data(error_body(str(e), "InternalServerError", 500))
    yield DONE


async def merge(streams: Sequence[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(i, item) from several async iterators as items arrive; the first error cancels
    the rest and is raised; leaving early closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as it:
            async for item in it:
                yield 0, item
        return
    # Bounded (one item per stream): a consumer that stops reading (a client that stopped
    # reading the response) stops the pumps, so the engine's one-slot streams see their
    # outputs left unread and the stream timeout aborts the requests. Unbounded, the pumps
    # would drain the engine into this queue for as long as the requests run.
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue(
        maxsize=len(streams))
    done = object()

    async def pump(i: int, it: AsyncIterator[Any]) -> None:
        try:
            async for item in it:
                await queue.put((i, item, None))
            await queue.put((i, done, None))
        except Exception as e:  # noqa: BLE001  (re-raised by the consumer)
            await queue.put((i, None, e))

    tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
