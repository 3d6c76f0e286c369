"""Disk errors that say what happened: the operation, the path and the cause.

Writers below us often lose the OS error: ``torch.save`` on a full disk raises ``unexpected pos
948544 vs 948432``, Ray wraps whatever the trainer actor raised. So after a failed write we look
for an errno in the exception chain and, failing that, ask the file system (read-only flag, free
space, the process's file-size limit) -- and only then call it a disk error; anything else is
re-raised unchanged.
"""

from __future__ import annotations

import errno
import os
import re
import resource
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: errnos that are the disk's fault, and how we name them
DISK_ERRNOS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EFBIG: "file too large",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EIO: "input/output error",
}
#: below this much free space a failed write is blamed on a full disk
LOW_SPACE_BYTES = 1 << 20
_ERRNO_IN_TEXT = re.compile(r"\[Errno (\d+)\]|\(os error (\d+)\)|Os \{ code: (\d+)")


class DiskError(OSError):
    """A write failed because of the disk; ``str()`` names the operation, path and cause."""

    def __init__(self, message: str, code: int | None, path: str) -> None:
        super().__init__(message)
        self.message, self.errno, self.filename = message, code, path

    def __str__(self) -> str:
        return self.message


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "cause", None)]  # Ray's RayTaskError.cause


def errno_of(exc: BaseException) -> int | None:
    """A disk errno carried by ``exc`` or its causes (also when only its text has it, as from Rust)."""
    for e in _chain(exc):
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return e.errno
        for match in _ERRNO_IN_TEXT.finditer(str(e)):
            code = int(next(g for g in match.groups() if g))
            if code in DISK_ERRNOS:
                return code
    return None


def _existing(path: Path) -> Path | None:
    return next((a for a in (path, *path.parents) if os.path.lexists(a)), None)


def _largest_file(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    sizes = [f.stat().st_size for f in path.rglob("*") if f.is_file()] if path.is_dir() else []
    return max(sizes, default=0)


def diagnose(path: str | Path) -> tuple[int, str] | None:
    """(errno, detail) if the file system explains a failed write under ``path``, else None."""
    where = _existing(Path(path).absolute())
    if where is None:
        return None
    try:
        st = os.statvfs(where)
    except OSError:
        return None
    if st.f_flag & os.ST_RDONLY:
        return errno.EROFS, DISK_ERRNOS[errno.EROFS]
    free = st.f_bavail * st.f_frsize
    if free < LOW_SPACE_BYTES:
        return errno.ENOSPC, f"{DISK_ERRNOS[errno.ENOSPC]} ({free} bytes free)"
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY and _largest_file(where) >= limit:
        return (
            errno.EFBIG,
            f"{DISK_ERRNOS[errno.EFBIG]} (the process file-size limit RLIMIT_FSIZE is {limit} bytes)",
        )
    if not os.access(where, os.W_OK):
        return errno.EACCES, DISK_ERRNOS[errno.EACCES]
    return None


def disk_error(operation: str, path: str | Path, exc: BaseException) -> DiskError | None:
    """A ``DiskError`` for ``exc`` raised while writing ``path``, or None if the disk is not to blame."""
    code = errno_of(exc)
    detail = DISK_ERRNOS.get(code) if code is not None else None
    if code is None:
        found = diagnose(path)
        if found is None:
            return None
        code, detail = found
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return DiskError(
        f"{operation}: cannot write {str(path)!r}: {detail} ({type(exc).__name__}: {first_line})",
        code,
        str(path),
    )


@contextmanager
def disk_guard(operation: str, path: str | Path) -> Iterator[None]:
    """Re-raise a failed write under ``path`` as a ``DiskError`` when the disk is to blame."""
    try:
        yield
    except DiskError:
        raise
    except Exception as exc:
        err = disk_error(operation, path, exc)
        if err is None:
            raise
        raise err from exc
