"""Refusals and failures: bad requests are 400s with an OpenAI error body and never reach
the engine; the API key guards every endpoint but /health; an engine failure is a 500 (an
error event in a stream) for the request it hit, and the server keeps serving."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any
from collections.abc import Iterator

import httpx
import pytest
import torch

from entrypoints.utils import (  # noqa: E402
    MODEL_NAME, VOCAB, ServerThread, fail_steps_with, make_llm, read_metrics)
from vllm_lite.entrypoints.openai.api_server import ServerConfig  # noqa: E402

TIMEOUT = 30
MAX_N = 4
CONTEXT = 256  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def guarded(model_dir: Path) -> Iterator[dict[str, Any]]:
    """A server whose engine counts the requests that reach it."""
    llm = make_llm(model_dir)
    engine = llm.llm_engine
    added: list[str] = []
    add_request = engine.add_request

    def counting_add_request(request_id: str, *args: Any, **kw: Any) -> Any:
        added.append(request_id)
        return add_request(request_id, *args, **kw)

    engine.add_request = counting_add_request
    config = ServerConfig(served_model_name=MODEL_NAME, max_n=MAX_N)
    with ServerThread(llm, config) as srv:
        yield {"server": srv, "added": added, "engine": engine}


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(1, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _completion(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": _prompt(8), "max_tokens": 4}
    body.update(kw)
    return {k: v for k, v in body.items() if v is not _DROP}


def _chat(**kw: Any) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4}
    body.update(kw)
    return body


_DROP = object()

BAD_COMPLETIONS = {
    "unknown_model": (_completion(model="gpt-4"), "model"),
    "empty_text": (_completion(prompt=""), "prompt"),
    "empty_ids": (_completion(prompt=[]), "prompt"),
    "missing_prompt": (_completion(prompt=_DROP), "prompt"),
    "prompt_not_ids": (_completion(prompt=[1, "a", 2]), "prompt"),
    "bool_token": (_completion(prompt=[1, True, 2]), "prompt"),
    "over_context": (_completion(prompt=_prompt(CONTEXT + 1)), "prompt"),
    "token_outside_vocab": (_completion(prompt=[5, VOCAB, 7]), "prompt"),
    "negative_token": (_completion(prompt=[5, -1, 7]), "prompt"),
    "one_bad_prompt_of_two": (_completion(prompt=[[1, 2], [VOCAB + 5]]), "prompt"),
    "negative_temperature": (_completion(temperature=-0.5), "temperature"),
    "top_p_zero": (_completion(top_p=0.0), "top_p"),
    "top_k_zero": (_completion(top_k=0), "top_k"),
    "presence_penalty": (_completion(presence_penalty=3.0), "presence_penalty"),
    "repetition_penalty": (_completion(repetition_penalty=0.0), "repetition_penalty"),
    "n_not_int": (_completion(n=1.5), "n"),
    "n_zero": (_completion(n=0, temperature=1.0), "n"),
    "n_above_cap": (_completion(n=MAX_N + 1, temperature=1.0), "n"),
    "best_of_above_cap": (_completion(n=1, best_of=MAX_N + 1, temperature=1.0), "best_of"),
    "best_of_below_n": (_completion(n=3, best_of=2, temperature=1.0), "best_of"),
    "greedy_n": (_completion(n=2, temperature=0), "n"),
    "max_tokens_zero": (_completion(max_tokens=0), "max_tokens"),
    "max_tokens_over_context": (_completion(prompt=_prompt(10), max_tokens=CONTEXT - 9),
                                "max_tokens"),
    "min_tokens_over_max": (_completion(min_tokens=9, max_tokens=4), "min_tokens"),
    "logprobs_too_many": (_completion(logprobs=21), "logprobs"),
    "logprobs_negative": (_completion(logprobs=-1), "logprobs"),
    "stop_empty_string": (_completion(stop=[""]), "stop"),
    "stop_not_strings": (_completion(stop=[1, 2]), "stop"),
    "stop_token_negative": (_completion(stop_token_ids=[-3]), "stop_token_ids"),
    "logit_bias": (_completion(logit_bias={"5": 10}), "logit_bias"),
    "suffix": (_completion(suffix="end"), "suffix"),
    "seed_not_int": (_completion(seed="abc"), "seed"),
    "stream_best_of": (_completion(stream=True, n=1, best_of=2, temperature=1.0), "best_of"),
    "truncate_zero": (_completion(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    "truncate_negative": (_completion(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
    "truncate_bool": (_completion(truncate_prompt_tokens=True), "truncate_prompt_tokens"),
    "truncate_float": (_completion(truncate_prompt_tokens=2.0), "truncate_prompt_tokens"),
    "truncate_str": (_completion(truncate_prompt_tokens="2"), "truncate_prompt_tokens"),
    # Truncated to more than fits: still too long.
    "truncate_over_context": (_completion(prompt=_prompt(CONTEXT + 5),
                                          truncate_prompt_tokens=CONTEXT + 1), "prompt"),
    "spaces_not_bool": (_completion(spaces_between_special_tokens="sometimes"),
                        "spaces_between_special_tokens"),
    "stream_options_without_stream": (_completion(stream_options={"include_usage": True}),
                                      "stream_options"),
    # vLLM's extras this server does not implement: refused, not dropped.
    "guided_json": (_completion(guided_json={"type": "object"}), "guided_json"),
    "guided_choice": (_completion(guided_choice=["a", "b"]), "guided_choice"),
    "prompt_logprobs": (_completion(prompt_logprobs=1), "prompt_logprobs"),
    "allowed_token_ids": (_completion(allowed_token_ids=[1, 2]), "allowed_token_ids"),
}

BAD_CHATS = {
    "unknown_model": (_chat(model="other"), "model"),
    "no_messages": (_chat(messages=[]), "messages"),
    "image_part": (_chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]), "messages"),
    "message_not_object": (_chat(messages=["hello"]), "messages"),
    "max_completion_tokens_over": (_chat(max_completion_tokens=CONTEXT), "max_completion_tokens"),
    "top_logprobs_without_logprobs": (_chat(top_logprobs=2), "top_logprobs"),
    "top_logprobs_too_many": (_chat(logprobs=True, top_logprobs=50), "top_logprobs"),
    "tools": (_chat(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    "json_format": (_chat(response_format={"type": "json_object"}), "response_format"),
    "n_above_cap": (_chat(n=MAX_N + 1, temperature=1.0), "n"),
    "truncate_zero": (_chat(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    "truncate_bool": (_chat(truncate_prompt_tokens=False), "truncate_prompt_tokens"),
    "truncate_float": (_chat(truncate_prompt_tokens=1.5), "truncate_prompt_tokens"),
    "spaces_not_bool": (_chat(spaces_between_special_tokens=[True]),
                        "spaces_between_special_tokens"),
    "stream_options_without_stream": (_chat(stream_options={"include_usage": False}),
                                      "stream_options"),
    "guided_regex": (_chat(guided_regex="a+"), "guided_regex"),
    "echo": (_chat(echo=True), "echo"),
    "continue_final_message": (_chat(continue_final_message=True), "continue_final_message"),
    "chat_template": (_chat(chat_template="{{ messages }}"), "chat_template"),
    "chat_template_kwargs": (_chat(chat_template_kwargs={"enable_thinking": False}),
                             "chat_template_kwargs"),
    "tool_choice_required": (_chat(tool_choice="required"), "tool_choice"),
    "parallel_tool_calls": (_chat(parallel_tool_calls=True), "parallel_tool_calls"),
}


def _assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["message"]
    assert err["type"] == {400: "BadRequestError", 401: "AuthenticationError",
                           404: "NotFoundError", 500: "InternalServerError"}[status]
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_REQUESTS = [("/v1/completions", name, *case) for name, case in BAD_COMPLETIONS.items()] + \
    [("/v1/chat/completions", name, *case) for name, case in BAD_CHATS.items()]


@pytest.mark.parametrize("path,case,body,param", BAD_REQUESTS,
                         ids=[f"{p.rsplit('/', 1)[1]}-{c}" for p, c, _, _ in BAD_REQUESTS])
def test_bad_request_is_400(guarded: dict[str, Any], path: str, case: str,
                            body: dict[str, Any], param: str) -> None:
    before = list(guarded["added"])
    r = httpx.post(guarded["server"].url + path, json=body, timeout=TIMEOUT)
    _assert_error(r, 400, param)
    assert guarded["added"] == before  # never reached the engine


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"", b'"a string"'])
def test_malformed_body_is_400(guarded: dict[str, Any], payload: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
        r = httpx.post(guarded["server"].url + path, content=payload,
                       headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
        _assert_error(r, 400)


def test_other_endpoints_refuse_bad_input(guarded: dict[str, Any]) -> None:
    url = guarded["server"].url
    _assert_error(httpx.post(url + "/detokenize", json={"tokens": [1, VOCAB]}, timeout=TIMEOUT),
                  400, "tokens")
    _assert_error(httpx.post(url + "/tokenize", json={"model": "x", "prompt": "a"},
                             timeout=TIMEOUT), 400, "model")
    _assert_error(httpx.post(url + "/tokenize", json={}, timeout=TIMEOUT), 400, "prompt")
    _assert_error(httpx.get(url + "/v1/nothing-here", timeout=TIMEOUT), 404)


def test_refusals_leave_the_engine_serving(guarded: dict[str, Any]) -> None:
    """After all the refusals above (and now), a good request is served and every block
    is free; the only requests the engine ever saw are the good ones."""
    url = guarded["server"].url
    before = list(guarded["added"])
    r = httpx.post(url + "/v1/completions", json=_completion(max_tokens=5, ignore_eos=True),
                   timeout=TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert len(guarded["added"]) == len(before) + 1
    m = read_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
    assert m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"]
    assert m["vllm_lite:num_requests_running"] == m["vllm_lite:num_requests_waiting"] == 0


# -- API key ----------------------------------------------------------------------------------------
def test_api_key(model_dir: Path) -> None:
    openai = pytest.importorskip("openai")
    key = "sk-test-" + "x" * 20
    config = ServerConfig(served_model_name=MODEL_NAME, api_key=key)
    with ServerThread(make_llm(model_dir), config) as srv:
        url = srv.url
        assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
        # Routers poll the load without credentials.
        assert httpx.get(url + "/get_load", timeout=TIMEOUT).json() == {"load": 0}
        for method, path in [("GET", "/v1/models"), ("GET", "/metrics"), ("GET", "/version"),
                             ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("POST", "/tokenize"), ("POST", "/detokenize")]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": key},
                            {"Authorization": f"Bearer {key}x"}):
                r = httpx.request(method, url + path, headers=headers, json={}, timeout=TIMEOUT)
                _assert_error(r, 401)
        ok = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"},
                       timeout=TIMEOUT)
        assert ok.status_code == 200
        good = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=TIMEOUT)
        r = good.completions.create(model=MODEL_NAME, prompt=_prompt(5), max_tokens=3,
                                    temperature=0)
        assert r.usage.completion_tokens >= 1
        bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0, timeout=TIMEOUT)
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL_NAME, prompt=_prompt(5), max_tokens=3)


def test_config_is_validated() -> None:
    for bad in (dict(port=70000), dict(max_n=0), dict(api_key=""), dict(max_logprobs=True)):
        with pytest.raises(ValueError):
            ServerConfig(**bad)


# -- engine failures --------------------------------------------------------------------------------
POISON = 300  # a prompt holding this token (never in _prompt) makes the model runner fail


@pytest.fixture(scope="module")
def faulty(model_dir: Path) -> Iterator[ServerThread]:
    llm = make_llm(model_dir)
    fail_steps_with(llm, POISON)
    with ServerThread(llm) as srv:
        yield srv


def _wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(httpx.get(url + "/metrics", timeout=TIMEOUT).text)
        idle = (m["vllm_lite:num_requests_running"] == m["vllm_lite:num_requests_waiting"] == 0
                and m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"])
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_engine_failure_is_500_for_that_request_only(faulty: ServerThread) -> None:
    url = faulty.url
    poisoned = [3, POISON, 4]
    r = httpx.post(url + "/v1/completions", json=_completion(prompt=poisoned), timeout=TIMEOUT)
    err = _assert_error(r, 500)
    assert "injected failure" in err["message"]
    r = httpx.post(url + "/v1/chat/completions",
                   json=_chat(messages=[{"role": "user", "content": "hi"}],
                              stop_token_ids=[1]), timeout=TIMEOUT)
    assert r.status_code == 200, r.text  # the server goes on serving

    # A stream: an error event, then [DONE].
    with httpx.stream("POST", url + "/v1/completions",
                      json=_completion(prompt=poisoned, stream=True), timeout=TIMEOUT) as s:
        assert s.status_code == 200
        events = [line[len("data: "):] for line in s.iter_lines() if line]
    assert events[-1] == "[DONE]"
    assert "injected failure" in json.loads(events[-2])["error"]["message"]

    good = httpx.post(url + "/v1/completions", json=_completion(max_tokens=6, ignore_eos=True),
                      timeout=TIMEOUT)
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 6
    m = _wait_idle(url)
    assert m["vllm_lite:gpu_cache_blocks_free"] == m["vllm_lite:gpu_cache_blocks_total"]
    assert m['vllm_lite:request_success_total{finished_reason="error"}'] == 2
    assert httpx.get(url + "/health", timeout=TIMEOUT).status_code == 200
