"""The OpenAI API's request and response bodies (pydantic), with vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, stop_token_ids, ignore_eos, ...).

Requests ignore fields they do not know (as vLLM does); fields the server cannot honour
(logit_bias, suffix, tools, a JSON response_format) are declared so they can be refused
with a 400 instead of being dropped silently.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Dict, List, Literal, Optional, Tuple, Union

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class OpenAIBase(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _now() -> int:
    return int(time.time())


# -- errors ------------------------------------------------------------------------------------
class ErrorInfo(OpenAIBase):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorResponse(OpenAIBase):
    error: ErrorInfo


# -- shared request parts ------------------------------------------------------------------------
class StreamOptions(OpenAIBase):
    include_usage: bool = False


class SamplingFields(OpenAIBase):
    """The sampling fields completions and chat share (OpenAI's, then vLLM's extras)."""

    model: Optional[str] = None
    n: int = 1
    best_of: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, List[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    logit_bias: Optional[Dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extras.
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    stop_token_ids: Optional[List[StrictInt]] = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    # Added / special tokens in the output text joined with spaces (vLLM's default).
    spaces_between_special_tokens: bool = True
    # Keep only the last k prompt tokens (left truncation), before the length checks.
    truncate_prompt_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    priority: int = 0
    # Logprob tokens as "token_id:<id>" rather than text (exact ids for clients).
    return_tokens_as_token_ids: bool = False
    # vLLM request fields this server does not implement. Declared (not left to
    # extra="ignore") so that a request using one is refused with a 400 naming it
    # (OpenAIServing.check_options) instead of silently getting unconstrained output.
    guided_json: Optional[Any] = None
    guided_regex: Optional[Any] = None
    guided_choice: Optional[Any] = None
    guided_grammar: Optional[Any] = None
    guided_decoding_backend: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    allowed_token_ids: Optional[Any] = None
    prompt_logprobs: Optional[Any] = None
    logits_processors: Optional[Any] = None

    # The declared-but-refused fields above; a subclass adds its own. None and False
    # (a client sending the field's off value) are accepted.
    unsupported_fields: ClassVar[Tuple[str, ...]] = (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "allowed_token_ids",
        "prompt_logprobs", "logits_processors")


class UsageInfo(OpenAIBase):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# -- completions -------------------------------------------------------------------------------
PromptField = Union[str, List[str], List[StrictInt], List[List[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: PromptField
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True


class CompletionLogProbs(OpenAIBase):
    text_offset: List[int] = Field(default_factory=list)
    token_logprobs: List[Optional[float]] = Field(default_factory=list)
    tokens: List[str] = Field(default_factory=list)
    top_logprobs: List[Optional[Dict[str, float]]] = Field(default_factory=list)


class CompletionChoice(OpenAIBase):
    index: int
    text: str
    logprobs: Optional[CompletionLogProbs] = None
    finish_reason: Optional[str] = None
    # vLLM's: the stop string or token id that ended the completion.
    stop_reason: Optional[Union[int, str]] = None


class CompletionResponse(OpenAIBase):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[CompletionChoice]
    usage: Optional[UsageInfo] = None


# -- chat --------------------------------------------------------------------------------------
class ContentPart(OpenAIBase):
    type: str
    text: Optional[str] = None


class ChatMessageParam(OpenAIBase):
    role: str
    content: Optional[Union[str, List[ContentPart]]] = None
    name: Optional[str] = None


class ResponseFormat(OpenAIBase):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: List[ChatMessageParam]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    tools: Optional[List[Dict[str, Any]]] = None
    response_format: Optional[ResponseFormat] = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    # vLLM's chat extras this server does not implement (refused, see SamplingFields);
    # tool_choice "none" / "auto" mean nothing without tools and are accepted.
    echo: Optional[Any] = None
    continue_final_message: Optional[Any] = None
    chat_template: Optional[Any] = None
    chat_template_kwargs: Optional[Any] = None
    documents: Optional[Any] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[Any] = None

    unsupported_fields: ClassVar[Tuple[str, ...]] = SamplingFields.unsupported_fields + (
        "echo", "continue_final_message", "chat_template", "chat_template_kwargs",
        "documents", "parallel_tool_calls")


class ChatMessage(OpenAIBase):
    role: str
    content: Optional[str] = None


class TopLogprob(OpenAIBase):
    token: str
    logprob: float
    bytes: Optional[List[int]] = None


class TokenLogprob(TopLogprob):
    top_logprobs: List[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(OpenAIBase):
    content: Optional[List[TokenLogprob]] = None


class ChatCompletionChoice(OpenAIBase):
    index: int
    message: ChatMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatCompletionChoice]
    usage: Optional[UsageInfo] = None


class DeltaMessage(OpenAIBase):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatCompletionStreamChoice(OpenAIBase):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChoiceLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionStreamResponse(OpenAIBase):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: List[ChatCompletionStreamChoice]
    usage: Optional[UsageInfo] = None


# -- models, tokenizer ---------------------------------------------------------------------------
class ModelCard(OpenAIBase):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vllm_lite"
    root: Optional[str] = None
    max_model_len: Optional[int] = None


class ModelList(OpenAIBase):
    object: Literal["list"] = "list"
    data: List[ModelCard]


class TokenizeRequest(OpenAIBase):
    model: Optional[str] = None
    # A prompt, or chat messages put through the chat template.
    prompt: Optional[str] = None
    messages: Optional[List[ChatMessageParam]] = None
    add_special_tokens: Optional[bool] = None
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIBase):
    count: int
    max_model_len: int
    tokens: List[int]


class DetokenizeRequest(OpenAIBase):
    model: Optional[str] = None
    tokens: List[StrictInt]


class DetokenizeResponse(OpenAIBase):
    prompt: str
