"""The sharding rules without processes: every rank's part of a kept int4 projection
(GGUF blocks) is exactly the rows / whole-group columns of the unsplit weight that the
rank's heads and MLP slice use, and the ranks' parts together are the whole weight."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.helpers import make_config  # noqa: E402
from vllm_lite.distributed.layers import shard_kept_weight  # noqa: E402
from vllm_lite.layers.quantization import quantize_int4  # noqa: E402
from vllm_lite.models.llama import LlamaForCausalLM  # noqa: E402


def _rank_model(config, rank: int, size: int) -> LlamaForCausalLM:
    # Building a shard needs only the rank and the size (collectives run in forward).
    return LlamaForCausalLM(config, tp=SimpleNamespace(rank=rank, size=size))


@pytest.mark.parametrize("size, heads, kv_heads", [(2, 4, 2), (4, 4, 2), (3, 9, 3)])
def test_kept_int4_shards_are_the_ranks_rows_and_columns(size, heads, kv_heads) -> None:
    config = make_config("llama")
    config.num_attention_heads, config.num_key_value_heads = heads, kv_heads
    config.head_dim = 32  # a rank's o_proj inputs are whole groups of 32
    config.hidden_size = heads * 32
    config.intermediate_size = 96 * size
    d = 32
    gen = torch.Generator().manual_seed(size)
    hidden, inter = config.hidden_size, config.intermediate_size
    full = {
        "qkv_proj": torch.randn((heads + 2 * kv_heads) * d, hidden, generator=gen),
        "gate_up_proj": torch.randn(2 * inter, hidden, generator=gen),
        "o_proj": torch.randn(hidden, heads * d, generator=gen),
        "down_proj": torch.randn(hidden, inter, generator=gen),
    }
    kept = {name: quantize_int4(w, 32) for name, w in full.items()}
    whole = {name: w.dequantize() for name, w in kept.items()}
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in full}
    for rank in range(size):
        model = _rank_model(config, rank, size)
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        for name, w in kept.items():
            part = "self_attn" if name in ("qkv_proj", "o_proj") else "mlp"
            module = f"model.layers.0.{part}.{name}"
            dim, segments = model.tp_segments(module)
            shard = shard_kept_weight(w, dim, segments).dequantize()
            # The shard has the shape of the rank's layer...
            layer = getattr(attn if name in ("qkv_proj", "o_proj") else mlp, name)
            assert shard.shape == layer.weight.shape, name
            parts[name].append(shard)
        # ... and holds its heads: q rows of heads [r h, (r + 1) h), its KV head's rows.
        hq = heads // size
        q_rows = whole["qkv_proj"][rank * hq * d:(rank + 1) * hq * d]
        torch.testing.assert_close(parts["qkv_proj"][rank][:hq * d], q_rows, rtol=0, atol=0)
        kv = attn.kv_head_start
        k_rows = whole["qkv_proj"][(heads + kv) * d:(heads + kv + 1) * d]
        torch.testing.assert_close(parts["qkv_proj"][rank][hq * d:(hq + 1) * d], k_rows,
                                   rtol=0, atol=0)
    # Together: the o_proj / down_proj columns and the gate rows cover the whole weight.
    torch.testing.assert_close(torch.cat(parts["o_proj"], 1), whole["o_proj"], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(parts["down_proj"], 1), whole["down_proj"],
                               rtol=0, atol=0)
    gates = torch.cat([p[:p.shape[0] // 2] for p in parts["gate_up_proj"]])
    torch.testing.assert_close(gates, whole["gate_up_proj"][:inter], rtol=0, atol=0)


def test_a_shard_that_splits_a_group_is_refused() -> None:
    w = quantize_int4(torch.randn(8, 128), 64)
    with pytest.raises(ValueError, match="whole groups of 64"):
        shard_kept_weight(w, 1, [(32, 64)])


def test_q8_0_group_weights_split_like_int4() -> None:
    """GGUF Q8_0 (Int8GroupWeight: int8 [N, K], a scale per 32): rows anywhere, whole
    groups of columns, each part exactly the unsplit dequantized weight's."""
    from vllm_lite.models.gguf_quant import Int8GroupWeight

    gen = torch.Generator().manual_seed(0)
    q = torch.randint(-127, 128, (12, 128), generator=gen, dtype=torch.int8)
    w = Int8GroupWeight(q, torch.rand(12, 4, generator=gen) + 0.1, 32)
    whole = w.dequantize()
    rows = shard_kept_weight(w, 0, [(2, 3), (8, 4)]).dequantize()
    assert torch.equal(rows, torch.cat([whole[2:5], whole[8:12]]))
    cols = shard_kept_weight(w, 1, [(64, 64)]).dequantize()
    assert torch.equal(cols, whole[:, 64:])
