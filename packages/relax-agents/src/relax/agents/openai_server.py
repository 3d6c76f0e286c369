"""A local OpenAI-compatible endpoint whose "model" is the policy turn Relax already sampled.

Each episode gets a session (its own base URL, ``/s/<session>/v1``). A request to
``POST .../chat/completions`` is a rendezvous, not a generation: it waits until the episode hands
the session the turn core sampled (exact token ids and logprobs) and returns that turn as the
completion. Waiting is always bounded: a request unanswered after ``call_timeout_s`` gets HTTP
504, and a request to an ended session gets HTTP 410 at once, so neither side can hang.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: what a session's event queue carries: ("call", Call) | ("return", value) | ("raise", exc) | ("closed", reason)
Event = tuple[str, Any]


@dataclass
class Reply:
    status: int
    body: dict[str, Any]


@dataclass
class Call:
    """One ``chat.completions.create`` request, waiting for its reply."""

    body: dict[str, Any]
    reply: queue.Queue = field(default_factory=lambda: queue.Queue(maxsize=1))

    def answer(self, status: int, body: dict[str, Any]) -> None:
        """The first answer wins (the episode and ``close`` may race); later ones are dropped."""
        try:
            self.reply.put_nowait(Reply(status, body))
        except queue.Full:
            pass

    def fail(self, status: int, message: str) -> None:
        self.answer(status, error_body(message, status))


@dataclass
class CallRecord:
    """What one call returned, exactly as core sampled it (for tests and debugging)."""

    prompt_ids: list[int]  # the tokens the turn was sampled from: prompt + trajectory so far
    token_ids: list[int]  # the sampled turn, end-of-turn token included
    logprobs: list[float] | None  # one per sampled token (None: the turn's record had none)
    finish_reason: str
    content: str
    tool_calls: list[dict[str, Any]]
    observations: list[dict[str, Any]] = field(default_factory=list)  # what the agent sent back after it


class Session:
    """One episode's endpoint: the queue of what the agent does, and the record of every call."""

    def __init__(self, server: SessionServer, session_id: str, sample: Any = None) -> None:
        self.server, self.id, self.sample = server, session_id, sample  # the sample is read, never written
        self.events: queue.Queue[Event] = queue.Queue()
        self.records: list[CallRecord] = []
        self.messages: list[dict[str, Any]] = []  # the conversation so far, as the agent sent it
        self.pending: Call | None = None  # the call the episode took and has not answered yet
        self.closed = False
        self._lock = threading.Lock()

    @property
    def base_url(self) -> str:
        return f"{self.server.url}/s/{self.id}/v1"

    def submit(self, call: Call) -> None:
        with self._lock:
            if self.closed:
                call.fail(410, f"openai_agent session {self.id} has ended")
            else:
                self.events.put(("call", call))

    def hold(self, call: Call) -> None:
        """The episode took ``call`` and answers it with the next turn (a closed session refuses it now)."""
        with self._lock:
            if not self.closed:
                self.pending = call
                return
        call.fail(410, f"openai_agent session {self.id} has ended")

    def next_event(self, timeout_s: float) -> Event:
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"openai_agent session {self.id}: the agent neither called the endpoint nor returned within {timeout_s:g}s"
            ) from None

    def close(self, reason: str) -> None:
        """Answer every call still waiting (HTTP 410) and forget the session; idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            waiting = [self.pending] if self.pending is not None else []
            while True:
                try:
                    kind, item = self.events.get_nowait()
                except queue.Empty:
                    break
                if kind == "call":
                    waiting.append(item)
            self.events.put(("closed", reason))  # wakes an episode waiting for the agent
        self.server.forget(self.id)
        for call in waiting:
            call.fail(410, f"openai_agent session {self.id} ended: {reason}")


class SessionServer:
    """``ThreadingHTTPServer`` on 127.0.0.1 (a free port), serving every session of one environment."""

    def __init__(self, model: str = "relax", call_timeout_s: float = 600.0) -> None:
        self.model, self.call_timeout_s = model, call_timeout_s
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        # a short poll interval: ``shutdown`` waits for the loop to notice, and environments close often in tests
        self._thread = threading.Thread(
            target=self._http.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="openai-agent-server",
            daemon=True,
        )
        self._thread.start()

    def open(self, sample: Any = None) -> Session:
        session = Session(self, uuid.uuid4().hex[:12], sample)
        with self._lock:
            self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def forget(self, session_id: str) -> None:
        with self._lock:
            self._sessions.pop(session_id, None)

    def close(self) -> None:
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.close("the environment closed")
        self._http.shutdown()
        self._http.server_close()

    # ------------------------------------------------------------------ requests
    def handle_completion(self, session_id: str, body: dict[str, Any]) -> Reply:
        session = self.get(session_id)
        if session is None:
            return Reply(
                410, error_body(f"openai_agent session {session_id} does not exist or has ended", 410)
            )
        if body.get("stream"):
            return Reply(
                400,
                error_body("openai_agent: stream=true is not supported (the turn is already sampled)", 400),
            )
        if int(body.get("n") or 1) != 1:
            return Reply(400, error_body("openai_agent: n must be 1 (a session is one trajectory)", 400))
        if not isinstance(body.get("messages"), list) or not body["messages"]:
            return Reply(400, error_body("openai_agent: messages must be a non-empty list", 400))
        call = Call(body)
        session.submit(call)
        try:
            return call.reply.get(timeout=self.call_timeout_s)
        except queue.Empty:
            call.answer(504, {})  # whatever the episode answers later is dropped
            return Reply(
                504,
                error_body(
                    f"openai_agent session {session_id}: no policy turn within call_timeout_s={self.call_timeout_s:g}s",
                    504,
                ),
            )

    def models(self) -> Reply:
        return Reply(
            200,
            {
                "object": "list",
                "data": [{"id": self.model, "object": "model", "created": 0, "owned_by": "relax"}],
            },
        )


def error_body(message: str, status: int) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def completion_body(
    session: Session, index: int, request: dict[str, Any], record: CallRecord, token_texts: list[str]
) -> dict[str, Any]:
    """The OpenAI ``chat.completion`` for one recorded turn (logprobs and token ids when asked for)."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": record.content or (None if record.tool_calls else ""),
    }
    if record.tool_calls:
        message["tool_calls"] = record.tool_calls
    finish = "tool_calls" if record.tool_calls else ("length" if record.finish_reason == "length" else "stop")
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if request.get("logprobs") and record.logprobs is not None:
        choice["logprobs"] = {
            "content": [
                {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
                for text, lp in zip(token_texts, record.logprobs, strict=True)
            ]
        }
    body: dict[str, Any] = {
        "id": f"chatcmpl-{session.id}-{index}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model") or session.server.model,
        "choices": [choice],
        "usage": {
            "prompt_tokens": len(record.prompt_ids),
            "completion_tokens": len(record.token_ids),
            "total_tokens": len(record.prompt_ids) + len(record.token_ids),
        },
    }
    if request.get("return_token_ids"):  # vLLM's extension: the exact tokens, for token-aware clients
        choice["token_ids"] = list(record.token_ids)
        body["prompt_token_ids"] = list(record.prompt_ids)
    return body


def _handler(server: SessionServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _send(self, reply: Reply) -> None:
            data = json.dumps(reply.body).encode()
            self.send_response(reply.status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[str | None, str]:
            """(session id or None, the path after ``/v1``)."""
            path = self.path.split("?", 1)[0].rstrip("/")
            parts = path.split("/")
            if len(parts) >= 4 and parts[1] == "s" and parts[3] == "v1":
                return parts[2], "/".join(parts[4:])
            if len(parts) >= 2 and parts[1] == "v1":
                return None, "/".join(parts[2:])
            return None, "?"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            _, rest = self._route()
            self._send(
                server.models()
                if rest == "models"
                else Reply(404, error_body(f"no route GET {self.path}", 404))
            )

        def do_POST(self) -> None:  # noqa: N802
            session_id, rest = self._route()
            if session_id is None or rest != "chat/completions":
                self._send(
                    Reply(
                        404,
                        error_body(
                            f"no route POST {self.path} (sessions serve /s/<id>/v1/chat/completions)", 404
                        ),
                    )
                )
                return
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            except (ValueError, UnicodeDecodeError) as exc:
                self._send(Reply(400, error_body(f"openai_agent: the request body is not JSON ({exc})", 400)))
                return
            if not isinstance(body, dict):
                self._send(
                    Reply(400, error_body("openai_agent: the request body must be a JSON object", 400))
                )
                return
            self._send(server.handle_completion(session_id, body))

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one line per call is noise
            pass

    return Handler
