"""The engine's error types, so that an error means one thing.

- ``ValueError``: the caller's input is bad (a 400 from the server, exit code 2 from the
  CLI). Raised where a request or an option is admitted, naming the field.
- ``InternalError``: an invariant inside the engine broke (a bug: a 500 from the server,
  a traceback in the log). Never raised for anything a user can send.
"""

from __future__ import annotations


class InternalError(RuntimeError):
    """A broken invariant inside core/ or engine/: a bug, never the user's input."""


class DistributedError(RuntimeError):
    """A tensor-parallel rank died, hung past ``distributed_timeout`` or disconnected. The
    ranks' states may now differ, so the engine cannot go on: it shuts every process down
    and raises this (again on every later call)."""
