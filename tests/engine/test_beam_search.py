"""Beam search through LLM.generate against HF transformers' beam search (float32), on
tiny random Llama / Qwen2 checkpoints whose EOS is made likely enough that beams end on it:
widths, length penalties, early_stopping True / False / "never", max_tokens caps, prompts
of different lengths in one batch; under preemption, chunked prefill, prefix caching; block
sharing and freeing; logprobs and text of beams."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from engine.test_llm import _assert_all_free, _llm, _make_tokenizer, _prompts  # noqa: E402
from models.helpers import make_config, make_hf_model  # noqa: E402
from vllm_lite import RequestOutput, SamplingParams  # noqa: E402

VOCAB = 320
EOS = 0  # the test tokenizer's "<eos>"


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def beam_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(name, folder, HF model). EOS's output row is 1.5x the row of the token the random
    model likes best on average, so EOS competes in the beams at every step; the llama
    folder has a tokenizer."""
    name = request.param
    config = make_config(name)
    config.vocab_size = VOCAB
    config.eos_token_id = EOS
    hf_model = make_hf_model(config)
    with torch.no_grad():
        lps = torch.cat([torch.log_softmax(hf_model(torch.tensor([p])).logits[0], -1)
                         for p in _prompts()])
        liked = int(lps.mean(0).argmax())
        head = hf_model.get_output_embeddings().weight
        head[EOS] = 1.5 * head[liked]
    folder = tmp_path_factory.mktemp(f"beam_{name}")
    hf_model.save_pretrained(folder)
    if name == "llama":
        _make_tokenizer(folder)
    return name, folder, hf_model


@torch.no_grad()
def _hf_beam(hf_model: Any, prompt: list[int], width: int, n: int, length_penalty: float,
             early_stopping: Any, max_tokens: int) -> list[tuple[list[int], float]]:
    """HF's n best beams: (generated tokens up to and with EOS, score), best first."""
    ids = torch.tensor([prompt])
    out = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=width,
        num_return_sequences=n, length_penalty=length_penalty, early_stopping=early_stopping,
        max_new_tokens=max_tokens, eos_token_id=EOS, pad_token_id=EOS,
        output_scores=True, return_dict_in_generate=True)
    beams = []
    for row, score in zip(out.sequences, out.sequences_scores):
        gen = row[len(prompt):].tolist()
        if EOS in gen:
            gen = gen[: gen.index(EOS) + 1]  # padding after EOS is EOS too
        beams.append((gen, float(score)))
    return beams


def _beam(width: int, n: int, length_penalty: float = 1.0, early_stopping: Any = False,
          max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(n=n, best_of=width, use_beam_search=True, temperature=0.0,
                          length_penalty=length_penalty, early_stopping=early_stopping,
                          max_tokens=max_tokens, **kw)


def _check_against_hf(outs: list[RequestOutput], refs: list[list[tuple[list[int], float]]],
                      length_penalty: float) -> None:
    for out, ref in zip(outs, refs):
        assert out.finished
        assert [c.token_ids for c in out.outputs] == [tokens for tokens, _ in ref]
        assert [c.index for c in out.outputs] == list(range(len(ref)))
        for c, (tokens, score) in zip(out.outputs, ref):
            # HF's score is the cumulative logprob over generated_len ** length_penalty.
            assert c.cumulative_logprob / len(tokens) ** length_penalty == pytest.approx(score, abs=1e-4)
            assert c.finish_reason == ("stop" if tokens[-1] == EOS else "length")


# (width, n, length_penalty, early_stopping, max_tokens)
CASES = {
    "w3_all_returned": (3, 3, 1.0, False, 8),
    "w2_best_of_early_true": (2, 1, 0.5, True, 10),
    "w4_never_long_favoured": (4, 2, 1.5, "never", 8),
    "w3_short_favoured": (3, 3, -0.7, False, 6),
    "w2_never_no_penalty": (2, 2, 0.0, "never", 12),
    "w3_max_tokens_cap": (3, 3, 1.0, False, 3),
}


_REFS: dict[tuple[str, str], list[list[tuple[list[int], float]]]] = {}


def _refs(beam_ckpt: Any, case: str) -> list[list[tuple[list[int], float]]]:
    name, _, hf_model = beam_ckpt
    if (name, case) not in _REFS:
        width, n, lp, es, max_tokens = CASES[case]
        _REFS[name, case] = [_hf_beam(hf_model, p, width, n, lp, es, max_tokens) for p in _prompts()]
    return _REFS[name, case]


@pytest.mark.parametrize("case", list(CASES))
def test_beam_search_matches_hf(beam_ckpt, case: str) -> None:
    _, folder, _ = beam_ckpt
    width, n, lp, es, max_tokens = CASES[case]
    prompts = _prompts()
    refs = _refs(beam_ckpt, case)
    llm = _llm(folder)
    outs = llm.generate(prompts, _beam(width, n, lp, es, max_tokens), use_tqdm=False)
    _check_against_hf(outs, refs, lp)
    beams = [c for o in outs for c in o.outputs]
    # Both ways of ending are exercised (so neither path can be skipped silently); a
    # penalty favouring long beams lets no EOS hypothesis win there.
    if lp <= 1.0:
        assert any(c.token_ids[-1] == EOS for c in beams)
    assert any(c.finish_reason == "length" for c in beams)
    if case == "w3_max_tokens_cap":
        assert all(len(c.token_ids) <= max_tokens for c in beams)
    _assert_all_free(llm)


VARIANTS = {
    "preempt_swap": dict(num_gpu_blocks_override=18),
    "preempt_recompute": dict(num_gpu_blocks_override=24, preemption_mode="recompute"),
    "chunked_prefill": dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4),
    "prefix_caching": dict(enable_prefix_caching=True),
    "max_num_seqs_3": dict(max_num_seqs=3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_beam_search_scheduling_variants_match_hf(beam_ckpt, variant: str) -> None:
    _, folder, _ = beam_ckpt
    width, n, lp, es, max_tokens = CASES["w3_all_returned"]
    prompts = _prompts()
    refs = _refs(beam_ckpt, "w3_all_returned")
    llm = _llm(folder, **VARIANTS[variant])
    sched = llm.llm_engine.scheduler
    preempted: list[tuple[int, str]] = []  # (live beams, mode)
    preempt = sched._preempt

    def recording_preempt(group: Any, state: Any) -> None:
        before = dict(sched.num_preemptions)
        live = len(group.get_unfinished_seqs())
        preempt(group, state)
        preempted.append((live, next(m for m, k in sched.num_preemptions.items() if k > before[m])))

    sched._preempt = recording_preempt
    if variant == "prefix_caching":
        llm.generate(prompts[2:3], _beam(width, n, lp, es, max_tokens), use_tqdm=False)
    outs = llm.generate(prompts, _beam(width, n, lp, es, max_tokens), use_tqdm=False)
    _check_against_hf(outs, refs, lp)
    if variant.startswith("preempt"):
        # A group of several live beams was preempted in that mode and brought back.
        mode = VARIANTS[variant].get("preemption_mode", "swap")
        assert any(k > 1 and m == mode for k, m in preempted), preempted
    if variant == "prefix_caching":
        assert sched.prefix_cache_stats.hits > 0
    _assert_all_free(llm)


def test_beams_share_blocks_and_free_dropped_ones(beam_ckpt) -> None:
    _, folder, _ = beam_ckpt
    llm = _llm(folder)
    engine = llm.llm_engine
    bm = engine.scheduler.block_manager
    prompt = _prompts()[3]  # 30 tokens: 7 full blocks of 4
    width = 3
    engine.add_request("r", None, _beam(width, width, max_tokens=10), prompt_token_ids=prompt)
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        group = engine.scheduler.get_seq_group("r")
        if group is None:
            break
        live = group.get_unfinished_seqs()
        tables = [bm.get_block_table(s) for s in live]
        if steps == 1:
            assert len(live) == width  # the prompt forked into the beams
        # Every live beam shares the prompt's full blocks, one reference each.
        for block in tables[0][:7]:
            assert all(t[:7] == tables[0][:7] for t in tables)
            assert bm.device_allocator.ref_count(block) == len(live)
        # Finished hypotheses hold no blocks, and nothing else is held: dropped beams
        # gave theirs back at once.
        assert all(not bm.has_blocks(s) for s in group.get_seqs() if s.is_finished())
        in_use = {b for t in tables for b in t}
        assert bm.num_total_device_blocks - bm.get_num_free_device_blocks() == len(in_use)
        assert sum(bm.device_allocator.ref_count(b) for b in in_use) == sum(len(t) for t in tables)
    assert steps > 2
    _assert_all_free(llm)


def test_beam_logprobs_and_text(beam_ckpt) -> None:
    name, folder, _ = beam_ckpt
    llm = _llm(folder)
    prompts = _prompts()
    outs = llm.generate(prompts, _beam(3, 3, logprobs=2, max_tokens=8), use_tqdm=False)
    plain = llm.generate(prompts, _beam(3, 3, max_tokens=8), use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in plain]
    tok = llm.get_tokenizer()
    for out in outs:
        for c in out.outputs:
            # Each beam's logprobs follow its own history across forks: one entry per
            # token, holding that token, summing to the beam's cumulative logprob.
            assert len(c.logprobs) == len(c.token_ids)
            assert all(t in d and len(d) <= 3 for t, d in zip(c.token_ids, c.logprobs))
            total = sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs))
            assert total == pytest.approx(c.cumulative_logprob, abs=1e-4)
            for d in c.logprobs:
                ranked = sorted(d.values(), key=lambda lp: lp.rank)
                assert all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
            if name == "llama":
                assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
                assert all(isinstance(lp.decoded_token, str) for d in c.logprobs for lp in d.values())
            else:
                assert c.text == ""
    _assert_all_free(llm)


def test_beam_bad_inputs_and_abort(beam_ckpt) -> None:
    _, folder, _ = beam_ckpt
    llm = _llm(folder, max_num_seqs=4)
    prompts = _prompts()
    with pytest.raises(ValueError, match="stop strings are not supported with beam search"):
        llm.generate(prompts[:2], _beam(2, 2, stop=["a"]), use_tqdm=False)
    with pytest.raises(ValueError, match="max_num_seqs"):
        llm.generate(prompts[:1], _beam(5, 2), use_tqdm=False)
    with pytest.raises(ValueError, match="best_of must be greater than or equal to n"):
        _beam(2, 3)
    engine = llm.llm_engine
    engine.add_request("a", None, _beam(3, 3, max_tokens=20), prompt_token_ids=prompts[3])
    engine.step()
    engine.step()
    engine.abort_request("a")
    _assert_all_free(llm)
    # A stop token id ends a beam as EOS does: it can only be a beam's last token. Short
    # beams are favoured, so the one-token hypothesis of the best first token is kept.
    out = llm.generate(prompts[:1], _beam(2, 2, -1.0, max_tokens=6), use_tqdm=False)[0]
    stop_id = out.outputs[0].token_ids[0]
    stopped = llm.generate(prompts[:1], _beam(2, 2, -1.0, max_tokens=6, stop_token_ids=[stop_id]),
                           use_tqdm=False)[0]
    for c in stopped.outputs:
        assert stop_id not in c.token_ids[:-1] and EOS not in c.token_ids[:-1]
        if c.token_ids[-1] == stop_id:
            assert c.finish_reason == "stop" and c.stop_reason == stop_id
    assert any(c.stop_reason == stop_id for c in stopped.outputs)
    _assert_all_free(llm)
