"""An HF transformers model generating on vllm_lite's attention kernels.

Importing vllm_lite.integrations.transformers registers the attention implementations
"vllm_lite" (any HF forward) and "vllm_lite_flash" (the name transformers' continuous
batching accepts); the model is loaded with one of them and used as usual. In
generate_batch, the kernels read HF's own paged KV cache in place.

    python examples/python/hf_generate_batch.py [HF model folder]

Without a folder it uses vllm_lite's default model (SmolLM2-135M-Instruct).
"""

import sys

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    ContinuousBatchingConfig,
    GenerationConfig,
)

import vllm_lite.integrations.transformers  # noqa: F401  (registers "vllm_lite", "vllm_lite_flash")


def generate_batch(folder: str, questions: list[str], max_new_tokens: int = 16,
                   attn_implementation: str = "vllm_lite_flash") -> list[str]:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation=attn_implementation, dtype=torch.float32).eval()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                             add_generation_prompt=True, tokenize=False)
               for q in questions]
    inputs = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or 0)
    # Unless told, HF sizes its paged cache (and under sdpa a dense mask over it) from the
    # free memory, which takes seconds to allocate and fill on a CPU: these questions need
    # only their own pages.
    page = 32
    pages = sum(-(-(len(i) + max_new_tokens) // page) for i in inputs)
    cache = ContinuousBatchingConfig(page_size=page, num_blocks=pages,
                                     max_batch_tokens=max(256, *map(len, inputs)))
    with torch.no_grad():
        results = model.generate_batch(inputs, generation_config=config,
                                       continuous_batching_config=cache, progress_bar=False)
    answers = {tuple(r.prompt_ids): r.generated_tokens for r in results.values()}
    return [tokenizer.decode(answers[tuple(i)], skip_special_tokens=True) for i in inputs]


if __name__ == "__main__":
    if len(sys.argv) > 1:
        model_folder = sys.argv[1]
    else:
        from vllm_lite.models import DEFAULT_MODEL, resolve_model

        model_folder = str(resolve_model(DEFAULT_MODEL))
    qs = ["What is the capital of France?", "Name a primary colour."]
    for q, a in zip(qs, generate_batch(model_folder, qs)):
        print(f"Q: {q}\nA: {a}\n")
