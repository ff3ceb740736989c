"""POST /tokenize and /detokenize (vLLM's extra endpoints): the server's tokenizer, and its
chat template for messages, exactly as completions and chat apply them."""

from __future__ import annotations

from vllm_lite.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vllm_lite.entrypoints.openai.serving_chat import apply_chat_template
from vllm_lite.entrypoints.openai.serving_engine import OpenAIServing, RequestError


class OpenAIServingTokenization(OpenAIServing):
    def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.check_model(req.model)
        tok = self.need_tokenizer("tokenize")
        if (req.prompt is None) == (req.messages is None):
            raise RequestError("give exactly one of prompt and messages", param="prompt")
        self.check_strings(req)
        if req.messages is not None:
            self.check_messages(req.messages)
            # Chat prompts get no special tokens beyond the template's own (as chat does).
            special = bool(req.add_special_tokens)
            _, ids = apply_chat_template(tok, req.messages, req.add_generation_prompt, special,
                                        *self.chat_template_limits)
        else:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            self.check_text(req.prompt, "prompt")
            ids = list(tok.encode(req.prompt, add_special_tokens=special))
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(req.model)
        tok = self.need_tokenizer("detokenize")
        vocab = self.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})",
                               param="tokens")
        return DetokenizeResponse(prompt=tok.decode(req.tokens))
