"""The `vllm-lite` command line.

    vllm-lite generate --model smollm2-135m "Hello, my name is" "The capital of France is"
    vllm-lite generate --model smollm2-135m --chat "What is the capital of France?"
    vllm-lite serve --model smollm2-135m --host 127.0.0.1 --port 8000 [--api-key KEY]
    vllm-lite bench throughput|latency|kernels|linear|moe|elementwise|sampler|profile [--quick] [--threads 1]
    vllm-lite --version

`generate` prints each prompt's completion, then the throughput of the run; `serve` runs
the OpenAI-compatible server (vllm_lite.entrypoints.openai.api_server).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import logging
import os
import re
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any
from collections.abc import Sequence

from vllm_lite.config import THREADS_HELP, EngineArgs, set_threads

if TYPE_CHECKING:
    from vllm_lite import LLM

logger = logging.getLogger(__name__)


_FMT = argparse.RawDescriptionHelpFormatter


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts and print them",
                       description="Generate completions for prompts and print them. Greedy "
                                   "by default (--temperature 0); set --temperature (and "
                                   "--top-p / --top-k) to sample.", formatter_class=_FMT)
    p.add_argument("prompts", nargs="+", help="prompt texts (chat messages with --chat)")
    p.add_argument("--chat", action="store_true",
                   help="treat each prompt as a user message under the chat template")
    p.add_argument("--max-tokens", type=int, default=64,
                   help="tokens to generate per completion (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy decoding (default: %(default)s, "
                        "greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass "
                                                             "(default: %(default)s, off)")
    p.add_argument("--top-k", type=int, default=-1,
                   help="sample among the k likeliest tokens (default: %(default)s, off)")
    p.add_argument("--n", type=int, default=1, help="completions per prompt "
                                                    "(default: %(default)s)")
    _add_engine_args(p, defaults={"seed": None}, helps={"seed": (
        "sampling seed: each prompt's samples come from a generator seeded with it, and the "
        "engine's seed is set to it (default: unseeded requests, engine seed "
        f"{EngineArgs.seed})")})
    _add_threads_arg(p)


def _add_engine_args(p: argparse.ArgumentParser, **kw: Any) -> None:
    """The LLM's (engine's) options, shared by the subcommands that build one: a flag per
    EngineArgs field, its default and help from there."""
    EngineArgs.add_cli_args(p, **kw)


def _add_threads_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=None, help=THREADS_HELP)


def _make_llm(args: argparse.Namespace) -> LLM:
    import torch

    from vllm_lite import LLM

    # Before the model loads: torch sizes its thread pool once, at the first parallel op.
    set_threads(getattr(args, "threads", None))
    engine_args = EngineArgs.from_cli_args(args)
    options = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(EngineArgs)
               if f.name != "model"}
    try:
        return LLM(engine_args.model, **options)
    except (OSError, MemoryError, torch.OutOfMemoryError) as e:
        # Loading failed past the loader's checks (a file unreadable midway, memory the
        # size estimate did not foresee): a one-line error like any bad argument.
        raise ValueError(f"cannot load model {args.model!r}: {type(e).__name__}: {e}") \
            from None


def _run_generate(args: argparse.Namespace) -> int:
    from vllm_lite import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed)
    llm = _make_llm(args)
    start = time.perf_counter()
    if args.chat:
        outputs = [llm.chat([{"role": "user", "content": p}], params, use_tqdm=False)[0]
                   for p in args.prompts]
    else:
        outputs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - start
    generated = 0
    for prompt, out in zip(args.prompts, outputs):
        for completion in out.outputs:
            generated += len(completion.token_ids)
            print(f"--- {prompt!r}" + (f" [{completion.index}]" if args.n > 1 else ""))
            print(completion.text)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"--- {len(outputs)} requests, {prompt_tokens} prompt tokens, {generated} generated "
          f"tokens in {elapsed:.2f} s: {generated / elapsed:.1f} output tokens/s, "
          f"{len(outputs) / elapsed:.2f} requests/s")
    return 0


def _serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                       description="Run the OpenAI-compatible HTTP server.",
                       formatter_class=_FMT)
    from vllm_lite.entrypoints.openai.api_server import ServerConfig

    # Defaults from ServerConfig: a default lives in one place.
    defaults = {f.name: f.default for f in dataclasses.fields(ServerConfig)}
    p.add_argument("--host", default=defaults["host"],
                   help="address to bind (default: %(default)s; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=defaults["port"], help="(default: %(default)s)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_LITE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "and /get_load (default: $VLLM_LITE_API_KEY)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the alias, or the model "
                        "folder's / .gguf file's name; never the path)")
    for name, help_text in _SERVER_LIMITS.items():
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        p.add_argument(flag, dest=name, type=type(defaults[name]), default=defaults[name],
                       help=f"{help_text} (default: %(default)s)")
    p.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="accept only these Host header values (DNS rebinding protection for a "
                        "server without an API key; default: any)")
    p.add_argument("--log-level", default=defaults["log_level"],
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="(default: %(default)s)")
    # Every engine option; --max-logprobs is also the server's limit on logprobs /
    # top_logprobs (ServerConfig.max_logprobs), so the two cannot disagree.
    _add_engine_args(p, helps={"max_logprobs": (
        "the most logprobs / top_logprobs / prompt_logprobs one request may ask for: the "
        "engine's and the server's limit")})
    _add_threads_arg(p)


# ServerConfig fields with a flag of their own (README: "Limits and security"); the
# defaults are read from ServerConfig.
_SERVER_LIMITS = {
    "max_n": "the largest n / best_of accepted",
    "max_request_bytes": "request bodies past this many bytes are refused with 413",
    "max_prompts_per_request": "the most prompts in one /v1/completions request",
    "max_chat_messages": "the most messages in one chat request",
    "max_connections": "open connections served; past it only /health is answered",
    "read_timeout_s": "seconds a client has to send a request's headers, and its body",
    "keep_alive_timeout_s": "seconds an idle keep-alive connection stays open",
    "stream_timeout_s": "seconds a stream's output may wait unread before the request is "
                        "aborted (a client that stopped reading)",
    "tokenizer_threads": "threads that tokenize and apply chat templates off the event loop",
    "drain_timeout_s": "on SIGTERM / Ctrl-C: stop accepting, give in-flight requests this "
                       "many seconds to finish, then exit",
    "batching_delay_ms": "an idle engine waits up to this many ms after a request arrives "
                         "(or until max_num_seqs wait) before its first prefill, so a burst "
                         "shares a step (adds up to this much TTFT)",
}


def _run_serve(args: argparse.Namespace) -> int:
    from vllm_lite.entrypoints.openai.api_server import ServerConfig, default_served_name, serve

    try:
        config = ServerConfig(host=args.host, port=args.port, api_key=args.api_key,
                              served_model_name=(args.served_model_name
                                                 or default_served_name(args.model)),
                              log_level=args.log_level, allowed_hosts=args.allowed_hosts,
                              max_logprobs=args.max_logprobs,
                              **{name: getattr(args, name) for name in _SERVER_LIMITS})
    except ValueError as e:  # a bad server option: one line, exit status 2 as any bad input
        raise ValueError(f"serve: {e}") from None
    logging.getLogger().setLevel(args.log_level.upper())
    serve(_make_llm(args).llm_engine, config)
    return 0


def plain_text(text: str) -> str:
    """A docstring line as --help shows it: without reST markup (``code``, :role:`x`)."""
    text = re.sub(r":[a-z]+:`~?([^`]*)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    return text.replace("``", "").replace("`", "")


# The benchmarks live in the source checkout's benchmarks/ folder, never in the installed
# package; this variable names that folder when the working directory is not the checkout.
BENCHMARKS_ENV = "VLLM_LITE_BENCHMARKS"
BENCH_KINDS = ("throughput", "latency", "kernels", "linear", "moe", "elementwise", "sampler",
               "profile")


def benchmarks_dir() -> Path | None:
    """The checkout's benchmarks/ folder: ``$VLLM_LITE_BENCHMARKS`` when set, else the one
    beside the imported vllm_lite (a checkout built in place), else the working
    directory's (a checkout whose package was installed). None when there is none."""
    import vllm_lite

    env = os.environ.get(BENCHMARKS_ENV)
    if env:
        folder = Path(env).expanduser()
        if not (folder / "__init__.py").is_file():
            raise ValueError(f"{BENCHMARKS_ENV}={env!r} is not the benchmarks/ folder of a "
                             "vllm_lite checkout (no __init__.py there)")
        return folder.resolve()
    for root in (Path(vllm_lite.__file__).resolve().parent.parent, Path.cwd()):
        # A vllm_lite checkout's root, not site-packages (where another distribution may
        # have put a package named benchmarks).
        if ((root / "benchmarks" / "__init__.py").is_file() and (root / "setup.py").is_file()
                and (root / "vllm_lite" / "__init__.py").is_file()):
            return (root / "benchmarks").resolve()
    return None


def load_benchmarks(folder: Path) -> ModuleType:
    """The package ``benchmarks`` from ``folder``, imported from that path (not through
    sys.path, where a package of the same name could shadow it)."""
    folder = Path(folder).resolve()
    loaded = sys.modules.get("benchmarks")
    if loaded is not None:
        if Path(loaded.__file__ or "").resolve().parent != folder:
            raise ValueError(f"another module named benchmarks is already imported "
                             f"({loaded.__file__}), not {folder}")
        return loaded
    spec = importlib.util.spec_from_file_location(
        "benchmarks", folder / "__init__.py", submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["benchmarks"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["benchmarks"]
        raise
    return module


def _benchmarks_missing() -> str:
    return ("the benchmarks are not part of the installed package: they live in the source "
            "checkout's benchmarks/ folder. Run `vllm-lite bench` from the root of a clone "
            f"of the repository, or set {BENCHMARKS_ENV} to its benchmarks/ folder")


def _bench_parser(sub: argparse._SubParsersAction, load: bool = True) -> None:
    """``load``: the command is ``bench``, so its subcommands come from the checkout's
    benchmarks (other commands never import them)."""
    help_ = ("benchmark vllm_lite's engine against HF transformers, or its kernels "
             "(from a source checkout)")
    folder = benchmarks_dir() if load else None
    if folder is None:
        p = sub.add_parser("bench", help=help_, description=(
            _benchmarks_missing() + "." if load else help_))
        p.add_argument("bench", nargs="?", metavar="|".join(BENCH_KINDS))
        p.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        p.set_defaults(benchmarks_missing=True)
        return
    p = sub.add_parser("bench", help=help_)
    kinds = p.add_subparsers(dest="bench", required=True)
    load_benchmarks(folder)
    from benchmarks import (elementwise, kernels, latency, linear, moe, sampler, step_profile,
                            throughput)

    for name, module in (("throughput", throughput), ("latency", latency)):
        summary = plain_text(module.__doc__.splitlines()[0])
        module.add_arguments(kinds.add_parser(name, help=summary, description=summary))
    kernels.add_arguments(kinds.add_parser(
        "kernels", help="paged-attention kernel benchmark (benchmarks/kernels.py)",
        description=kernels.__doc__.split("\n\n")[0], epilog=kernels.EPILOG,
        formatter_class=_FMT))
    linear.add_arguments(kinds.add_parser(
        "linear", help="int8 vs float32 linear-layer benchmark (benchmarks/linear.py)",
        description=linear.__doc__.split("\n\n")[0], formatter_class=_FMT))
    moe.add_arguments(kinds.add_parser(
        "moe", help="the fused MoE op vs the same block in torch ops (benchmarks/moe.py)",
        description=plain_text(moe.__doc__.split("\n\n")[0]), formatter_class=_FMT))
    elementwise.add_arguments(kinds.add_parser(
        "elementwise", help="native element-wise ops vs the torch code they replaced "
                            "(benchmarks/elementwise.py)",
        description=elementwise.__doc__.split("\n\n")[0], formatter_class=_FMT))
    sampler.add_arguments(kinds.add_parser(
        "sampler", help="the sampler vs HF transformers' sampling step "
                        "(benchmarks/sampler.py)",
        description=sampler.__doc__.split("\n\n")[0], formatter_class=_FMT))
    step_profile.add_arguments(kinds.add_parser(
        "profile", help="where an engine step's time goes, prefill and decode "
                        "(benchmarks/step_profile.py)",
        description=step_profile.__doc__.split("\n\n")[0], formatter_class=_FMT))


def _run_bench(args: argparse.Namespace) -> int:
    if getattr(args, "benchmarks_missing", False):  # the parser found no checkout
        print(f"vllm-lite bench: {_benchmarks_missing()}", file=sys.stderr)
        return 2
    from benchmarks import (elementwise, kernels, latency, linear, moe, sampler, step_profile,
                            throughput)
    from benchmarks.common import run_cli

    if args.bench == "kernels":
        return kernels.run_args(kernels.finish_args(args))
    if args.bench == "linear":
        return linear.run_args(args)
    if args.bench == "moe":
        return moe.run_args(args)
    if args.bench == "elementwise":
        return elementwise.run_args(args)
    if args.bench == "sampler":
        return sampler.run_args(args)
    if args.bench == "profile":
        return step_profile.run_args(args)
    module = {"throughput": throughput, "latency": latency}[args.bench]
    return run_cli(f"vllm-lite bench {args.bench}", module.run, args)


def _worker_parser(sub: argparse._SubParsersAction) -> None:
    sub.add_parser(
        "worker", help="a tensor-parallel rank on another machine (joins the engine started "
                       "with --tensor-parallel-size)",
        description="Runs tensor-parallel rank RANK of the engine whose driver (rank 0: "
        "`vllm-lite serve` / `generate` / LLM with --tensor-parallel-size WORLD_SIZE) listens "
        "at MASTER_ADDR:MASTER_PORT; the engine's options come from the driver. Environment "
        "(torchrun's): MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK, LOCAL_RANK (its CUDA "
        "device). Exits when the engine shuts down or its connection drops.")


def _run_worker(args: argparse.Namespace) -> int:
    from vllm_lite.worker.tp_processes import worker_main

    return worker_main()


def main(argv: Sequence[str] | None = None) -> int:
    import vllm_lite

    parser = argparse.ArgumentParser(prog="vllm-lite", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {vllm_lite.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _serve_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        _bench_parser(sub, load=argv[:1] == ["bench"])
    except ValueError as e:  # VLLM_LITE_BENCHMARKS names no benchmarks folder
        print(f"vllm-lite: error: {e}", file=sys.stderr)
        return 2
    _worker_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    run = {"generate": _run_generate, "serve": _run_serve, "bench": _run_bench,
           "worker": _run_worker}[args.command]
    try:
        return run(args)
    except ValueError as e:  # bad arguments or input: say why, no traceback
        print(f"vllm-lite: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
