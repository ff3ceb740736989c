"""The OpenAI-compatible server through the official openai client and raw HTTP, on a
tiny random Llama: greedy answers equal the offline LLM (and HF transformers' greedy
generate), seeded sampling equals the offline LLM's, streams carry exactly the plain
responses' text and tokens, and the side endpoints and metrics report what happened."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
import torch

pytest.importorskip("openai")

from entrypoints.utils import EOS, MODEL_NAME, read_metrics, token_ids  # noqa: E402
import vllm_lite  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402

TIMEOUT = 60
AS_IDS = {"return_tokens_as_token_ids": True}


def _random_prompts(seed: int, lens: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=gen).tolist() for n in lens]


@torch.no_grad()
def _hf_greedy(hf_model: Any, prompt: list[int], k: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=k, pad_token_id=EOS, eos_token_id=EOS)
    tokens = out[0, len(prompt):].tolist()
    # The engine stops at EOS and keeps it; HF pads after it.
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def _metrics(server: Any) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    return read_metrics(r.text)


def _sse_events(server: Any, path: str, body: dict[str, Any]) -> list[str]:
    """The data payloads of a raw SSE response, [DONE] included."""
    events = []
    with httpx.stream("POST", server.url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                events.append(line[len("data: "):])
    return events


# -- completions ---------------------------------------------------------------------------------
def test_greedy_completions_match_offline_and_hf(client: Any, offline: Any, hf_model: Any) -> None:
    prompts = _random_prompts(1, [3, 11, 24])
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=10, logprobs=3),
                            use_tqdm=False)
    # Several token-id prompts in one request: one choice each, in prompt order.
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=10,
                                  temperature=0, logprobs=3, extra_body=AS_IDS, timeout=TIMEOUT)
    assert [c.index for c in r.choices] == [0, 1, 2]
    for choice, ref, prompt in zip(r.choices, refs, prompts):
        want = ref.outputs[0]
        ids = token_ids(choice.logprobs.tokens)
        assert ids == want.token_ids
        assert ids == _hf_greedy(hf_model, prompt, 10)
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason
        for j, tid in enumerate(ids):
            assert choice.logprobs.token_logprobs[j] == pytest.approx(want.logprobs[j][tid].logprob,
                                                                      abs=1e-4)
            top = choice.logprobs.top_logprobs[j]
            assert len(top) == 3  # greedy: the chosen token is the most likely
            assert max(top.values()) == pytest.approx(choice.logprobs.token_logprobs[j], abs=1e-6)
            ranked = sorted(want.logprobs[j].items(), key=lambda kv: kv[1].rank)[:3]
            assert sorted(top) == sorted(f"token_id:{t}" for t, _ in ranked)
    assert r.usage.prompt_tokens == sum(map(len, prompts))
    assert r.usage.completion_tokens == sum(len(o.outputs[0].token_ids) for o in refs)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("text", ["hello world", "the cat sat on the mat. café"])
def test_text_prompt_matches_offline(client: Any, offline: Any, text: str) -> None:
    ref = offline.generate(text, SamplingParams(temperature=0, max_tokens=12, logprobs=0),
                           use_tqdm=False)[0]
    r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=12, temperature=0,
                                  logprobs=0, extra_body=AS_IDS, timeout=TIMEOUT)
    assert token_ids(r.choices[0].logprobs.tokens) == ref.outputs[0].token_ids
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    echo = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=12,
                                     temperature=0, echo=True, timeout=TIMEOUT)
    assert echo.choices[0].text == text + ref.outputs[0].text
    # Echo with logprobs: the prompt's tokens come first, the first one without a logprob.
    ref = offline.generate(text, SamplingParams(temperature=0, max_tokens=4, logprobs=1,
                                                prompt_logprobs=1), use_tqdm=False)[0]
    r = client.completions.create(model=MODEL_NAME, prompt=text, max_tokens=4, temperature=0,
                                  echo=True, logprobs=1, extra_body=AS_IDS, timeout=TIMEOUT)
    lp = r.choices[0].logprobs
    prompt_ids = ref.prompt_token_ids
    assert token_ids(lp.tokens) == prompt_ids + ref.outputs[0].token_ids
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for j in range(1, len(prompt_ids)):
        want = ref.prompt_logprobs[j][prompt_ids[j]].logprob
        assert lp.token_logprobs[j] == pytest.approx(want, abs=1e-4)
        assert f"token_id:{prompt_ids[j]}" in lp.top_logprobs[j]


def test_seeded_sampling_matches_offline(client: Any, offline: Any) -> None:
    prompt = _random_prompts(2, [7])[0]
    params = dict(n=3, temperature=1.0, top_p=0.9, max_tokens=8, seed=11)
    ref = offline.generate([prompt], SamplingParams(top_k=40, ignore_eos=True, **params),
                           use_tqdm=False)[0]
    extra = {"top_k": 40, "ignore_eos": True, **AS_IDS}
    answers = []
    for _ in range(2):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, logprobs=0,
                                      extra_body=extra, timeout=TIMEOUT, **params)
        assert [c.index for c in r.choices] == [0, 1, 2]
        answers.append([token_ids(c.logprobs.tokens) for c in r.choices])
        assert all(c.finish_reason == "length" for c in r.choices)
        assert r.usage.completion_tokens == 3 * 8
    assert answers[0] == answers[1] == [c.token_ids for c in ref.outputs]
    assert len({tuple(a) for a in answers[0]}) > 1  # three samples, not one repeated


def test_beam_search_matches_offline(client: Any, offline: Any, server: Any) -> None:
    prompt = _random_prompts(6, [9])[0]
    ref = offline.generate([prompt], SamplingParams(use_beam_search=True, n=2, best_of=3,
                                                    temperature=0, max_tokens=6),
                           use_tqdm=False)[0]
    extra = {"use_beam_search": True, **AS_IDS}
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, n=2, best_of=3,
                                  temperature=0, max_tokens=6, logprobs=0, extra_body=extra,
                                  timeout=TIMEOUT)
    assert [token_ids(c.logprobs.tokens) for c in r.choices] == [c.token_ids for c in ref.outputs]
    # Beams change until the end: no streaming.
    body = {"model": MODEL_NAME, "prompt": prompt, "n": 2, "best_of": 2, "temperature": 0,
            "use_beam_search": True, "stream": True}
    bad = httpx.post(server.url + "/v1/completions", json=body, timeout=TIMEOUT)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "use_beam_search"


def _stream_completion(client: Any, **kw: Any) -> tuple[dict[int, dict[str, Any]], Any]:
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           timeout=TIMEOUT, **kw):
        if chunk.usage is not None:
            assert not chunk.choices
            usage = chunk.usage
        for c in chunk.choices:
            entry = choices.setdefault(c.index, {"text": "", "tokens": [], "finish": None})
            assert entry["finish"] is None  # nothing after the finishing chunk
            entry["text"] += c.text
            if c.logprobs is not None:
                entry["tokens"] += token_ids(c.logprobs.tokens)
            entry["finish"] = c.finish_reason
    return choices, usage


def test_streamed_completion_equals_plain(client: Any, server: Any) -> None:
    base = dict(model=MODEL_NAME, max_tokens=16, logprobs=1, extra_body={"ignore_eos": True, **AS_IDS})
    # A stop string across a chunk boundary of a greedy answer: its first character was
    # sent before the stop is complete, unless the server holds it back.
    stop = None
    for prompt in _random_prompts(3, [5, 9, 13, 17, 21, 25, 29, 33, 37, 41]):
        pieces = [chunk.choices[0].text for chunk in client.completions.create(
            prompt=prompt, temperature=0, stream=True, timeout=TIMEOUT, **base)]
        pieces = [p for p in pieces if p]
        # Not U+FFFD on either side: the random model's byte tokens can end a piece in an
        # incomplete character, which the detokenizer holds back (a stop string made of
        # held-back text is a different case than this test's).
        if len(pieces) >= 3 and "\ufffd" not in pieces[1][-1] + pieces[2][0]:
            stop = pieces[1][-1] + pieces[2][0]
            greedy = "".join(pieces)
            cut = greedy.index(stop)
            break
    assert stop is not None, "no greedy answer long enough for a stop string"

    plain = client.completions.create(prompt=prompt, temperature=0, stop=[stop], **base)
    assert plain.choices[0].text == greedy[:cut]
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].model_extra["stop_reason"] == stop

    cases = [dict(prompt=prompt, temperature=0, stop=[stop]),
             dict(prompt=[prompt, _random_prompts(5, [4])[0]], n=2, temperature=0.8, seed=5),
             dict(prompt="hello world", echo=True, temperature=0)]
    for case in cases:
        plain = client.completions.create(**base, **case)
        streamed, usage = _stream_completion(client, **base, **case)
        assert sorted(streamed) == [c.index for c in plain.choices]
        for c in plain.choices:
            assert streamed[c.index]["text"] == c.text
            assert streamed[c.index]["tokens"] == token_ids(c.logprobs.tokens)
            assert streamed[c.index]["finish"] == c.finish_reason
        assert usage.model_dump() == plain.usage.model_dump()

    events = _sse_events(server, "/v1/completions",
                         {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "stream": True})
    assert events[-1] == "[DONE]"
    assert all("choices" in json.loads(e) for e in events[:-1])


# -- chat ------------------------------------------------------------------------------------------
MESSAGES = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello world, the cat"}]


def test_chat_matches_offline_chat(client: Any, offline: Any, server: Any) -> None:
    ref = offline.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                       max_tokens=12, timeout=TIMEOUT)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    # Content as parts, and max_completion_tokens: the same request.
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in MESSAGES]
    r2 = client.chat.completions.create(model=MODEL_NAME, messages=parts, temperature=0,
                                        max_completion_tokens=12, timeout=TIMEOUT)
    assert r2.choices[0].message.content == ref.outputs[0].text
    # /tokenize applies the same template.
    tok = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES},
                     timeout=TIMEOUT).json()
    assert tok["tokens"] == ref.prompt_token_ids


def test_streamed_chat_equals_plain(client: Any) -> None:
    kw = dict(model=MODEL_NAME, messages=MESSAGES, n=2, temperature=0.9, seed=3, max_tokens=10,
              logprobs=True, top_logprobs=2, timeout=TIMEOUT, extra_body=AS_IDS)
    plain = client.chat.completions.create(**kw)
    got: dict[int, dict[str, Any]] = {}
    first_roles = set()
    usage = None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                **kw):
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            entry = got.setdefault(c.index, {"text": "", "tokens": [], "finish": None})
            if c.delta.role is not None:
                assert entry["text"] == "" and not entry["tokens"]
                first_roles.add((c.index, c.delta.role))
            entry["text"] += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                entry["tokens"] += token_ids([t.token for t in c.logprobs.content])
                assert all(len(t.top_logprobs) == 2 for t in c.logprobs.content)
            if c.finish_reason is not None:
                entry["finish"] = c.finish_reason
    assert first_roles == {(0, "assistant"), (1, "assistant")}
    for c in plain.choices:
        assert got[c.index]["text"] == c.message.content
        assert got[c.index]["tokens"] == token_ids([t.token for t in c.logprobs.content])
        assert got[c.index]["finish"] == c.finish_reason
    assert usage.model_dump() == plain.usage.model_dump()


# -- side endpoints and metrics --------------------------------------------------------------------
def test_models_health_version_tokenize(client: Any, server: Any, offline: Any) -> None:
    models = client.models.list(timeout=TIMEOUT).data
    assert [m.id for m in models] == [MODEL_NAME]
    assert models[0].model_extra["max_model_len"] == 256
    assert httpx.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    assert httpx.get(server.url + "/version", timeout=TIMEOUT).json() == {
        "version": vllm_lite.__version__}
    tokenizer = offline.get_tokenizer()
    text = "the cat sat on the mat. naïve"
    tok = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": text},
                     timeout=TIMEOUT).json()
    assert tok == {"count": len(tokenizer.encode(text)), "max_model_len": 256,
                   "tokens": tokenizer.encode(text)}
    back = httpx.post(server.url + "/detokenize", json={"tokens": tok["tokens"]},
                      timeout=TIMEOUT).json()
    assert back == {"prompt": text}


def test_metrics_count_what_was_served(client: Any, server: Any) -> None:
    before = _metrics(server)
    prompts = _random_prompts(4, [6, 14])
    r = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True}, timeout=TIMEOUT)
    after = _metrics(server)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("vllm_lite:prompt_tokens_total") == r.usage.prompt_tokens == 20
    assert delta("vllm_lite:generation_tokens_total") == r.usage.completion_tokens == 14
    assert delta('vllm_lite:request_success_total{finished_reason="length"}') == 2
    assert delta("vllm_lite:time_to_first_token_seconds_count") == 2
    assert delta("vllm_lite:e2e_request_latency_seconds_count") == 2
    # One decode step per further token, per request (nothing else ran meanwhile).
    assert delta("vllm_lite:time_per_output_token_seconds_count") == 2 * 6
    assert delta("vllm_lite:e2e_request_latency_seconds_sum") > 0
    for name in ("num_requests_running", "num_requests_waiting", "num_requests_swapped",
                 "gpu_cache_usage_perc"):
        assert after[f"vllm_lite:{name}"] == 0
    assert after["vllm_lite:gpu_cache_blocks_free"] == after["vllm_lite:gpu_cache_blocks_total"] > 0
    assert not math.isnan(after["vllm_lite:gpu_prefix_cache_hit_rate"])
