"""LLM: offline batched generation, vLLM's ``LLM`` class.

    llm = LLM("path/to/hf_folder")
    outputs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import threading
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from vllm_lite.config.args import EngineArgs
from vllm_lite.engine.llm_engine import EngineStepError, LLMEngine
from vllm_lite.entrypoints.chat_template import ChatTemplateLimits, render_chat_template
from vllm_lite.inputs import truncate_prompt
from vllm_lite.models.loader import check_folder_links
from vllm_lite.outputs import RequestOutput
from vllm_lite.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict[str, Any]
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(folder: str) -> Any:
    path = Path(folder)
    check_folder_links(path)
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        logger.info("no tokenizer in %s: token-id prompts only, outputs carry no text", folder)
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # noqa: BLE001  (a corrupt file fails in many ways: bad input)
        raise ValueError(f"cannot load the tokenizer in {folder}: {type(e).__name__}: {e}") \
            from None


class LLM:
    """Offline generation over one engine. Thread-safe: generate / chat calls from several
    threads run one after another (a lock around each call), since they share the engine's
    steps; each call gets exactly what it would get alone.

    ``LLM(model, **options)``: the options are ``EngineArgs``' fields, with its defaults
    (block_size, max_num_seqs, dtype, swap_space, scheduling_policy, max_logprobs, ...);
    an unknown one is a TypeError, a bad value a ValueError naming it."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        # The options and their defaults are EngineArgs' fields (vllm_lite/config.py), the
        # one place they are written; __signature__ below shows them to help() and IDEs.
        self.engine_args = EngineArgs.from_kwargs(model=str(model), **kwargs)
        self.config = self.engine_args.create_engine_config()
        model_config = self.config.model_config
        self.tokenizer = _load_tokenizer(model_config.tokenizer)
        self.llm_engine = LLMEngine(self.config, tokenizer=self.tokenizer)
        self._template_limits = ChatTemplateLimits(model_config.chat_template_timeout,
                                                   model_config.chat_template_max_chars)
        self._template_name = model_config.tokenizer
        self._counter = itertools.count()
        # One caller at a time drives the engine: two threads stepping it at once would
        # mix their batches (and each would drop the other's finished outputs).
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        """Stops the engine's tensor-parallel worker processes (if any); the LLM cannot
        generate afterwards. Also done when the LLM is garbage-collected or Python exits."""
        self.llm_engine.shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- inputs ------------------------------------------------------------------------------
    def _parse_prompts(self, prompts: Any) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, (str, dict)):
            items: Sequence[Any] = [prompts]
        elif isinstance(prompts, (list, tuple)):
            if not prompts:
                raise ValueError("no prompts given")
            # A flat list of ints is one tokenized prompt.
            items = [list(prompts)] if all(isinstance(p, int) for p in prompts) else prompts
        else:
            raise ValueError(f"prompts must be str, list[str], list[int] or list[list[int]], "
                             f"got {type(prompts).__name__}")
        parsed = []
        for p in items:
            if isinstance(p, dict):
                if "prompt_token_ids" in p:
                    p = list(p["prompt_token_ids"])
                elif "prompt" in p:
                    p = p["prompt"]
                else:
                    raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            if isinstance(p, str):
                if not p:
                    raise ValueError("the prompt is empty")
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer (none in the model folder); "
                                     "pass token ids")
                parsed.append((p, list(self.tokenizer.encode(p))))
            elif isinstance(p, (list, tuple)):
                parsed.append((None, list(p)))
            else:
                raise ValueError(f"a prompt must be a str or a list of token ids, got {p!r}")
        return parsed  # checked by _admit_prompts, once truncated

    def _admit_prompts(self, parsed: list[tuple[str | None, list[int]]],
                       params: list[SamplingParams]) -> list[tuple[str | None, list[int]]]:
        # truncate_prompt_tokens: the last k tokens, before the length check, as
        # vLLM does; the server calls the same helper (vllm_lite.inputs.truncate_prompt).
        admitted = [truncate_prompt(text, ids, p.truncate_prompt_tokens, self.tokenizer,
                                    p.spaces_between_special_tokens)
                    for (text, ids), p in zip(parsed, params)]
        for _, ids in admitted:
            self.llm_engine.admission.prompt(ids)
        return admitted

    def _params_list(self, sampling_params: Any, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            params = [SamplingParams()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"{len(params)} sampling params for {n} prompts")
        for p in params:
            self.llm_engine.admission.params(p)
        return params

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts: Any, sampling_params: Any = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Completes every prompt; the outputs come back in input order."""
        with self._lock:
            parsed = self._parse_prompts(prompts)
            params = self._params_list(sampling_params, len(parsed))
            parsed = self._admit_prompts(parsed, params)
            return self._run(parsed, params, use_tqdm)

    def chat(self, messages: Any, sampling_params: Any = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """One conversation (list of {"role", "content"}) or a list of them, through the
        tokenizer's chat template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (none in the model folder)")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(or a list of such lists)")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        for conv in conversations:
            if not isinstance(conv, (list, tuple)) or not conv or \
                    not all(isinstance(m, dict) for m in conv):
                raise ValueError("each conversation must be a non-empty list of "
                                 "{'role', 'content'} dicts")
        with self._lock:
            prompts = []
            for conv in conversations:
                text = render_chat_template(self.tokenizer, conv, add_generation_prompt,
                                            self._template_limits, self._template_name)
                prompts.append((text, list(self.tokenizer.encode(text, add_special_tokens=False))))
            params = self._params_list(sampling_params, len(prompts))
            prompts = self._admit_prompts(prompts, params)
            return self._run(prompts, params, use_tqdm)

    def _run(self, parsed: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        ids = []
        results: dict[str, RequestOutput] = {}
        # Only finished outputs are kept: the engine builds no others (one copy per
        # distinct params object, the caller's left as they are).
        final: dict[int, SamplingParams] = {}
        for p in params:
            if id(p) not in final:
                final[id(p)] = dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY)
        params = [final[id(p)] for p in params]
        try:
            for (text, tokens), p in zip(parsed, params):
                rid = str(next(self._counter))
                engine.add_request(rid, text, p, prompt_token_ids=tokens)
                ids.append(rid)
            wanted = set(ids)
            failed: set = set()
            bar = None
            if use_tqdm:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
            try:
                while len(results) < len(ids):
                    if not engine.has_unfinished_requests():
                        raise RuntimeError("the engine stopped with requests unfinished")
                    try:
                        step_outputs = engine.step()
                    except EngineStepError as e:
                        # Only the requests that broke the step failed; their outputs
                        # carry the error, and every other prompt goes on. When every
                        # prompt of this call failed there is nothing to return: raise.
                        failed.update(r for r in e.request_ids if r in wanted)
                        if failed == wanted:
                            raise
                        logger.error("request(s) %s failed: %r", ", ".join(e.request_ids),
                                     e.cause)
                        step_outputs = e.outputs
                    for out in step_outputs:
                        if out.finished and out.request_id in wanted:
                            results[out.request_id] = out
                            if bar is not None:
                                bar.update(1)
            finally:
                if bar is not None:
                    bar.close()
        except BaseException:
            # Leave the engine serving: drop what this call queued.
            engine.abort_request([r for r in ids if r not in results])
            raise
        return [results[r] for r in ids]


def _llm_signature() -> inspect.Signature:
    """LLM.__init__'s signature as the engine options make it: model, then each option as a
    keyword with its EngineArgs default."""
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
              inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                annotation=str)]
    for f in dataclasses.fields(EngineArgs):
        if f.name != "model":
            params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                            default=f.default, annotation=f.type))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _llm_signature()  # type: ignore[attr-defined]
