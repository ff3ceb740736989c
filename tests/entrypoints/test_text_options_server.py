"""spaces_between_special_tokens and truncate_prompt_tokens through the server,
with the official openai client: a truncated prompt gives what its last k tokens give
offline (and counts k prompt tokens); output text and echo follow the spacing flag as
vLLM's rule gives it (an independent token-string reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterator

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from entrypoints.utils import MODEL_NAME, ServerThread, make_llm, token_ids  # noqa: E402
from models.helpers import make_config, save_hf_model  # noqa: E402
from models.text_tokenizers import (  # noqa: E402
    NUM_WORDS, VOCAB, make_word_tokenizer, reference_decode)
from vllm_lite import SamplingParams  # noqa: E402

TIMEOUT = 60
AS_IDS = {"return_tokens_as_token_ids": True}
CONTEXT = 256
# A high temperature flattens the random model's distribution, so samples spread over the
# whole vocabulary, added tokens included.
HOT = 50.0


def _ids(seed: int, n: int) -> list[int]:
    return torch.randint(1, 280, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# -- truncate_prompt_tokens (the shared byte-level checkpoint) ----------------------------------
def test_completion_truncation_equals_the_tail(client: Any, offline: Any) -> None:
    prompt = _ids(3, 40)
    for k in (1, 9):
        r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6,
                                      temperature=0, logprobs=1, timeout=TIMEOUT,
                                      extra_body={"truncate_prompt_tokens": k, **AS_IDS})
        want = offline.generate(prompt[-k:], SamplingParams(temperature=0, max_tokens=6),
                                use_tqdm=False)[0].outputs[0]
        c = r.choices[0]
        assert token_ids(c.logprobs.tokens) == want.token_ids
        assert c.text == want.text
        assert r.usage.prompt_tokens == k


def test_truncation_admits_a_prompt_longer_than_the_context(client: Any, offline: Any) -> None:
    prompt = _ids(4, CONTEXT + 40)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                  temperature=0, timeout=TIMEOUT)
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                  temperature=0, timeout=TIMEOUT,
                                  extra_body={"truncate_prompt_tokens": 50})
    want = offline.generate(prompt[-50:], SamplingParams(temperature=0, max_tokens=4),
                            use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text and r.usage.prompt_tokens == 50
    # Without max_tokens the room left is computed from the truncated prompt.
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=None,
                                  temperature=0, timeout=TIMEOUT, stop=None,
                                  extra_body={"truncate_prompt_tokens": CONTEXT - 2,
                                              "ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_truncated_text_prompt_echo_and_stream(client: Any, offline: Any) -> None:
    tok = offline.get_tokenizer()
    text = "hello world, the cat sat on the mat"
    kept = tok.encode(text)[-5:]
    kw = dict(model=MODEL_NAME, prompt=text, max_tokens=5, temperature=0, timeout=TIMEOUT,
              extra_body={"truncate_prompt_tokens": 5})
    r = client.completions.create(echo=True, **kw)
    want = offline.generate(kept, SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0]
    # The echo is the text the model saw: the kept tokens'.
    assert r.choices[0].text == tok.decode(kept) + want.text
    assert r.usage.prompt_tokens == 5
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == want.text


def test_chat_truncation_equals_the_tail(client: Any, offline: Any) -> None:
    tok = offline.get_tokenizer()
    messages = [{"role": "user", "content": "hello world, the cat sat on the mat"}]
    templated = tok.encode(tok.apply_chat_template(messages, tokenize=False,
                                                   add_generation_prompt=True),
                           add_special_tokens=False)
    r = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=5,
                                       temperature=0, timeout=TIMEOUT,
                                       extra_body={"truncate_prompt_tokens": 6})
    want = offline.generate(templated[-6:], SamplingParams(temperature=0, max_tokens=5),
                            use_tqdm=False)[0].outputs[0]
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == 6


def test_bad_truncate_prompt_tokens_names_the_field(client: Any) -> None:
    for bad in (0, -1, True, 1.5, "4"):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2,
                                      timeout=TIMEOUT, extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens", e.value.body
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL_NAME, max_tokens=2, timeout=TIMEOUT,
                                           messages=[{"role": "user", "content": "hi"}],
                                           extra_body={"truncate_prompt_tokens": bad})
        assert e.value.body["param"] == "truncate_prompt_tokens", e.value.body


def test_stream_options_without_stream_is_refused(client: Any) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL_NAME, prompt=[1, 2, 3], max_tokens=2,
                                  timeout=TIMEOUT, stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"


def test_off_values_of_refused_fields_are_accepted(client: Any) -> None:
    """A client sending a refused field's off value (null, false, tool_choice "none")
    asks for nothing the server lacks."""
    r = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        timeout=TIMEOUT, tool_choice="none",
        extra_body={"echo": False, "guided_json": None, "continue_final_message": False})
    assert r.choices[0].finish_reason in ("length", "stop")


# -- spaces_between_special_tokens (a word-level checkpoint with added tokens) ------------------
@pytest.fixture(scope="module")
def word_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    folder: Path = tmp_path_factory.mktemp("word_server")
    config = make_config("llama")
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    save_hf_model(config, folder)
    make_word_tokenizer(folder)
    # The references come from a second engine: an engine has one driver, and the served
    # one's thread may still be stepping when a response has arrived (CI saw an offline
    # generate on the served LLM step concurrently with it and break the scheduler).
    offline = make_llm(folder, kv_cache_space=0.02)
    with ServerThread(make_llm(folder, kv_cache_space=0.02)) as srv:
        yield srv, offline


@pytest.mark.parametrize("skip,spaces", [(False, True), (False, False), (True, True),
                                         (True, False)])
def test_completion_text_follows_spacing_flags(word_server: Any, skip: bool,
                                               spaces: bool) -> None:
    srv, llm = word_server
    tok = llm.get_tokenizer()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT)
    prompt = tok.encode("w4 <p1> w8 <s3> w9")
    flags = {"skip_special_tokens": skip, "spaces_between_special_tokens": spaces,
             "ignore_eos": True}
    kw = dict(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=HOT, seed=21,
              logprobs=0, timeout=TIMEOUT)
    r = client.completions.create(echo=True, extra_body={**flags, **AS_IDS}, **kw)
    c = r.choices[0]
    ids = token_ids(c.logprobs.tokens)[len(prompt):]
    assert sum(t >= NUM_WORDS for t in ids) >= 3  # the flag has added tokens to act on
    echo = reference_decode(tok, prompt, False, spaces)  # an echo keeps special tokens
    full = reference_decode(tok, prompt + ids, skip, spaces)
    head = reference_decode(tok, prompt, skip, spaces)
    assert c.text == echo + full[len(head):]
    offline = llm.generate(prompt, SamplingParams(temperature=HOT, seed=21, max_tokens=24,
                                                  **flags), use_tqdm=False)[0].outputs[0]
    assert offline.token_ids == ids and c.text == echo + offline.text
    # Streamed: the same text, chunk by chunk.
    kw.pop("logprobs")
    streamed = "".join(ch.choices[0].text for ch in client.completions.create(
        stream=True, extra_body=flags, **kw) if ch.choices)
    assert streamed == offline.text
    # Chat takes the field too.
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "w4 <p1> w8"}], max_tokens=24,
        temperature=HOT, seed=21, timeout=TIMEOUT, extra_body=flags)
    conv = [{"role": "user", "content": "w4 <p1> w8"}]
    want = llm.chat(conv, SamplingParams(temperature=HOT, seed=21, max_tokens=24, **flags),
                    use_tqdm=False)[0].outputs[0]
    assert chat.choices[0].message.content == want.text


def test_spacing_flag_must_be_a_bool(word_server: Any) -> None:
    srv, _ = word_server
    r = httpx.post(srv.url + "/v1/completions", timeout=TIMEOUT,
                   json={"prompt": [2, 3], "max_tokens": 2,
                         "spaces_between_special_tokens": "maybe"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "spaces_between_special_tokens"
