"""The process that renders chat templates (see :mod:`vllm_lite.entrypoints.chat_template`).

A chat template is code that came with a model file: Jinja in a sandbox, but free to loop
for hours or build a string of gigabytes in one operation. It runs here, in a small process
of its own (no torch, no vllm_lite: run as a script, it imports only the standard library
and jinja2), under an address-space limit, so that the engine's process can kill it at a
deadline and never runs out of memory because of it.

Protocol: one JSON object a line on stdin, one JSON object a line back on stdout.
The first line out is ``{"ready": true}``. A request is ``{"template": source, "context":
{...template variables}, "max_chars": n}``; the answer is ``{"text": rendered}`` or
``{"error": "<ExceptionType>: <message>", "kind": "template" | "too_long" | "memory"}``.

The environment mirrors the one transformers renders ``apply_chat_template`` in (a sandbox
with trim_blocks / lstrip_blocks, loop controls, ``{% generation %}`` blocks, tojson,
raise_exception, strftime_now, dict and namespace), so the text is the same; a test checks
that against transformers on real templates.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


class _TooLong(Exception):
    pass


class _GenerationBlocks(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks the assistant's text for training
    masks; rendering a prompt needs only its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """``dict(...)`` and ``dict.fromkeys(...)`` without the type object itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names (no way into the object's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805  (Namespace's own trick)
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"a namespace attribute may not start with an underscore: {name!r}")


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlocks, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_Dict(), namespace=_Namespace)
    return env


def _render(env: ImmutableSandboxedEnvironment, compiled: dict[str, Any],
            request: dict[str, Any]) -> str:
    source = request["template"]
    template = compiled.get(source)
    if template is None:
        if len(compiled) >= 8:  # a server has one template; keep a few, never grow
            compiled.clear()
        template = compiled[source] = env.from_string(source)
    limit = int(request["max_chars"])
    parts: list[str] = []
    size = 0
    # generate() yields the output piece by piece: the cap holds while it is written.
    for piece in template.generate(**request["context"]):
        size += len(piece)
        if size > limit:
            raise _TooLong(f"the rendered text passed {limit} characters")
        parts.append(piece)
    return "".join(parts)


def _limit_memory(limit_bytes: int) -> None:
    try:
        import resource
    except ImportError:  # not a POSIX system: the deadline still holds
        return
    resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def main() -> None:
    _limit_memory(int(sys.argv[1]))
    env = _environment()
    compiled: dict[str, Any] = {}
    out = sys.stdout
    out.write('{"ready": true}\n')
    out.flush()
    for line in sys.stdin:
        try:
            answer: dict[str, Any] = {"text": _render(env, compiled, json.loads(line))}
        except _TooLong as e:
            answer = {"error": str(e), "kind": "too_long"}
        except MemoryError:
            answer = {"error": "MemoryError: the template needed more memory than its limit",
                      "kind": "memory"}
        except Exception as e:  # noqa: BLE001  (any failure of the template is reported)
            answer = {"error": f"{type(e).__name__}: {e}", "kind": "template"}
        try:
            text = json.dumps(answer)
        except MemoryError:
            text = json.dumps({"error": "MemoryError: the answer did not fit the memory limit",
                               "kind": "memory"})
        out.write(text + "\n")
        out.flush()


if __name__ == "__main__":
    main()
