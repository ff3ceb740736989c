"""Decode CUDA graphs: the bucket list, the static inputs' in-place fill and padding (on
the CPU), and on a GPU: replayed graphs give the eager forward's results, padded rows
write no cache slot, and greedy generation with graphs equals eager token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_lite.layers.attention import AttentionMetadata
from vllm_lite.worker.cuda_graphs import (
    PAD_SEQ_LEN, PAD_SLOT, DecodeGraphInputs, DecodeGraphs, bucket_for, capture_sizes)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("max_num_seqs,expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 4]), (4, [1, 2, 4]), (5, [1, 2, 4, 8]),
    (8, [1, 2, 4, 8]), (9, [1, 2, 4, 8, 16]), (20, [1, 2, 4, 8, 16, 24]),
    (256, [1, 2, 4] + list(range(8, 257, 8))), (1000, [1, 2, 4] + list(range(8, 257, 8))),
])
def test_capture_sizes(max_num_seqs: int, expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)
    with pytest.raises(ValueError, match="cap"):
        capture_sizes(8, cap=0)


def test_every_batch_gets_the_smallest_bucket_that_holds_it() -> None:
    sizes = capture_sizes(100)
    for n in range(1, 105):
        b = bucket_for(n, sizes)
        assert b is not None and b >= n and not any(n <= s < b for s in sizes), (n, b)
    assert bucket_for(105, sizes) is None


def _step(n: int, width: int, gen: torch.Generator) -> tuple:
    ids = torch.randint(0, 1000, (n,), generator=gen)
    pos = torch.randint(0, 500, (n,), generator=gen)
    meta = AttentionMetadata(
        is_prompt=False,
        slot_mapping=torch.randint(0, 4000, (n,), generator=gen),
        seq_lens=torch.randint(1, 500, (n,), generator=gen, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        block_tables=torch.randint(0, 300, (n, width), generator=gen, dtype=torch.int32),
        max_seq_len=500, block_size=16, max_query_len=1)
    return ids, pos, meta


@pytest.mark.parametrize("n,batch,width", [(3, 4, 5), (8, 8, 7), (1, 16, 1), (13, 16, 7)])
def test_fill_copies_the_step_and_pads_rows_that_write_nothing(n: int, batch: int,
                                                               width: int) -> None:
    gen = torch.Generator().manual_seed(n * 100 + batch)
    buf = DecodeGraphInputs(max_batch=16, max_blocks=7, device=torch.device("cpu"))
    # A previous, larger step left its values everywhere.
    old = _step(16, 7, gen)
    buf.fill(*old, batch=16)
    ids, pos, meta = _step(n, width, gen)
    buf.fill(ids, pos, meta, batch)
    assert torch.equal(buf.input_ids[:n], ids) and torch.equal(buf.positions[:n], pos)
    assert torch.equal(buf.slot_mapping[:n], meta.slot_mapping)
    assert torch.equal(buf.seq_lens[:n], meta.seq_lens)
    assert torch.equal(buf.block_tables[:n, :width], meta.block_tables)
    pad = slice(n, batch)
    assert (buf.slot_mapping[pad] == PAD_SLOT).all(), "a padded row must write no slot"
    assert (buf.seq_lens[pad] == PAD_SEQ_LEN).all()
    assert (buf.block_tables[pad] == 0).all() and (buf.input_ids[pad] == 0).all()
    # The graph's metadata views these buffers, bounded by the model's length.
    m = buf.metadata(batch, 16, 4096)
    assert m.slot_mapping.data_ptr() == buf.slot_mapping.data_ptr() and m.num_seqs == batch
    assert m.max_seq_len == 4096 and not m.is_prompt and m.max_query_len == 1


def test_fill_refuses_what_does_not_fit() -> None:
    gen = torch.Generator().manual_seed(0)
    buf = DecodeGraphInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit a bucket of 4"):
        buf.fill(*_step(5, 4, gen), batch=4)
    with pytest.raises(ValueError, match="exceed the graphs' 4"):
        buf.fill(*_step(2, 5, gen), batch=2)


def test_capture_off_a_gpu_is_a_clear_error() -> None:
    from vllm_lite.worker.cuda_graphs import GraphCaptureError

    graphs = DecodeGraphs(torch.nn.Identity(), [1, 2], 16, 64, torch.device("cpu"))
    with pytest.raises(GraphCaptureError, match="need a CUDA device"):
        graphs.capture()


# -- on a GPU ---------------------------------------------------------------------------------
@needs_cuda
def test_replay_matches_eager_and_padded_rows_write_no_slot(tmp_path: Path) -> None:
    from models.helpers import PagedCache, make_config, make_step, save_hf_model
    from vllm_lite.layers.attention import attention_metadata
    from vllm_lite.models.loader import load_model

    save_hf_model(make_config("llama"), tmp_path)
    model, config = load_model(tmp_path, device="cuda")
    cache = PagedCache(model, num_blocks=64, block_size=16, device="cuda")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen) for n in (9, 30, 17)]
    ids, pos, meta = make_step(cache, [(i, p, 0) for i, p in enumerate(prompts)], True)
    with attention_metadata(meta), torch.inference_mode():
        model(ids, pos)
    graphs = DecodeGraphs(model, [1, 2, 4, 8], 16, 256, torch.device("cuda"))
    graphs.capture()
    nxt = [torch.cat((p, torch.tensor([5]))) for p in prompts]
    ids, pos, meta = make_step(cache, [(i, p, len(p) - 1) for i, p in enumerate(nxt)], False)
    layers = list(model.attention_layers())
    before = [(a.k_cache.clone(), a.v_cache.clone()) for a in layers]
    with torch.inference_mode():
        hidden = graphs.run(ids, pos, meta)  # 3 sequences in the bucket of 4
    written = set(meta.slot_mapping.tolist())
    for a, (k, v) in zip(layers, before):
        for cache_now, cache_before in ((a.k_cache, k), (a.v_cache, v)):
            same = (cache_now == cache_before) | (cache_now.isnan() & cache_before.isnan())
            blocks = {int(b) for b in (~same).flatten(1).any(-1).nonzero()[:, 0]}
            assert blocks <= {s // 16 for s in written}, "a padded row wrote the cache"
    with attention_metadata(meta), torch.inference_mode():
        eager = model(ids, pos)
    torch.testing.assert_close(hidden, eager, rtol=1e-4, atol=1e-4)


@needs_cuda
def test_greedy_with_graphs_equals_eager_token_for_token(tmp_path: Path) -> None:
    from models.helpers import make_config, save_hf_model
    from vllm_lite import LLM, SamplingParams

    save_hf_model(make_config("llama"), tmp_path)
    gen = torch.Generator().manual_seed(11)
    # Batch sizes that land in several buckets, padded and exact, and lengths that
    # cross blocks while decoding.
    prompts = [{"prompt_token_ids": torch.randint(0, 160, (int(n),), generator=gen).tolist()}
               for n in torch.randint(1, 60, (13,), generator=gen)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    results = {}
    for eager in (True, False):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", enforce_eager=eager,
                  max_num_seqs=16, max_model_len=128, gpu_memory_utilization=0.3)
        assert (llm.llm_engine.runner.graphs is None) == eager
        results[eager] = [[o.outputs[0].token_ids for o in llm.generate(prompts[:k], params)]
                          for k in (1, 3, 8, 13)]
        llm.llm_engine.shutdown()
        del llm
        torch.cuda.empty_cache()
    assert results[False] == results[True]
