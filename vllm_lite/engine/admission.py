"""Request admission: the one validator of a request, shared by ``LLM``, the OpenAI server
and ``LLMEngine.add_request``.

    params(p)            SamplingParams against the engine: n / best_of vs max_num_seqs (and
                         a server's own cap), logprobs vs max_logprobs, beam search's limits
    prompt(ids)          non-empty, ints, inside the vocabulary, within max_model_len
    fits(len, p)         best_of sequences of prompt + max_tokens fit the KV cache at once
    priority(v)          an int; non-zero only under the priority policy
    admit(...)           all of them, after tokenizing and truncate_prompt_tokens

Bad input is a ``ValueError`` naming the field (the server answers 400 with it) and
changes nothing: the scheduler gets only admitted requests, and what it then checks are
invariants (``InternalError``). ``LLM`` and the server call the parts early, to refuse a
whole batch or name the request field before anything runs; ``add_request`` admits every
request it queues.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from vllm_lite.config.schema import EngineConfig
from vllm_lite.inputs import truncate_prompt
from vllm_lite.sampling_params import SamplingParams


class Admission:
    """The checks of one engine's requests. ``usable_blocks()``: the KV blocks one request
    may hold at once (known once the cache is sized); ``block_size``: tokens per block."""

    def __init__(self, config: EngineConfig, block_size: int,
                 usable_blocks: Callable[[], int], tokenizer: Any = None) -> None:
        self.model_config = config.model_config
        self.scheduler_config = config.scheduler_config
        self.block_size = block_size
        self.usable_blocks = usable_blocks
        self.tokenizer = tokenizer

    def admit(self, prompt: str | None, prompt_token_ids: Sequence[int] | None,
              params: SamplingParams | None, priority: int = 0
              ) -> tuple[str | None, list[int], SamplingParams]:
        """(prompt text, prompt ids, params) of a valid request: a text prompt is tokenized
        (needs a tokenizer), truncate_prompt_tokens applied before the length checks."""
        params = params if params is not None else SamplingParams()
        self.params(params)
        if prompt_token_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or prompt_token_ids")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass prompt_token_ids")
            prompt_token_ids = self.tokenizer.encode(prompt)
        # truncate_prompt_tokens before the length check, as vLLM; LLM and the server apply
        # it earlier to check whole requests first, and truncating again changes nothing.
        prompt, ids = truncate_prompt(prompt, list(prompt_token_ids),
                                      params.truncate_prompt_tokens, self.tokenizer,
                                      params.spaces_between_special_tokens)
        self.prompt(ids)
        self.fits(len(ids), params)
        self.priority(priority)
        return prompt, ids, params

    def params(self, params: SamplingParams, max_n: int | None = None) -> None:
        """What SamplingParams cannot check alone: the engine's limits and support.
        ``max_n``: a server's own cap on n and best_of (below max_num_seqs)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be SamplingParams, got {type(params).__name__}")
        if max_n is not None:
            for name in ("n", "best_of"):
                value = getattr(params, name)
                if value > max_n:
                    raise ValueError(f"{name} must be at most {max_n} on this server, "
                                     f"got {value}")
        params.verify_max_n(self.scheduler_config.max_num_seqs)
        params.verify_max_logprobs(self.model_config.max_logprobs)
        if params.use_beam_search and params.stop:
            # Beams are ranked before they are detokenized; stop tokens work.
            raise ValueError("stop strings are not supported with beam search; use stop_token_ids")

    def prompt(self, ids: Sequence[int]) -> None:
        mc = self.model_config
        if not ids:
            raise ValueError("the prompt is empty")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError("prompt token ids must be ints")
        bad = [t for t in ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {mc.vocab_size})")
        if len(ids) > mc.max_model_len:
            raise ValueError(
                f"prompt length {len(ids)} is longer than max_model_len {mc.max_model_len}")

    def fits(self, prompt_len: int, params: SamplingParams) -> None:
        """A request whose sequences could never all be in the KV cache at once (best_of
        of them, each up to prompt + max_tokens tokens, sharing the prompt's full blocks)
        is refused: it would otherwise run until the cache is full and end early."""
        if params.max_tokens is None:
            return  # runs to max_model_len; the scheduler preempts or ends it there
        bs = self.block_size
        total = prompt_len + params.max_tokens
        shared = prompt_len // bs
        per_seq = -(-total // bs) - shared
        needed = shared + params.best_of * per_seq
        usable = self.usable_blocks()
        if needed > usable:
            what = (f"n={params.n}" if params.best_of == params.n
                    else f"best_of={params.best_of}")
            raise ValueError(
                f"max_tokens {params.max_tokens} with {what} and a {prompt_len}-token prompt "
                f"needs {needed} KV blocks at once, more than the cache's {usable} "
                f"({bs} tokens each); lower max_tokens or n")

    def priority(self, priority: int) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an int, got {priority!r}")
        policy = self.scheduler_config.scheduling_policy
        if priority != 0 and policy != "priority":
            raise ValueError(f"priority {priority} needs the priority scheduling policy; this "
                             f"engine schedules {policy!r}")
