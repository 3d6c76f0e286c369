"""``relax status | engines | scale-out | scale-in | pause | resume | checkpoint``: a client of the
control API of a running ``relax run`` (address and token from flags or the environment)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

ADDRESS_ENV, TOKEN_ENV = "RELAX_CONTROL_ADDRESS", "RELAX_CONTROL_TOKEN"
DEFAULT_ADDRESS = "http://127.0.0.1:8321"
TERMINAL = ("active", "done", "failed", "cancelled")


class ClientError(RuntimeError):
    pass


class ControlClient:
    """Thin HTTP client; errors carry the API's message."""

    def __init__(self, address: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.address = address.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import requests

        try:
            resp = requests.request(
                method, self.address + path, json=body, headers=self.headers, timeout=self.timeout_s
            )
        except requests.RequestException as exc:
            raise ClientError(
                f"cannot reach the control plane at {self.address} ({type(exc).__name__}); "
                f"is a run with control.enabled: true running? (--address / ${ADDRESS_ENV})"
            ) from None
        if not resp.ok:
            try:
                detail = resp.json().get("detail", resp.text)
            except ValueError:
                detail = resp.text
            raise ClientError(f"HTTP {resp.status_code}: {detail}")
        return resp.json()

    def wait(self, op_id: str, timeout_s: float, poll_s: float = 0.5) -> dict[str, Any]:
        """Poll an operation until it reaches a terminal state (bounded by ``timeout_s``)."""
        deadline = time.monotonic() + timeout_s
        while True:
            op = self.request("GET", f"/operations/{op_id}")
            if op["state"] in TERMINAL:
                return op
            if time.monotonic() > deadline:
                raise ClientError(f"operation {op_id} still {op['state']} after {timeout_s:g}s")
            time.sleep(poll_s)


# --------------------------------------------------------------------------- rendering


def table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """Plain aligned text table (no dependency)."""
    cells = [[("-" if r.get(c) is None else str(r.get(c))) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


ENGINE_COLUMNS = ["engine_id", "healthy", "weight_version", "load", "draining", "protected", "node"]


def format_status(s: dict[str, Any]) -> str:
    queue = s.get("queue") or {}
    idle = s.get("trainer_idle_frac")
    lines = [
        f"run {s.get('name')}: {s.get('state')} ({s.get('mode')}), step {s.get('step')}/{s.get('total_steps')}, "
        f"weight version {s.get('weight_version')}",
        f"queue: {queue.get('rows')} rows of {queue.get('capacity')}; trainer idle "
        f"{'-' if idle is None else f'{idle:.0%}'}",
    ]
    if (fleet := s.get("fleet") or {}).get(
        "line"
    ):  # engines missing: how many, what they wait for, since when
        lines.append(f"engines: {fleet['line']}")
    if op := s.get("operation"):
        lines.append(f"operation {op['id']}: {op['kind']} {op['state']}")
    return "\n".join([*lines, "", table(s.get("engines", []), ENGINE_COLUMNS)])


def format_operation(op: dict[str, Any]) -> str:
    extra = f" engines {op['engine_ids']}" if op.get("engine_ids") else ""
    extra += f" error: {op['error']}" if op.get("error") else ""
    extra += f" result: {json.dumps(op['result'])}" if op.get("result") else ""
    return f"{op['id']} {op['kind']}: {op['state']}{extra}"


# --------------------------------------------------------------------------- commands


def _client(ns: argparse.Namespace) -> ControlClient:
    return ControlClient(
        ns.address or os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS, ns.token or os.environ.get(TOKEN_ENV)
    )


def _operation(
    submit: Callable[[argparse.Namespace], tuple[str, dict | None]],
) -> Callable[[argparse.Namespace], int]:
    """A command that POSTs an operation and, with ``--wait``, follows it to its end."""

    def handler(ns: argparse.Namespace) -> int:
        path, body = submit(ns)
        return _run(
            ns,
            lambda c: _submit_and_wait(c, ns, path, body),
            format_operation,
            ok=lambda op: op["state"] not in ("failed", "cancelled"),
        )

    return handler


def _submit_and_wait(client: ControlClient, ns: argparse.Namespace, path: str, body: dict | None) -> dict:
    op = client.request("POST", path, body)
    return client.wait(op["id"], ns.wait_timeout) if ns.wait else op


def _run(
    ns: argparse.Namespace,
    call: Callable[[ControlClient], Any],
    render: Callable[[Any], str],
    ok: Callable[[Any], bool] = lambda _: True,
) -> int:
    try:
        result = call(_client(ns))
    except ClientError as exc:
        print(f"relax: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2) if ns.json else render(result))
    return 0 if ok(result) else 1


def _scale_out(ns: argparse.Namespace) -> tuple[str, dict]:
    if (ns.n is None) == (not ns.url):
        raise SystemExit("relax scale-out: give a number of engines N or --url U (not both)")
    return "/engines/scale_out", {"urls": ns.url} if ns.url else {"num_engines": ns.n}


def _scale_in(ns: argparse.Namespace) -> tuple[str, dict]:
    if (ns.n is None) == (not ns.id):
        raise SystemExit("relax scale-in: give a number of engines N or --id E (not both)")
    body: dict[str, Any] = {"engine_ids": ns.id} if ns.id else {"num_engines": ns.n}
    if ns.drain_timeout is not None:
        body["drain_timeout_s"] = ns.drain_timeout
    return "/engines/scale_in", body


def _common(parser: argparse.ArgumentParser, wait: bool = False) -> None:
    parser.add_argument(
        "--address", help=f"control API address (default ${ADDRESS_ENV} or {DEFAULT_ADDRESS})"
    )
    parser.add_argument("--token", help=f"bearer token (default ${TOKEN_ENV})")
    parser.add_argument("--json", action="store_true", help="print the API's JSON answer")
    if wait:
        parser.add_argument("--wait", action="store_true", help="wait until the operation ends")
        parser.add_argument("--wait-timeout", type=float, default=600.0, help="seconds --wait waits at most")


def _with(
    *extra: Callable[[argparse.ArgumentParser], Any], wait: bool = False
) -> Callable[[argparse.ArgumentParser], None]:
    def arguments(parser: argparse.ArgumentParser) -> None:
        for add in extra:
            add(parser)
        _common(parser, wait)

    return arguments


def register_commands(register: Callable[..., None]) -> None:
    register(
        "status",
        lambda ns: _run(ns, lambda c: c.request("GET", "/status"), format_status),
        help="status of a running run (control plane)",
        arguments=_with(),
    )
    register(
        "engines",
        lambda ns: _run(
            ns, lambda c: c.request("GET", "/engines"), lambda r: table(r["engines"], ENGINE_COLUMNS)
        ),
        help="rollout engines of a running run",
        arguments=_with(),
    )
    register(
        "scale-out",
        _operation(_scale_out),
        help="add rollout engines to a running run",
        arguments=_with(
            lambda p: p.add_argument(
                "n", nargs="?", type=int, help="number of engines Relax places on the cluster"
            ),
            lambda p: p.add_argument(
                "--url", action="append", help="attach a running external engine (repeatable)"
            ),
            wait=True,
        ),
    )
    register(
        "scale-in",
        _operation(_scale_in),
        help="drain and remove rollout engines",
        arguments=_with(
            lambda p: p.add_argument(
                "n", nargs="?", type=int, help="number of engines (least loaded, unprotected)"
            ),
            lambda p: p.add_argument(
                "--id", action="append", type=int, help="engine id to remove (repeatable)"
            ),
            lambda p: p.add_argument("--drain-timeout", type=float, help="seconds to drain before forcing"),
            wait=True,
        ),
    )
    for name, help_ in [
        ("pause", "pause a running run after its current step"),
        ("resume", "resume a paused run"),
        ("checkpoint", "save a checkpoint after the current step"),
    ]:
        register(
            name, _operation(lambda ns, name=name: (f"/{name}", None)), help=help_, arguments=_with(wait=True)
        )
