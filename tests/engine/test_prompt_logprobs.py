"""prompt_logprobs through LLM.generate against HF transformers' forward (float32): every
prompt token's logprob, rank and the top-k, and the first generated token's logprobs, for
a batch of prompts of different lengths, with chunked prefill on and off, under prefix
caching and preemption; only the rows that need logits get them."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from engine.test_llm import _assert_all_free, _llm, _make_tokenizer  # noqa: E402
from models.helpers import hf_logits, make_config, save_hf_model  # noqa: E402
from vllm_lite import SamplingParams  # noqa: E402

VOCAB = 320
K = 3
PROMPT_LENS = [1, 3, 9, 17, 30]


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def plp_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, HF model); the llama folder has a tokenizer."""
    name = request.param
    config = make_config(name)
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    folder = tmp_path_factory.mktemp(f"plp_{name}")
    hf_model = save_hf_model(config, folder)
    if name == "llama":
        _make_tokenizer(folder)
    return name, folder, hf_model


def _params(prompt_logprobs: int | None = K, **kw: Any) -> SamplingParams:
    kw.setdefault("max_tokens", 2)
    return SamplingParams(temperature=0.0, prompt_logprobs=prompt_logprobs, logprobs=K, **kw)


def _check_entry(entry: dict[int, Any], ref: torch.Tensor, token: int, k: int,
                 with_text: bool) -> None:
    """One {token_id: Logprob} dict against HF's log_softmax row ``ref`` [vocab]."""
    assert entry[token].logprob == pytest.approx(float(ref[token]), abs=1e-4)
    assert entry[token].rank == int((ref > ref[token]).sum()) + 1
    top = ref.topk(k).indices.tolist()
    assert set(entry) == set(top) | {token}
    for j, t in enumerate(top):
        assert entry[t].rank == j + 1
        assert entry[t].logprob == pytest.approx(float(ref[t]), abs=1e-4)
    for lp in entry.values():
        assert isinstance(lp.decoded_token, str) if with_text else lp.decoded_token is None


def _check_request(out: Any, hf_model: Any, with_text: bool) -> None:
    prompt = out.prompt_token_ids
    ref = torch.log_softmax(hf_logits(hf_model, torch.tensor(prompt)), dim=-1)
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(prompt) and plp[0] is None
    for pos in range(1, len(prompt)):
        _check_entry(plp[pos], ref[pos - 1], prompt[pos], K, with_text)
    # The first generated token's logprobs come from the last prompt position.
    first = out.outputs[0].token_ids[0]
    assert first == int(ref[-1].argmax())
    _check_entry(out.outputs[0].logprobs[0], ref[-1], first, K, with_text)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole_prompts", "chunked_prefill"])
def test_prompt_logprobs_match_hf(plp_ckpt, chunked: bool) -> None:
    name, folder, hf_model = plp_ckpt
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4) if chunked else {}
    llm = _llm(folder, **kw)
    prompts = _prompts()
    # The 9-token prompt does not ask for prompt logprobs: it gets None.
    params = [_params() if i != 2 else _params(None) for i in range(len(prompts))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if i == 2:
            assert out.prompt_logprobs is None
        else:
            _check_request(out, hf_model, with_text=name == "llama")
    _assert_all_free(llm)


def test_only_needed_rows_get_logits(plp_ckpt) -> None:
    _, folder, _ = plp_ckpt
    llm = _llm(folder)
    model = llm.llm_engine.model
    rows: list[int] = []
    compute_logits = model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return compute_logits(hidden)

    model.compute_logits = counting
    prompts = _prompts()
    params = [_params(None) for _ in prompts]
    params[3] = _params()  # 17 tokens: positions 0..15 predict tokens 1..16
    llm.generate(prompts, params, use_tqdm=False)
    # Step 1: every prompt samples, plus 16 prompt rows; step 2: five decodes.
    assert rows == [len(prompts) + 16, len(prompts)]


def test_prompt_logprobs_with_prefix_cache_hits(plp_ckpt) -> None:
    """A request asking for prompt logprobs computes its whole prompt even when the prefix
    cache holds it (it reads no cached block), and still publishes for later requests."""
    name, folder, hf_model = plp_ckpt
    llm = _llm(folder, enable_prefix_caching=True)
    stats = llm.llm_engine.scheduler.prefix_cache_stats
    prompt = _prompts()[4]
    other = prompt[:20] + [7, 8, 9]
    llm.generate([prompt], _params(None), use_tqdm=False)
    hits = stats.hits
    outs = llm.generate([prompt, other], _params(), use_tqdm=False)
    assert stats.hits == hits
    for out in outs:
        _check_request(out, hf_model, with_text=name == "llama")
    llm.generate([other], _params(None), use_tqdm=False)
    assert stats.hits > hits
    _assert_all_free(llm)


@pytest.mark.parametrize("chunked", [False, True], ids=["whole_prompts", "chunked_prefill"])
def test_prompt_logprobs_survive_preemption(plp_ckpt, chunked: bool) -> None:
    name, folder, hf_model = plp_ckpt
    kw: dict[str, Any] = dict(num_gpu_blocks_override=14, preemption_mode="recompute")
    if chunked:
        kw.update(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4)
    llm = _llm(folder, **kw)
    prompts = _prompts()
    outs = llm.generate(prompts, _params(max_tokens=12), use_tqdm=False)
    assert llm.llm_engine.scheduler.num_preemptions["recompute"] > 0
    for out in outs:
        _check_request(out, hf_model, with_text=name == "llama")
    _assert_all_free(llm)


def test_prompt_logprobs_with_n_and_beams(plp_ckpt) -> None:
    _, folder, _ = plp_ckpt
    llm = _llm(folder)
    prompts = _prompts()[1:3]
    greedy = llm.generate(prompts, _params(), use_tqdm=False)
    sampled = llm.generate(prompts, SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3,
                                                   prompt_logprobs=K), use_tqdm=False)
    beams = llm.generate(prompts, SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                                 max_tokens=3, prompt_logprobs=K), use_tqdm=False)
    for g, s, b in zip(greedy, sampled, beams):
        assert len(s.outputs) == len(b.outputs) == 2
        for other in (s, b):
            assert len(other.prompt_logprobs) == len(g.prompt_logprobs)
            for e, f in zip(g.prompt_logprobs[1:], other.prompt_logprobs[1:]):
                assert {t: lp.logprob for t, lp in e.items()} == \
                    pytest.approx({t: lp.logprob for t, lp in f.items()}, abs=1e-5)
    _assert_all_free(llm)
