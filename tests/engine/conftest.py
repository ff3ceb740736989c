"""Fixtures the engine tests share."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tokenized_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (vocab 320, EOS 0) saved with a byte-level BPE tokenizer (ids
    below 300, make_tokenizer): every sampled id of text is a real token."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from models.helpers import make_config, make_tokenizer, save_hf_model

    folder = tmp_path_factory.mktemp("tokenized_llama")
    config = make_config("llama")
    config.vocab_size = 320
    config.eos_token_id = 0
    save_hf_model(config, folder)
    make_tokenizer(folder)
    return folder
