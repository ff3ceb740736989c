"""spaces_between_special_tokens and truncate_prompt_tokens, offline.

decode / IncrementalDetokenizer against hand-written texts and an independent reference
of vLLM's rule (token strings, not ids); LLM.generate / chat on tiny random Llama
checkpoints: output text as the reference gives it for each flag, and a truncated prompt
giving exactly what its last k tokens give when run directly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

# tests/ is on sys.path (pytest puts the first folder without __init__.py there).
from entrypoints.utils import make_llm  # noqa: E402
from models.helpers import make_config, save_hf_model  # noqa: E402
from models.text_tokenizers import (  # noqa: E402
    NUM_SPECIAL,
    NUM_WORDS,
    VOCAB,
    make_byte_tokenizer,
    make_word_tokenizer,
    reference_decode,
)
from vllm_lite import LLM, SamplingParams  # noqa: E402
from vllm_lite.detokenizer import IncrementalDetokenizer, decode, token_texts_after  # noqa: E402
from vllm_lite.inputs import truncate_prompt  # noqa: E402

HOT = 50.0
FLAGS = [(skip, spaces) for skip in (False, True) for spaces in (True, False)]


# -- decode ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_tok(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_byte_tokenizer(tmp_path_factory.mktemp("byte_tok"))


# "hello", "<tool>", " world", "<|sep|>", "c", "at", "<eos>", "mat": written out by hand from
# vLLM's rule (a run that starts with a space keeps it: the join adds one more).
EXPECTED = {
    (False, True): "hello <tool>  world <|sep|> cat <eos> mat",
    (False, False): "hello<tool> world<|sep|>cat<eos>mat",
    (True, True): "hello <tool>  worldcatmat",
    (True, False): "hello<tool> worldcatmat",
}


@pytest.mark.parametrize("skip,spaces", FLAGS)
def test_decode_joins_added_tokens_as_vllm(byte_tok: Any, skip: bool, spaces: bool) -> None:
    ids = byte_tok.encode("hello<tool> world<|sep|>cat<eos>mat")
    assert len(ids) == 8
    assert decode(byte_tok, ids, skip, spaces) == EXPECTED[(skip, spaces)]
    assert decode(byte_tok, ids, skip, spaces) == reference_decode(byte_tok, ids, skip, spaces)


def test_decode_without_added_tokens_is_the_tokenizers(byte_tok: Any) -> None:
    ids = byte_tok.encode("hello world, the cat sat on the mat. café naïve")
    for skip, spaces in FLAGS:
        assert decode(byte_tok, ids, skip, spaces) == byte_tok.decode(ids,
                                                                      skip_special_tokens=skip)


@pytest.mark.parametrize("skip,spaces", FLAGS)
def test_incremental_detokenizer_equals_decode(byte_tok: Any, skip: bool, spaces: bool) -> None:
    """Token by token after a prompt, the text is the whole decode minus the prompt's,
    with no split character on the way."""
    prompt = byte_tok.encode("the cat<tool>")
    out = byte_tok.encode("<|sep|>café<eos> naïve<tool><tool>mat<|sep|>")
    det = IncrementalDetokenizer(byte_tok, prompt, skip, spaces)
    pieces = [det.add_tokens([t]) for t in out]
    pieces.append(det.flush())
    assert all("\ufffd" not in p for p in pieces)
    full = reference_decode(byte_tok, prompt + out, skip, spaces)
    head = reference_decode(byte_tok, prompt, skip, spaces)
    assert full.startswith(head)
    assert "".join(pieces) == det.text == full[len(head):]
    p = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    det2 = IncrementalDetokenizer.for_params(byte_tok, prompt, p)
    det2.add_tokens(out)
    det2.flush()
    assert det2.text == det.text


def test_token_texts_after(byte_tok: Any) -> None:
    context = byte_tok.encode("the cat")
    tool, sep = byte_tok.convert_tokens_to_ids(["<tool>", "<|sep|>"])
    world = byte_tok.encode(" world")[0]
    assert token_texts_after(byte_tok, context, [tool, sep, world], False, True) == \
        [" <tool>", " <|sep|>", " world"]
    assert token_texts_after(byte_tok, context, [tool, sep, world], False, False) == \
        ["<tool>", "<|sep|>", " world"]
    assert token_texts_after(byte_tok, context, [sep], True, True) == [""]


def test_decode_sees_tokens_added_later(tmp_path: Path) -> None:
    tok = make_byte_tokenizer(tmp_path)
    ids = tok.encode("hello")
    assert decode(tok, ids) == "hello"  # cached: no "<new>" yet
    tok.add_tokens(["<new>"])
    new = tok.convert_tokens_to_ids("<new>")
    assert decode(tok, ids + [new], spaces_between_special_tokens=True) == "hello <new>"


# -- LLM: spaces_between_special_tokens ---------------------------------------------------------
def _checkpoint(folder: Path, make_tokenizer: Any) -> Path:
    config = make_config("llama")  # max_position_embeddings 256: the context
    config.vocab_size = VOCAB
    config.eos_token_id = 0
    save_hf_model(config, folder)
    make_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def word_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_llm(_checkpoint(tmp_path_factory.mktemp("word_llama"), make_word_tokenizer),
                    kv_cache_space=0.02)


@pytest.mark.parametrize("skip,spaces", FLAGS)
def test_generate_text_follows_the_flags(word_llm: LLM, skip: bool, spaces: bool) -> None:
    """Seeded sampling (the same tokens for every flag) over a vocabulary one eighth added
    tokens: the text is the reference's decode of prompt + output minus the prompt's."""
    tok = word_llm.get_tokenizer()
    prompts = ["w5 w6 w7", "w9 <p3> w10", "w11 <s2>"]
    # A high temperature flattens the random model's distribution, so the sampled tokens
    # spread over the whole vocabulary, added tokens included.
    # One seed per prompt: near-uniform sampling with one seed would repeat one sequence.
    params = [SamplingParams(temperature=HOT, seed=11 + i, max_tokens=32, ignore_eos=True,
                             skip_special_tokens=skip, spaces_between_special_tokens=spaces)
              for i in range(len(prompts))]
    outs = word_llm.generate(prompts, params, use_tqdm=False)
    sampled = [t for out in outs for t in out.outputs[0].token_ids]
    # The flags had something to act on: plain added tokens (kept by skip_special_tokens)
    # and special ones.
    assert any(NUM_WORDS <= t < NUM_SPECIAL for t in sampled)
    assert any(t >= NUM_SPECIAL for t in sampled)
    for out in outs:
        c = out.outputs[0]
        full = reference_decode(tok, out.prompt_token_ids + c.token_ids, skip, spaces)
        head = reference_decode(tok, out.prompt_token_ids, skip, spaces)
        assert full.startswith(head)
        assert c.text == full[len(head):], (c.token_ids, skip, spaces)


# -- LLM: truncate_prompt_tokens ------------------------------------------------------------------
@pytest.fixture(scope="module")
def byte_llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    return make_llm(_checkpoint(tmp_path_factory.mktemp("byte_llama"), make_byte_tokenizer),
                    kv_cache_space=0.02)


def _random_ids(seed: int, n: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, 280, (n,), generator=gen).tolist()


def _same(a: Any, b: Any) -> None:
    assert a.prompt_token_ids == b.prompt_token_ids
    for x, y in zip(a.outputs, b.outputs, strict=True):
        assert (x.token_ids, x.text, x.finish_reason) == (y.token_ids, y.text, y.finish_reason)
        assert x.cumulative_logprob == pytest.approx(y.cumulative_logprob, abs=1e-4)


@pytest.mark.parametrize("k", [1, 7, 40])
def test_truncated_ids_prompt_equals_its_tail(byte_llm: LLM, k: int) -> None:
    ids = _random_ids(1, 40)
    for params in (dict(temperature=0.0, max_tokens=8),
                   dict(temperature=1.0, seed=5, max_tokens=8, n=2)):
        got = byte_llm.generate(ids, SamplingParams(truncate_prompt_tokens=k, **params),
                                use_tqdm=False)[0]
        want = byte_llm.generate(ids[-k:], SamplingParams(**params), use_tqdm=False)[0]
        assert got.prompt_token_ids == ids[-k:]
        _same(got, want)


def test_truncation_comes_before_the_length_check(byte_llm: LLM) -> None:
    ids = _random_ids(2, 300)  # longer than max_model_len (256)
    with pytest.raises(ValueError, match="max_model_len"):
        byte_llm.generate(ids, SamplingParams(max_tokens=4), use_tqdm=False)
    got = byte_llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=4,
                                                truncate_prompt_tokens=30), use_tqdm=False)[0]
    want = byte_llm.generate(ids[-30:], SamplingParams(temperature=0.0, max_tokens=4),
                             use_tqdm=False)[0]
    _same(got, want)
    # A k above max_model_len truncates to more than fits: still refused, by the length check.
    with pytest.raises(ValueError, match="max_model_len"):
        byte_llm.generate(ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=280),
                          use_tqdm=False)


def test_truncated_text_prompt_and_chat(byte_llm: LLM) -> None:
    tok = byte_llm.get_tokenizer()
    text = "hello world, the cat sat on the mat<tool>"
    full = tok.encode(text)
    greedy = dict(temperature=0.0, max_tokens=6)
    got = byte_llm.generate(text, SamplingParams(truncate_prompt_tokens=4, **greedy),
                            use_tqdm=False)[0]
    want = byte_llm.generate(full[-4:], SamplingParams(**greedy), use_tqdm=False)[0]
    _same(got, want)
    # The prompt text is the kept tokens' text (special tokens kept, spaced as vLLM).
    assert got.prompt == reference_decode(tok, full[-4:], False, True)
    # Within k tokens: untouched.
    same = byte_llm.generate(text, SamplingParams(truncate_prompt_tokens=len(full), **greedy),
                             use_tqdm=False)[0]
    assert same.prompt == text and same.prompt_token_ids == full
    # Several prompts with their own params: each truncated by its own k.
    outs = byte_llm.generate([full, full], [SamplingParams(truncate_prompt_tokens=3, **greedy),
                                            SamplingParams(**greedy)], use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [full[-3:], full]
    # Chat: the templated prompt's last k tokens.
    conv = [{"role": "user", "content": "hello world, the cat"}]
    templated = tok.encode(tok.apply_chat_template(conv, tokenize=False,
                                                   add_generation_prompt=True),
                           add_special_tokens=False)
    got = byte_llm.chat(conv, SamplingParams(truncate_prompt_tokens=5, **greedy),
                        use_tqdm=False)[0]
    want = byte_llm.generate(templated[-5:], SamplingParams(**greedy), use_tqdm=False)[0]
    _same(got, want)


@pytest.mark.parametrize("bad", [0, -3, True, False, 2.0, "3", [4]])
def test_bad_truncate_prompt_tokens(bad: Any) -> None:
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        truncate_prompt(None, [1, 2, 3], bad)


@pytest.mark.parametrize("bad", [None, 1, "yes", 0.0])
def test_bad_spaces_between_special_tokens(bad: Any) -> None:
    with pytest.raises(ValueError, match="spaces_between_special_tokens"):
        SamplingParams(spaces_between_special_tokens=bad)


def test_truncate_prompt_helper() -> None:
    assert truncate_prompt("abc", [1, 2, 3], None) == ("abc", [1, 2, 3])
    assert truncate_prompt("abc", [1, 2, 3], 3) == ("abc", [1, 2, 3])
    assert truncate_prompt(None, [1, 2, 3], 2) == (None, [2, 3])
    assert truncate_prompt("abc", [1, 2, 3], 1) == (None, [3])  # no tokenizer: no text


# -- stop strings in the text held back for an incomplete character -------------------------------
def test_stop_string_in_held_back_text_stops(model_dir: Path) -> None:
    """A sequence whose last token ends in an incomplete UTF-8 character: its text is held
    back until it finishes, then flushed; a stop string in that flushed text still stops
    it (finish_reason "stop", the text cut before the stop string), as it would anywhere
    else."""
    llm = make_llm(model_dir)
    tok = llm.get_tokenizer()
    # A token that decodes to a complete character followed by an incomplete one.
    forced = next(i for i in range(tok.vocab_size) if len(tok.decode([i])) > 1
                  and tok.decode([i]).endswith("\ufffd")
                  and "\ufffd" not in tok.decode([i])[:-1])
    head = tok.decode([forced])[:-1]
    model = llm.llm_engine.runner.model
    compute_logits = model.compute_logits

    def forcing(hidden: torch.Tensor) -> torch.Tensor:  # every row samples ``forced``
        logits = compute_logits(hidden)
        logits[:, forced] = logits.max() + 100
        return logits

    model.compute_logits = forcing
    try:
        prompt = [5, 6, 7]
        # max_tokens ends it on the token that holds the stop string back.
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1,
                                                    stop=[head]), use_tqdm=False)[0]
        c = out.outputs[0]
        assert c.token_ids == [forced]
        assert (c.finish_reason, c.stop_reason, c.text) == ("stop", head, ""), c
        kept = llm.generate([prompt], SamplingParams(
            temperature=0, max_tokens=1, stop=[head], include_stop_str_in_output=True),
            use_tqdm=False)[0].outputs[0]
        assert (kept.finish_reason, kept.text) == ("stop", head), kept
        # Without a stop string the flushed text is all there (U+FFFD for the partial byte).
        plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1),
                             use_tqdm=False)[0].outputs[0]
        assert (plain.finish_reason, plain.text) == ("length", head + "\ufffd"), plain
    finally:
        del model.compute_logits
