"""EngineArgs is the one source of engine options: every field is a flag of generate, serve
(and, for the options they take, the benchmarks) with its default; LLM's keywords default
to it; serve passes every option to the engine. Also --version, --threads and what
dtype="auto" picks."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from models.helpers import make_config, save_hf_model  # noqa: E402  (tests/ is on sys.path)
from vllm_lite import config as C  # noqa: E402
from vllm_lite.config import EngineArgs  # noqa: E402
from vllm_lite.entrypoints import cli  # noqa: E402

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("engine_args_llama")
    save_hf_model(make_config("llama"), folder)  # max_position_embeddings 256
    return folder


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    cli._generate_parser(sub)
    cli._serve_parser(sub)
    cli._bench_parser(sub)
    return parser


def _subparser(parser: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


# -- flags from fields ----------------------------------------------------------------------
@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_field_is_a_flag_with_its_default(command: str) -> None:
    parser = _parser()
    argv = [command] + (["hi"] if command == "generate" else [])
    args = parser.parse_args(argv)
    sub = _subparser(parser, command)
    flags = {a.dest: a for a in sub._actions}
    for name in FIELDS:
        assert name in flags, f"{command} has no flag for {name}"
        assert flags[name].option_strings == [EngineArgs.flag(name)]
        assert flags[name].help, name
        if command == "generate" and name == "seed":
            # generate's --seed seeds the requests too; unset, the engine keeps its default.
            assert args.seed is None
            continue
        assert getattr(args, name) == EngineArgs.defaults()[name], name
    # Unset flags give exactly EngineArgs' defaults.
    assert EngineArgs.from_cli_args(args) == EngineArgs()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_help_shows_the_defaults(command: str) -> None:
    text = _subparser(_parser(), command).format_help()
    for name in ("block_size", "max_num_seqs", "kv_cache_space", "swap_space",
                 "gpu_memory_utilization", "scheduling_policy", "max_logprobs"):
        default = EngineArgs.defaults()[name]
        assert EngineArgs.flag(name) in text
        assert f"(default: {default})" in " ".join(text.split()), (name, text)
    assert "--threads" in text
    if command == "generate":
        assert "greedy" in text


def test_bench_flags_come_from_engine_args() -> None:
    from benchmarks.common import BENCH_ENGINE_OPTIONS

    parser = _parser()
    for kind in ("throughput", "latency"):
        args = parser.parse_args(["bench", kind])
        for name in BENCH_ENGINE_OPTIONS:
            if kind == "throughput" and name == "kv_cache_space":
                assert args.kv_cache_space is None  # sized by --quick, else EngineArgs'
                continue
            assert getattr(args, name) == EngineArgs.defaults()[name], (kind, name)
        assert args.threads is None
    from benchmarks import throughput

    assert throughput.SIZES["kv_cache_space"][0] == EngineArgs.kv_cache_space
    args = parser.parse_args(["bench", "kernels", "--quick"])
    assert args.quick and args.threads is None


@pytest.mark.parametrize("flag, bad", [("--dtype", "int8"), ("--device", "tpu"),
                                       ("--device", "cuda:x"), ("--kv-cache-dtype", "fp4"),
                                       ("--quantization", "q2"),
                                       ("--scheduling-policy", "lifo")])
def test_enumerated_flags_fail_when_parsed(flag: str, bad: str,
                                           capsys: pytest.CaptureFixture) -> None:
    """A bad enumerated value is an argparse error naming the flag, before anything (the
    model here does not exist) is resolved."""
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--model", "/no/such/model", flag, bad, "hi"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and bad in err and "no/such" not in err
    args = _parser().parse_args(["generate", "--dtype", "bf16", "--device", "cuda:1", "hi"])
    assert (args.dtype, args.device) == ("bf16", "cuda:1")  # aliases and devices still parse


def test_help_is_plain_text() -> None:
    """--help shows no reST markup (``code``, :class:`x`) from the docstrings it quotes."""
    parser = _parser()
    texts = [parser.format_help()]
    for path in (["generate"], ["serve"], ["bench"]):
        texts.append(_subparser(parser, *path).format_help())
    bench = _subparser(parser, "bench")
    action = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    texts += [p.format_help() for p in action.choices.values()]
    for text in texts:
        assert "`" not in text and ":class:" not in text, text
    assert cli.plain_text("against ``generate`` and :class:`~a.b.LLM`") == "against generate and LLM"


def test_no_engine_default_is_written_twice() -> None:
    """No source file of the package but config/schema.py writes an EngineArgs default as a
    keyword or field default of the same name (``block_size: int = 16``, ``max_num_seqs=256``)."""
    import re

    import vllm_lite

    root = Path(vllm_lite.__file__).resolve().parent
    offenders = []
    for name, default in EngineArgs.defaults().items():
        if default is None or isinstance(default, bool) or name in ("model", "dtype", "device",
                                                                    "seed"):
            continue  # None/False are everyone's "unset"; "auto" / 0 are too generic
        literal = re.escape(repr(default)).replace(r"\.0", r"(\.0)?")
        pattern = re.compile(rf"\b{name}\s*(:[^=\n]*)?=\s*{literal}(?![\w.])")
        for path in root.rglob("*.py"):
            if path == root / "config" / "schema.py":
                continue  # where the defaults are written (EngineArgs takes them from it)
            for no, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and "==" not in line:
                    offenders.append(f"{path.relative_to(root)}:{no}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


# -- LLM's keywords -------------------------------------------------------------------------
def test_llm_signature_defaults_are_engine_args() -> None:
    from vllm_lite import LLM

    params = inspect.signature(LLM).parameters
    assert list(params)[0] == "model" and params["model"].default is inspect.Parameter.empty
    for name, default in EngineArgs.defaults().items():
        if name != "model":
            assert params[name].default == default, name
    assert set(params) == set(FIELDS)


def test_llm_builds_its_config_from_engine_args(model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lite.entrypoints import llm as llm_mod

    seen = {}

    class FakeEngine:
        def __init__(self, config: Any, tokenizer: Any = None) -> None:
            seen["config"] = config

    monkeypatch.setattr(llm_mod, "LLMEngine", FakeEngine)
    llm = llm_mod.LLM(str(model_dir))
    assert llm.engine_args == EngineArgs(model=str(model_dir))
    expected = EngineArgs(model=str(model_dir)).create_engine_config()
    got = seen["config"]
    assert got.cache_config == expected.cache_config
    assert got.scheduler_config == expected.scheduler_config
    assert got.kv_cache_space == expected.kv_cache_space == EngineArgs.kv_cache_space
    assert got.cache_config.block_size == EngineArgs.block_size
    assert got.cache_config.swap_space == EngineArgs.swap_space
    assert got.scheduler_config.scheduling_policy == EngineArgs.scheduling_policy
    assert got.model_config.max_logprobs == EngineArgs.max_logprobs
    with pytest.raises(TypeError, match="swap_space_gib"):
        llm_mod.LLM(str(model_dir), swap_space_gib=1)


@pytest.mark.parametrize("name, bad", [("scheduling_policy", "lifo"), ("swap_space", -1),
                                       ("preemption_mode", "drop"), ("dtype", "int8"),
                                       ("device", "tpu"), ("enforce_eager", "yes"),
                                       ("async_output_proc", "sometimes")])
def test_bad_options_name_the_users_field(model_dir: Path, name: str, bad: Any) -> None:
    with pytest.raises(ValueError, match=name):
        EngineArgs(model=str(model_dir), **{name: bad}).create_engine_config()


# -- serve takes every engine option ----------------------------------------------------------
def _non_defaults(model_dir: Path) -> dict[str, Any]:
    return {
        "model": str(model_dir), "tokenizer": str(model_dir), "dtype": "bfloat16",
        "device": "cpu", "block_size": 8, "max_num_seqs": 4, "max_num_batched_tokens": 4096,
        "max_model_len": 128, "gpu_memory_utilization": 0.5, "kv_cache_space": 0.01,
        "swap_space": 0.02, "enable_prefix_caching": True, "enable_chunked_prefill": True,
        "preemption_mode": "swap", "scheduling_policy": "priority", "seed": 7,
        "num_gpu_blocks_override": 12, "max_logprobs": 5, "quantization": "int4",
        "quantization_group_size": 32, "kv_cache_dtype": "fp8_e5m2", "kv_cache_layout": "flash",
        "tensor_parallel_size": 2, "distributed_timeout": 30.0, "cpu_threads_bind": "auto",
        "enforce_eager": True, "async_output_proc": "on",
        "chat_template_timeout": 2.5, "chat_template_max_chars": 4096,
    }


def test_serve_accepts_every_engine_option(model_dir: Path) -> None:
    values = _non_defaults(model_dir)
    assert set(values) == set(FIELDS), "a new EngineArgs field needs a value here"
    argv = ["serve"]
    for name, value in values.items():
        if value is True:
            argv.append(EngineArgs.flag(name))
        else:
            assert value != EngineArgs.defaults()[name], name
            argv += [EngineArgs.flag(name), str(value)]
    args = _parser().parse_args(argv)
    engine_args = EngineArgs.from_cli_args(args)
    assert dataclasses.asdict(engine_args) == values
    # Binding threads is refused with several ranks (test_cpu_threads_bind.py): the rest of
    # the options are checked on one config.
    with pytest.raises(ValueError, match="cpu_threads_bind"):
        engine_args.create_engine_config()
    engine_args.cpu_threads_bind = None
    config = engine_args.create_engine_config()
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    assert Path(mc.model) == model_dir and Path(mc.tokenizer) == model_dir
    assert mc.dtype == torch.bfloat16 and config.device == torch.device("cpu")
    assert (cc.block_size, cc.gpu_memory_utilization, cc.swap_space,
            cc.enable_prefix_caching, cc.kv_cache_dtype) == (8, 0.5, 0.02, True, "fp8_e5m2")
    assert (sc.max_num_seqs, sc.max_num_batched_tokens, sc.max_model_len,
            sc.enable_chunked_prefill, sc.preemption_mode, sc.scheduling_policy) == (
        4, 4096, 128, True, "swap", "priority")
    assert (mc.seed, mc.max_logprobs, mc.max_model_len, mc.quantization,
            mc.quantization_group_size) == (7, 5, 128, "int4", 32)
    assert (mc.chat_template_timeout, mc.chat_template_max_chars) == (2.5, 4096)
    assert mc.enforce_eager is True
    assert (config.kv_cache_space, config.num_gpu_blocks_override) == (0.01, 12)
    pc = config.parallel_config
    assert (pc.tensor_parallel_size, pc.distributed_timeout) == (2, 30.0)


def test_serve_max_logprobs_is_the_engines_and_the_servers() -> None:
    args = _parser().parse_args(["serve", "--max-logprobs", "3"])
    assert args.max_logprobs == 3  # _run_serve gives it to ServerConfig and to the engine
    from vllm_lite.entrypoints.openai.api_server import ServerConfig

    assert ServerConfig().max_logprobs == EngineArgs.max_logprobs
    assert "max_logprobs" not in cli._SERVER_LIMITS


def test_generate_seed_seeds_engine_and_requests(model_dir: Path) -> None:
    args = _parser().parse_args(["generate", "--seed", "5", "hi"])
    assert EngineArgs.from_cli_args(args).seed == 5 and args.seed == 5


# -- --version, --threads -------------------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture) -> None:
    import vllm_lite

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-lite {vllm_lite.__version__}"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_threads_are_set_before_the_model_loads(command: str, model_dir: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_lite

    seen = []

    def fake_llm(*args: Any, **kwargs: Any) -> None:
        seen.append(torch.get_num_threads())
        raise ValueError("stop here")

    monkeypatch.setattr(vllm_lite, "LLM", fake_llm)
    before = torch.get_num_threads()
    try:
        argv = [command, "--model", str(model_dir), "--threads", "1"] + (
            ["hi"] if command == "generate" else ["--port", "0"])
        assert cli.main(argv) == 2
        assert seen == [1]
    finally:
        torch.set_num_threads(before)


def test_threads_default_leaves_torch_alone(model_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    called = []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: called.append(n))
    C.set_threads(None)
    assert called == []
    C.set_threads(2)
    assert called == [2]


@pytest.mark.parametrize("bad", ["0", "-1"])
def test_bad_threads_is_a_one_line_error(bad: str, model_dir: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    rc = cli.main(["generate", "--model", str(model_dir), "--threads", bad, "hi"])
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.strip() and not ln.startswith(("INFO ", "WARNING ", "DEBUG "))]
    assert rc == 2 and len(err) == 1 and "threads" in err[0], err


# -- dtype="auto" -----------------------------------------------------------------------------
@pytest.mark.parametrize("machine, flags, native", [
    ("x86_64", {"avx2", "fma"}, False),
    ("x86_64", {"avx512f", "avx512_bf16"}, True),
    ("x86_64", {"avx512f", "amx_bf16", "amx_tile"}, True),
    ("x86_64", {"avx512f", "avx512bw"}, False),
    ("aarch64", {"fp", "asimd", "bf16"}, True),
    ("aarch64", {"fp", "asimd"}, False),
    ("riscv64", {"bf16"}, False),
])
def test_cpu_native_bf16_detection(machine: str, flags: set, native: bool) -> None:
    assert C.cpu_has_native_bf16(flags, machine) is native


def test_this_cpu_is_read_from_cpuinfo() -> None:
    flags = C.cpu_flags()
    assert C.cpu_has_native_bf16() == C.cpu_has_native_bf16(flags)


@pytest.mark.parametrize("device, ckpt, native, want", [
    ("cpu", "float32", False, "float32"), ("cpu", "bfloat16", False, "float32"),
    ("cpu", "float16", False, "float32"), ("cpu", None, False, "float32"),
    ("cpu", "float32", True, "bfloat16"), ("cpu", "float16", True, "bfloat16"),
    ("cuda", "bfloat16", False, "bfloat16"), ("cuda", "float16", True, "float16"),
    ("cuda", "float32", True, "float32"), ("cuda", None, True, "float32"),
])
def test_auto_dtype_decision(device: str, ckpt: Any, native: bool, want: str) -> None:
    assert C.auto_dtype(device, ckpt, native_bf16=native) == want


def test_checkpoint_dtype_and_explicit_names() -> None:
    from types import SimpleNamespace

    assert C.checkpoint_dtype(SimpleNamespace(torch_dtype="bfloat16")) == "bfloat16"
    assert C.checkpoint_dtype(SimpleNamespace(dtype=torch.float16)) == "float16"
    assert C.checkpoint_dtype(SimpleNamespace()) is None
    cfg = SimpleNamespace(torch_dtype="float16")
    assert C.resolve_dtype_name("bf16", "cpu", cfg) == "bfloat16"
    assert C.resolve_dtype_name(torch.float16, "cpu", cfg) == "float16"
    assert C.resolve_dtype_name("auto", "cuda", cfg) == "float16"
    with pytest.raises(ValueError, match="dtype"):
        C.resolve_dtype_name("int4", "cpu", cfg)


@pytest.mark.parametrize("native", [False, True])
def test_engine_config_resolves_auto(model_dir: Path, native: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(C.host, "cpu_has_native_bf16", lambda *a, **k: native)
    config = EngineArgs(model=str(model_dir), device="cpu").create_engine_config()
    assert config.model_config.dtype == (torch.bfloat16 if native else torch.float32)
    # An explicit dtype is kept whatever the CPU.
    config = EngineArgs(model=str(model_dir), device="cpu",
                        dtype="float32").create_engine_config()
    assert config.model_config.dtype == torch.float32


@pytest.mark.parametrize("argv, field", [
    (["serve", "--max-n", "0"], "max_n"), (["serve", "--port", "70000"], "port"),
    (["serve", "--block-size", "0"], "block_size"),
    (["serve", "--scheduling-policy", "lifo"], "scheduling-policy"),
])
def test_serve_bad_option_is_a_one_line_error(argv: list[str], field: str, model_dir: Path,
                                              capsys: pytest.CaptureFixture) -> None:
    try:
        rc = cli.main(argv + ["--model", str(model_dir), "--device", "cpu",
                              "--kv-cache-space", "0.01"])
    except SystemExit as e:  # argparse's own refusal (choices): also status 2
        rc = e.code
    err = [ln for ln in capsys.readouterr().err.splitlines()
           if ln.strip() and not ln.startswith(("INFO ", "WARNING ", "DEBUG ", "usage:", "  "))]
    assert rc == 2 and len(err) == 1 and field in err[0], err


@pytest.mark.parametrize("kind", ["throughput", "latency"])
def test_bench_passes_its_engine_options_to_the_engine(kind: str, model_dir: Path,
                                                       tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Every engine flag a benchmark offers reaches the LLM it builds (none is ignored)."""
    from benchmarks import engines as E
    from benchmarks.common import BENCH_ENGINE_OPTIONS

    values = {k: v for k, v in _non_defaults(model_dir).items() if k in BENCH_ENGINE_OPTIONS}
    values["dtype"] = "float32"
    argv = ["bench", kind]
    for name, value in values.items():
        argv += [EngineArgs.flag(name)] + ([] if value is True else [str(value)])
    args = _parser().parse_args(argv + ["--out", str(tmp_path), "--engines", "vllm_lite"])
    seen = {}

    class Stop(Exception):
        pass

    def fake_build_llm(model: str, dtype: str, device: str, **options: Any) -> None:
        seen.update(options, model=model, dtype=dtype, device=device)
        raise Stop

    monkeypatch.setattr(E, "build_llm", fake_build_llm)
    module = __import__(f"benchmarks.{kind}", fromlist=["run"])
    with pytest.raises(Stop):
        module.run(args)
    for name, value in values.items():
        if name in ("model", "dtype", "device"):
            continue
        assert seen[name] == value, name
    assert Path(seen["model"]) == model_dir and seen["dtype"] == "float32"


def test_startup_info_says_once_what_runs(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Starting an engine logs one line for the weights (dtype and quantization together,
    never "loaded ... float32" then "quantized ... to int8") and one for the KV cache."""
    import logging

    from vllm_lite import LLM

    with caplog.at_level(logging.INFO, logger="vllm_lite"):
        LLM(str(model_dir), device="cpu", dtype="float32", quantization="int8",
            kv_cache_space=0.01, swap_space=0.01)
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    weights = [m for m in lines if m.startswith("model:")]
    assert len(weights) == 1 and "int8" in weights[0] and "float32" in weights[0], lines
    assert sum(m.startswith("engine:") for m in lines) == 1, lines
    assert not [m for m in lines if m.startswith(("loaded", "quantized", "dtype auto"))], lines
