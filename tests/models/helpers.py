"""Test helpers: tiny HF models saved to disk, a paged KV cache and step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vllm_lite.layers.attention import AttentionMetadata

BASE = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.1,  # larger than the default 0.02 so attention is far from uniform
)

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64, "rope_theta": 500000.0,
}


def make_config(name: str) -> Any:
    """A tiny config of each supported family (and rope / tying variant)."""
    import transformers as tf

    if name == "llama":
        return tf.LlamaConfig(**BASE)
    if name == "llama3_tied":
        return tf.LlamaConfig(**BASE, rope_scaling=dict(LLAMA3_ROPE), tie_word_embeddings=True)
    if name == "llama_linear_bias":
        return tf.LlamaConfig(**{**BASE, "num_hidden_layers": 3},
                              rope_scaling={"rope_type": "linear", "factor": 2.0},
                              attention_bias=True, mlp_bias=True)
    if name == "mistral":
        return tf.MistralConfig(**BASE, head_dim=32)
    if name == "qwen2":
        return tf.Qwen2Config(**BASE, tie_word_embeddings=True)
    if name == "qwen3":
        return tf.Qwen3Config(**{**BASE, "num_key_value_heads": 1}, head_dim=32)
    raise KeyError(name)


CONFIG_NAMES = ["llama", "llama3_tied", "llama_linear_bias", "mistral", "qwen2", "qwen3"]

# GLM and the mixture-of-experts models (tests/models/test_glm_moe.py).
GLM_MOE_CONFIG_NAMES = ["glm", "glm4", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]


def make_glm_moe_config(name: str) -> Any:
    """A tiny config of GLM / GLM-4 (partial interleaved rotary) and of each MoE family:
    8 experts, several routed per token, layers of both kinds where the family has them."""
    import transformers as tf

    base = {**BASE, "pad_token_id": 0, "eos_token_id": 0}
    if name == "glm":
        return tf.GlmConfig(**base, head_dim=16)
    if name == "glm4":
        return tf.Glm4Config(**{**base, "num_hidden_layers": 3}, head_dim=32,
                             attention_bias=False)
    if name == "mixtral":
        return tf.MixtralConfig(**{**base, "intermediate_size": 32}, num_local_experts=8,
                                num_experts_per_tok=2)
    if name == "qwen2_moe":
        # Layer 1 dense (mlp_only_layers), 0 and 2 experts + the gated shared expert.
        return tf.Qwen2MoeConfig(**{**base, "num_hidden_layers": 3}, num_experts=8,
                                 num_experts_per_tok=3, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=48, mlp_only_layers=[1],
                                 norm_topk_prob=False)
    if name == "qwen3_moe":
        # decoder_sparse_step 2: layer 1 routes, layer 0 is dense.
        return tf.Qwen3MoeConfig(**base, head_dim=32, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=24, decoder_sparse_step=2,
                                 norm_topk_prob=True)
    if name == "olmoe":
        return tf.OlmoeConfig(**base, num_experts=8, num_experts_per_tok=2, clip_qkv=2.0,
                              norm_topk_prob=False)
    raise KeyError(name)


def make_hf_model(config: Any, seed: int = 0) -> torch.nn.Module:
    """A seeded random HF model in float32; norm weights and biases are randomized too
    (HF initializes them to ones / zeros, which would hide a mis-mapped weight)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                # MoE routers may start at zero (every expert tied): make them route.
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    return model.eval()


def save_hf_model(config: Any, folder: Path, seed: int = 0) -> torch.nn.Module:
    model = make_hf_model(config, seed)
    model.save_pretrained(folder)
    return model


@torch.no_grad()
def hf_greedy(hf_model: torch.nn.Module, prompt: list[int], k: int) -> list[int]:
    """HF generate's k greedy tokens after ``prompt`` (EOS not special: pad id 0)."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                            max_new_tokens=k, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def assert_all_free(llm: Any) -> None:
    """Nothing left in an LLM's engine: no sequence, every device and CPU block free."""
    sched = llm.llm_engine.scheduler
    bm = sched.block_manager
    assert not sched.has_unfinished_seqs()
    assert bm.get_num_free_device_blocks() == bm.num_total_device_blocks
    assert bm.get_num_free_cpu_blocks() == bm.num_total_cpu_blocks
    assert not llm.llm_engine._requests


@torch.no_grad()
def hf_logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """HF's logits [len, vocab] for every position of one sequence."""
    return model(tokens[None]).logits[0].float()


@dataclass
class PagedCache:
    """Per-layer paged KV caches (NaN-poisoned) and a shuffled block pool."""

    model: torch.nn.Module
    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.float32
    seed: int = 0
    device: str = "cpu"
    free: list[int] = field(default_factory=list)
    tables: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from vllm_lite import ops

        gen = torch.Generator().manual_seed(self.seed)
        self.free = torch.randperm(self.num_blocks, generator=gen).tolist()
        for attn in self.model.attention_layers():
            k_shape, v_shape = ops.kv_cache_shapes(
                self.num_blocks, attn.num_kv_heads, attn.head_size, self.block_size, self.dtype
            )
            # NaN everywhere: reading a slot nobody wrote poisons the output.
            attn.k_cache = torch.full(k_shape, float("nan"), dtype=self.dtype, device=self.device)
            attn.v_cache = torch.full(v_shape, float("nan"), dtype=self.dtype, device=self.device)

    def ensure(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq_id, [])
        while len(table) * self.block_size < num_tokens:
            table.append(self.free.pop())
        return table

    def share_prefix(self, seq_id: int, parent: int, num_blocks: int) -> None:
        """Seq ``seq_id`` starts with ``parent``'s first full blocks (prefix caching)."""
        self.tables[seq_id] = list(self.tables[parent][:num_blocks])

    def slot(self, seq_id: int, position: int) -> int:
        return self.tables[seq_id][position // self.block_size] * self.block_size + (
            position % self.block_size
        )


def make_step(
    cache: PagedCache,
    seqs: list[tuple[int, torch.Tensor, int]],
    is_prompt: bool,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Builds one flat step. ``seqs``: (seq_id, all tokens so far, num_computed) — the
    tokens from num_computed on are this step's new tokens."""
    ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
    for seq_id, tokens, num_computed in seqs:
        n = len(tokens)
        cache.ensure(seq_id, n)
        ids.append(tokens[num_computed:])
        positions.append(torch.arange(num_computed, n))
        slots += [cache.slot(seq_id, p) for p in range(num_computed, n)]
        seq_lens.append(n)
        starts.append(starts[-1] + n - num_computed)
    max_blocks = max(len(cache.tables[s]) for s, _, _ in seqs)
    tables = torch.zeros((len(seqs), max_blocks), dtype=torch.int32)
    for i, (seq_id, _, _) in enumerate(seqs):
        tables[i, : len(cache.tables[seq_id])] = torch.tensor(cache.tables[seq_id])
    dev = cache.device
    meta = AttentionMetadata(
        is_prompt=is_prompt,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        block_tables=tables.to(dev),
        max_seq_len=max(seq_lens),
        block_size=cache.block_size,
    )
    return torch.cat(ids).to(dev), torch.cat(positions).to(dev), meta


def make_tokenizer(folder: Path) -> Any:
    """A byte-level BPE (ids < 300, "<eos>" = 0) with a chat template, saved in ``folder``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the cat sat on the mat. café naïve"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                          "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    fast.save_pretrained(folder)
    return fast
