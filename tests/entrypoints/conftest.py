"""Fixtures for the server tests: a server on the tiny checkpoint (``model_dir`` and the
``offline`` reference LLM live in tests/conftest.py, shared with tests/deploy), the HF
model on it, and the openai client."""

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
from entrypoints.utils import ServerThread, make_llm  # noqa: E402


@pytest.fixture(scope="session")
def hf_model(model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir)).float().eval()


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerThread]:
    with ServerThread(make_llm(model_dir)) as srv:
        yield srv


@pytest.fixture
def client(server: ServerThread) -> Any:
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)
