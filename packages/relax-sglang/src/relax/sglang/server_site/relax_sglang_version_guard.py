"""Which SGLang release Relax's server patches and the endpoints it calls were written for, and the check.

The patches (``relax_sglang_server_patches``) replace private SGLang internals; under another release a
renamed attribute would raise inside a model module's import and kill the server deep in a run. So a server
whose SGLang is not the release they were written for stops at start-up, with both versions in the message
(``RELAX_SGLANG_SKIP_VERSION_CHECK=1`` lets you try another release at your own risk). The engine separately
checks that an attached or launched server is at least :data:`ENDPOINTS_SINCE` (``/begin_weight_update``,
per-token ``weight_versions``), which older releases answer with 404 mid-run.

Runs in the server's interpreter too (``sitecustomize``): standard library only, no Relax imports.
"""

from __future__ import annotations

import os
import re

PATCHED_FOR = "0.5.23"  # the release the server patches target (= server/pyproject.toml's pin)
ENDPOINTS_SINCE = "0.5.23"  # the oldest release with every endpoint and response field the engine uses
SKIP_ENV = "RELAX_SGLANG_SKIP_VERSION_CHECK"


class SGLangVersionError(RuntimeError):
    """The SGLang release is not one this Relax was written for (the message names both)."""


def release(version: str) -> tuple[int, ...]:
    """The numeric release of a version string: ``"0.5.23.post1"`` -> (0, 5, 23); unparsable -> ()."""
    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def patches_problem(found: str | None, written_for: str = PATCHED_FOR) -> str | None:
    """Why the server patches must not load under SGLang ``found`` (None: they may; so may a process
    without SGLang, where they never fire). Post releases of the same version are accepted."""
    if found is None or release(found)[:3] == release(written_for)[:3]:
        return None
    return (
        f"Relax's SGLang server patches were written for sglang {written_for}, but this server's environment "
        f"has sglang {found}; install sglang=={written_for} there, or set {SKIP_ENV}=1 to try it anyway"
    )


def endpoints_problem(found: str | None, since: str = ENDPOINTS_SINCE) -> str | None:
    """Why a server reporting SGLang ``found`` cannot serve the Relax engine (None: it can)."""
    if found is not None and release(found) and release(found) >= release(since):
        return None
    return (
        f"the Relax sglang engine needs sglang >= {since} (/begin_weight_update, /end_weight_update and "
        f"per-token weight versions), but the server reports sglang {found or 'unknown'}"
    )


def installed_sglang() -> str | None:
    """This interpreter's installed SGLang release, None without one (read from metadata: nothing imported)."""
    from importlib import metadata

    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_patches(found: str | None) -> None:
    """Raise :class:`SGLangVersionError` unless the patches fit ``found`` (or the check is switched off)."""
    problem = patches_problem(found)
    if problem and os.environ.get(SKIP_ENV) != "1":
        raise SGLangVersionError(problem)
