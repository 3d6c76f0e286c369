"""Apprise delivers run notifications to a local HTTP endpoint started by the test (``json://``)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

pytest.importorskip("apprise")

from relax.core.control.notify import Notifier  # noqa: E402


@pytest.fixture
def endpoint():
    received: list[tuple[str, dict]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append((self.path, json.loads(body)))
            self.send_response(200 if "fail" not in self.path else 500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", received
    server.shutdown()


def test_apprise_delivers_each_event_to_a_local_endpoint(endpoint):
    host, received = endpoint
    notifier = Notifier([f"json://{host}/hook"], "quickstart")
    assert notifier.send("started", "async run of 10 steps")
    notifier.send_later("failed", "at step 3")
    notifier.flush()
    assert [(path, body["title"], body["message"], body["type"]) for path, body in received] == [
        ("/hook", "relax quickstart: started", "async run of 10 steps", "info"),
        ("/hook", "relax quickstart: failed", "at step 3", "failure"),
    ]


def test_undeliverable_notifications_return_false_and_bad_urls_are_named(endpoint):
    host, _ = endpoint
    assert Notifier([f"json://{host}/fail"], "q").send("completed", "done") is False
    with pytest.raises(ValueError, match=r"logging.notify_urls: Apprise cannot use \['nosuchschema://x'\]"):
        Notifier(["nosuchschema://x"], "q")
