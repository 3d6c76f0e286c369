"""Python callables the ``tools`` environment tests load as ``"agent_tool_funcs:<name>"``."""

from __future__ import annotations

import time
from typing import Literal


def lookup(key: str, default: str = "?") -> str:
    """Look a word up in a tiny dictionary.

    Args:
        key: the word to look up
        default: what to answer for an unknown word
    """
    return {"relax": "an RL engine"}.get(key, default)


def stats(values: list[float], kind: Literal["sum", "max"] = "sum") -> dict:
    """Sum or maximum of some numbers."""
    return {"kind": kind, "value": sum(values) if kind == "sum" else max(values)}


def explode(reason: str) -> str:
    """Always raises."""
    raise ValueError(f"exploded because {reason}")


def hang(seconds: float) -> str:
    """Sleeps longer than any tool timeout in the tests."""
    time.sleep(seconds)
    return "woke up"


def raw_bytes(valid: bool) -> bytes:
    """Bytes that are (or are not) UTF-8."""
    return "héllo".encode() if valid else b"caf\xe9 \xff"


def spin(seconds: float) -> str:
    """Burns CPU in pure Python for ``seconds`` (longer than any tool timeout in the tests)."""
    import os

    with open(os.environ["SPIN_PID_FILE"], "w") as fh:  # where the test finds the process that spins
        fh.write(str(os.getpid()))
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1
    return str(n)


def crash(code: int) -> str:
    """Kills its own process (a segfault, the OOM killer)."""
    import os

    os._exit(code)
