"""The sandboxed process (``python -I sandbox_child.py CONFIG``): lock itself down, then run main.py.

Standard library only: it runs before anything else is imported, in a new session made by the
parent (``relax.agents.sandbox``). Order matters: namespaces and Landlock need privileges the uid
switch gives up; the rlimits come last so that setting up is not what hits them. Whatever cannot be
enforced here is written to the status file (the parent reports it), never silently assumed.
"""

import ctypes
import json
import os
import resource
import runpy
import struct
import sys

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS = 4, 38
SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446  # same on every architecture
# Landlock filesystem rights (uapi/linux/landlock.h)
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1, 2, 4, 8
FILE_RIGHTS_EXTRA = {3: 1 << 14, 5: 1 << 15}  # TRUNCATE (ABI 3), IOCTL_DEV (ABI 5): file-applicable too
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/local/lib")

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def _err() -> str:
    return os.strerror(ctypes.get_errno())


def isolate_network() -> bool:
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    return libc.unshare(flags) == 0


def landlock(readable: list, writable: list, deny_tcp: bool) -> tuple:
    """Restrict this process to reading ``readable`` and writing ``writable``; (files, tcp) enforced."""
    abi = libc.syscall(SYS_CREATE_RULESET, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    if abi < 1:
        return False, False
    handled = (1 << 13) - 1 | (1 << 13 if abi >= 2 else 0)
    file_rights = EXECUTE | WRITE_FILE | READ_FILE
    for since, bit in FILE_RIGHTS_EXTRA.items():
        if abi >= since:
            handled |= bit
            file_rights |= bit
    net = 3 if deny_tcp and abi >= 4 else 0  # BIND_TCP | CONNECT_TCP, no rule allows any port
    attr = struct.pack("QQ", handled, net) if abi >= 4 else struct.pack("Q", handled)
    fd = libc.syscall(SYS_CREATE_RULESET, attr, len(attr), 0)
    if fd < 0:
        raise OSError(f"landlock_create_ruleset: {_err()}")
    read = EXECUTE | READ_FILE | READ_DIR
    for paths, rights in ((readable, read), (writable, handled)):
        for path in paths:
            try:
                target = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            allowed = rights if os.path.isdir(path) else rights & file_rights
            rule = struct.pack("=Qi", allowed, target)
            if libc.syscall(SYS_ADD_RULE, fd, 1, rule, 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                raise OSError(f"landlock_add_rule {path}: {_err()}")
            os.close(target)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(SYS_RESTRICT_SELF, fd, 0) != 0:
        raise OSError(f"landlock_restrict_self: {_err()}")
    os.close(fd)
    return True, bool(net)


def become(uid: int) -> None:
    """Switch to the call's own uid, keeping the import path reachable through directory fds
    (the interpreter may live under a directory only root can enter, e.g. /root/.pyenv)."""
    moved = {}
    for entry in sys.path:
        if entry and os.path.isdir(entry) and entry not in moved:
            moved[entry] = f"/proc/self/fd/{os.open(entry, os.O_RDONLY | os.O_DIRECTORY)}"
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    libc.prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # keeps /proc/self/fd readable after the uid switch

    def reachable(path: str) -> str:
        for old in sorted(moved, key=len, reverse=True):
            if path == old or path.startswith(old + os.sep):
                return moved[old] + path[len(old) :]
        return path

    sys.path[:] = [reachable(p) for p in sys.path]
    for module in list(sys.modules.values()):  # packages already imported find submodules by __path__
        path = getattr(module, "__path__", None)
        if isinstance(path, list):
            path[:] = [reachable(p) for p in path]
    sys.path_importer_cache.clear()


def set_limits(limits: dict, nproc_base: int) -> None:
    mb = 1 << 20
    for which, value in (
        (resource.RLIMIT_CPU, (limits["cpu_s"], limits["cpu_s"] + 1)),
        (resource.RLIMIT_AS, (limits["memory_mb"] * mb,) * 2),
        (resource.RLIMIT_FSIZE, (limits["max_file_mb"] * mb,) * 2),
        (resource.RLIMIT_NPROC, (nproc_base + limits["max_processes"],) * 2),
        (resource.RLIMIT_NOFILE, (256, 256)),
        (resource.RLIMIT_CORE, (0, 0)),
    ):
        resource.setrlimit(which, value)


def main() -> None:
    config = json.loads(sys.argv[1])
    limits, uid, work = config["limits"], config["uid"], config["work"]
    status = {"network": limits["network"], "files": False, "processes": False}
    try:
        with open(config["status"], "w") as report:  # opened now: Landlock does not reach open files
            if not limits["network"]:
                status["network"] = isolate_network()
            if limits["restrict_files"]:
                prefixes = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
                readable = sorted(
                    prefixes | {p for p in sys.path if p} | set(LIBRARY_DIRS) | {"/dev/urandom", "/dev/zero"}
                )
                try:
                    status["files"], tcp_denied = landlock(
                        readable, [work, "/dev/null"], deny_tcp=not limits["network"]
                    )
                except (
                    OSError
                ) as exc:  # nothing applied (restrict_self is the last call): reported, not fatal
                    status["landlock_error"], tcp_denied = str(exc), False
                status["network"] = status["network"] or tcp_denied
            if uid is not None:
                try:
                    become(uid)
                except OSError as exc:  # no CAP_SETUID (a restricted container): stays root, reported
                    status["uid_error"], uid = str(exc), None
            status["processes"] = uid is not None or os.geteuid() != 0
            json.dump(status, report)
        set_limits(limits, config["nproc_base"])
    except Exception as exc:  # noqa: BLE001 - reported as exit code 120, the parent names it
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        sys.exit(120)
    sys.argv = ["main.py"]
    runpy.run_path(os.path.join(work, "main.py"), run_name="__main__")


if __name__ == "__main__":
    main()
