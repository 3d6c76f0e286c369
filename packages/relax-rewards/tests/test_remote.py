"""``remote`` against a real HTTP server on 127.0.0.1 started by the test: batches, field mapping,
auth from the environment, retries on 500, slow replies, malformed JSON."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.core.rewards.runner import reward_metrics
from relax.rewards.hub import Hub, HubParams
from relax.rewards.remote import RemoteParams, RemoteReward, RemoteRewardError
from relax.rewards.testing import make_sample


class _Handler(BaseHTTPRequestHandler):
    """``/ok``: score = len(response) / 10; ``/flaky``: 500 twice, then ok; ``/slow``: sleeps 2 s;
    ``/garbage``: not JSON; ``/short``: one score too few; ``/bad``: 400."""

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):  # noqa: N802  # http.server's naming
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        server = self.server
        server.requests.append((self.path, dict(self.headers), body))
        items = body.get("samples", [])
        scores = [len(it.get("response", "")) / 10 for it in items]
        if self.path == "/flaky" and sum(p == "/flaky" for p, _, _ in server.requests) <= 2:
            return self._reply(500, b"busy")
        if self.path == "/slow":
            time.sleep(2)
        if self.path == "/garbage":
            return self._reply(200, b"{not json")
        if self.path == "/short":
            scores = scores[:-1]
        if self.path == "/bad":
            return self._reply(400, b"bad request")
        if self.path == "/dict":
            scores = [{"score": s, "len": s * 10} for s in scores]
        self._reply(200, json.dumps({"scores": scores}).encode())

    def _reply(self, code, payload):
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.handle_error = lambda request, address: None  # /slow writes after the client gave up
    httpd.requests = []
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def _url(server, path):
    return f"http://127.0.0.1:{server.server_address[1]}{path}"


def _samples(n=3):
    return [
        make_sample("x" * (i + 1), f"gold{i}", {"source": f"s{i}"}, group=0, index=i, prompt=f"q{i}")
        for i in range(n)
    ]


def test_one_post_per_group_with_mapping_and_auth(server, monkeypatch):
    monkeypatch.setenv("RM_TOKEN", "s3cret")
    params = RemoteParams(
        url=_url(server, "/ok"),
        auth_env="RM_TOKEN",
        fields={"prompt": "prompt_text", "response": "response_text", "src": "metadata.source"},
    )
    reward = RemoteReward(params)
    server.requests.clear()
    assert asyncio.run(reward.score_group(_samples())) == [0.1, 0.2, 0.3]
    [(path, headers, body)] = server.requests
    assert headers["Authorization"] == "Bearer s3cret"
    assert body == {
        "samples": [{"prompt": f"q{i}", "response": "x" * (i + 1), "src": f"s{i}"} for i in range(3)]
    }
    monkeypatch.delenv("RM_TOKEN")
    with pytest.raises(RemoteRewardError, match="'RM_TOKEN' .* is not set"):
        reward.post(_samples(1))


def test_retries_500_with_backoff(server):
    server.requests.clear()
    reward = RemoteReward(RemoteParams(url=_url(server, "/flaky"), retries=3, backoff_s=0.05))
    assert reward.post(_samples(2)) == [0.1, 0.2]
    assert len(server.requests) == 3  # two 500s, then the answer


def test_slow_malformed_short_and_4xx_fail_with_the_url(server):
    slow = RemoteReward(RemoteParams(url=_url(server, "/slow"), timeout_s=0.3, retries=1, backoff_s=0.0))
    started = time.monotonic()
    with pytest.raises(RemoteRewardError, match="gave up after 2 attempts .*ReadTimeout"):
        slow.post(_samples(1))
    assert time.monotonic() - started < 5
    with pytest.raises(RemoteRewardError, match="/garbage: reply is not JSON"):
        RemoteReward(RemoteParams(url=_url(server, "/garbage"))).post(_samples(1))
    with pytest.raises(RemoteRewardError, match=r"expected \{'scores': \[2 scores\]\}"):
        RemoteReward(RemoteParams(url=_url(server, "/short"))).post(_samples(2))
    server.requests.clear()
    with pytest.raises(RemoteRewardError, match="HTTP 400"):
        RemoteReward(RemoteParams(url=_url(server, "/bad"), retries=3)).post(_samples(1))
    assert len(server.requests) == 1  # a client error is not retried
    with pytest.raises(RemoteRewardError, match="gave up .*ConnectionError"):
        RemoteReward(RemoteParams(url="http://127.0.0.1:9/none", retries=0)).post(_samples(1))


def test_validation():
    errors = RemoteParams(url="ftp://x", timeout_s=0, fields={"a": "secret"}).validate()
    assert any(e.startswith("url:") for e in errors) and any(e.startswith("timeout_s:") for e in errors)
    assert any("fields.a: 'secret'" in e for e in errors)


def test_in_the_hub_failures_are_counted_and_dict_scores_kept(server):
    hub = Hub(
        HubParams(
            routes={
                "ok": {"name": "remote", "params": {"url": _url(server, "/dict")}},
                "broken": {"name": "remote", "params": {"url": _url(server, "/garbage")}},
            },
            route_key="rm",
        )
    )
    samples = _samples(2) + [make_sample("yy", None, {"rm": "broken"}, group=0, index=2)]
    for s in samples[:2]:
        s.metadata["rm"] = "ok"
    assert hub.pool is None  # remote runs inline: no worker processes
    out = asyncio.run(hub.score_group(samples))
    assert [o["score"] for o in out] == [0.1, 0.2, 0.0] and out[1]["len"] == 2.0
    for s, o in zip(samples, out, strict=True):
        s.reward_info = o
    assert reward_metrics(samples)["reward/failures"] == 1.0
    hub.close()
