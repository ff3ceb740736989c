"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, ...).

Requests ignore fields they do not know (as vLLM does); fields the server cannot honour
(logit_bias, suffix, tools, a JSON response_format) are declared so they can be refused
with a 400 instead of being dropped silently.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _now() -> int:
    return int(time.time())


# -- errors ------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo


# -- shared request parts ------------------------------------------------------------------------
class StreamOptions(OpenAIBase):
    include_usage: bool = False


class SamplingFields(OpenAIBase):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: int = 1
    best_of: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # Added / special tokens in the output text joined with spaces (vLLM's default).
    spaces_between_special_tokens: bool = True
    # Keep only the last k prompt tokens (left truncation), before the length checks.
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=1)
    priority: int = 0
    # Logprob tokens as "token_id:<id>" rather than text (exact ids for clients).
    return_tokens_as_token_ids: bool = False
    # vLLM request fields this server does not implement. Declared (not left to
    # extra="ignore") so that a request using one is refused with a 400 naming it
    # (OpenAIServing.check_options) instead of silently getting unconstrained output.
    guided_json: Any | None = None
    guided_regex: Any | None = None
    guided_choice: Any | None = None
    guided_grammar: Any | None = None
    guided_decoding_backend: Any | None = None
    guided_whitespace_pattern: Any | None = None
    allowed_token_ids: Any | None = None
    prompt_logprobs: Any | None = None
    logits_processors: Any | None = None

    # The declared-but-refused fields above; a subclass adds its own. None and False
    # (a client sending the field's off value) are accepted.
    unsupported_fields: ClassVar[tuple[str, ...]] = (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "allowed_token_ids",
        "prompt_logprobs", "logits_processors")


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# -- completions -------------------------------------------------------------------------------
PromptField = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBase):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or token id that ended the completion.
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- chat --------------------------------------------------------------------------------------
class ContentPart(OpenAIBase):
    type: str
    text: str | None = None


class ChatMessageParam(OpenAIBase):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(OpenAIBase):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # vLLM's chat extras this server does not implement (refused, see SamplingFields);
    # tool_choice "none" / "auto" mean nothing without tools and are accepted.
    echo: Any | None = None
    continue_final_message: Any | None = None
    chat_template: Any | None = None
    chat_template_kwargs: Any | None = None
    documents: Any | None = None
    tool_choice: Any | None = None
    parallel_tool_calls: Any | None = None

    unsupported_fields: ClassVar[tuple[str, ...]] = SamplingFields.unsupported_fields + (
        "echo", "continue_final_message", "chat_template", "chat_template_kwargs",
        "documents", "parallel_tool_calls")


class ChatMessage(OpenAIBase):
    role: str
    content: str | None = None


class TopLogprob(OpenAIBase):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIBase):
    content: list[TokenLogprob] | None = None


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None


class DeltaMessage(OpenAIBase):
    role: str | None = None
    content: str | None = None


class ChatCompletionStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# -- models, tokenizer ---------------------------------------------------------------------------
class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllm_lite"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIBase):
    model: str | None = None
    # A prompt, or chat messages put through the chat template.
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBase):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(OpenAIBase):
    prompt: str
