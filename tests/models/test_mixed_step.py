"""A mixed prompt step (new prompts batched with one-token decodes over a cached context,
as the scheduler builds when a request joins running ones) against HF transformers'
float32 logits: the decode rows go through the paged-attention kernel in one call, the
prompt rows through SDPA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from .helpers import PagedCache, hf_logits, make_config, make_step, save_hf_model  # noqa: E402
from vllm_lite.layers.attention import attention_metadata  # noqa: E402
from vllm_lite.models import load_model  # noqa: E402


@pytest.mark.parametrize("name", ["llama", "qwen3"])  # joint q/k rotary; separate (qk-norm)
def test_mixed_prompt_and_decode_rows_match_hf(tmp_path: Path, name: str) -> None:
    hf_model = save_hf_model(make_config(name), tmp_path)
    model, config = load_model(tmp_path)
    gen = torch.Generator().manual_seed(11)
    lens = {0: 9, 1: 7, 2: 13, 3: 1, 4: 4}  # 0 and 2 decode; 1, 3 (one token), 4 prompt
    full = {i: torch.randint(0, config.vocab_size, (n + 3,), generator=gen)
            for i, n in lens.items()}
    refs = {i: hf_logits(hf_model, t) for i, t in full.items()}
    cache = PagedCache(model, num_blocks=64, block_size=4, seed=5)

    def run(seqs, is_prompt):
        ids, pos, meta = make_step(cache, seqs, is_prompt)
        with torch.no_grad(), attention_metadata(meta):
            return model.compute_logits(model(ids, pos))

    run([(0, full[0][:9], 0), (2, full[2][:13], 0)], True)
    # Decodes of 0 and 2 interleaved with fresh prompts, in one prompt step.
    logits = run([(0, full[0][:10], 9), (1, full[1][:7], 0), (2, full[2][:14], 13),
                  (3, full[3][:1], 0), (4, full[4][:4], 0)], True)
    expected = torch.cat((refs[0][9:10], refs[1][:7], refs[2][13:14], refs[3][:1], refs[4][:4]))
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
    # And everyone decodes on.
    logits = run([(i, full[i][:n + 2], n + 1) if i in (0, 2) else (i, full[i][:n + 1], n)
                  for i, n in lens.items()], False)
    expected = torch.stack([refs[i][n + 1] if i in (0, 2) else refs[i][n] for i, n in lens.items()])
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=1e-4)
