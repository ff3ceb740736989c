"""Fixtures for the server tests: one tiny random Llama checkpoint with a tokenizer and a
chat template (session), an offline LLM on it for references, and helpers to read the
server's answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("httpx")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# tests/ is on sys.path (pytest puts the first folder without __init__.py there).
from models.helpers import make_config, make_tokenizer, save_hf_model  # noqa: E402

from entrypoints.utils import EOS, VOCAB, ServerThread, make_llm  # noqa: E402


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("server_llama")
    config = make_config("llama")  # max_position_embeddings 256: the context
    config.vocab_size = VOCAB
    config.eos_token_id = EOS
    save_hf_model(config, folder)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()


@pytest.fixture(scope="session")
def offline(model_dir: Path) -> Any:
    """An offline LLM on the same checkpoint: the reference for the server's answers."""
    return make_llm(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_llm(model_dir)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)
