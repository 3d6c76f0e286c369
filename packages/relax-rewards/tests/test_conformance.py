"""Every reward of relax-rewards, built through its registration, passes core's conformance kit."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from relax.core.plugins import get_plugin_manager
from relax.core.testing import RewardConformance
from relax.rewards.testing import make_sample


def build(name: str, **params):
    reg = get_plugin_manager().registration("reward", name)
    return reg.factory(reg.config(**params), None)


_BUILT: dict[str, object] = {}


@pytest.fixture(scope="module", autouse=True)
def _close_rewards():
    yield
    for reward in _BUILT.values():
        getattr(reward, "close", lambda: None)()


class _Shared(RewardConformance):
    """One reward per class: the pooled ones start worker processes, once."""

    name = ""
    params: dict = {}

    def make_reward(self):
        if type(self).__name__ not in _BUILT:
            _BUILT[type(self).__name__] = build(self.name, **self.params)
        return _BUILT[type(self).__name__]


class TestMath(_Shared):
    name = "math"

    def expected_scores(self):
        return [1.0, 0.0, 1.0, 0.0]


class TestDapo(_Shared):
    name = "dapo"

    def samples(self):
        return [
            make_sample(r, lab, index=i)
            for i, (r, lab) in enumerate([("Answer: 7", "7"), ("Answer: 8", "7"), ("", "5")])
        ]

    def expected_scores(self):
        return [1.0, -1.0, -1.0]


class TestMultipleChoice(_Shared):
    name = "multiple_choice"

    def samples(self):
        return [
            make_sample(r, lab, index=i)
            for i, (r, lab) in enumerate([("\\boxed{B}", "B"), ("Answer: C", "B"), ("", "A")])
        ]

    def expected_scores(self):
        return [1.0, 0.0, 0.0]


class TestGpqa(TestMultipleChoice):
    name = "gpqa"


class TestF1(_Shared):
    name = "f1"

    def expected_scores(self):
        return [1.0, 0.0, 1.0, 0.0]  # "The answer is 12": the phrase's answer is "12"


class TestExactMatchSquad(TestF1):
    name = "exact_match_squad"


class TestIFEval(_Shared):
    name = "ifeval"

    def samples(self):
        meta = {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}]}
        return [make_sample(r, None, meta, index=i) for i, r in enumerate(["no commas", "a, b", ""])]

    def expected_scores(self):
        return [1.0, 0.0, 0.0]


class TestOpenR1(_Shared):
    name = "openr1_mm"

    def samples(self):
        return [
            make_sample(r, "7", index=i)
            for i, r in enumerate(
                [
                    "<think>t</think><answer>7</answer>",
                    "<answer>7</answer>",
                    "<think>t</think><answer>8</answer>",
                ]
            )
        ]

    def expected_scores(self):
        return [2.0, 1.0, 1.0]


class _Echo(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        payload = json.dumps(
            {"scores": [float(s["response"] == s["label"]) for s in body["samples"]]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@pytest.fixture(scope="module")
def echo_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/score"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.usefixtures("remote_url")
class TestRemote(_Shared):
    name = "remote"

    @pytest.fixture
    def remote_url(self, echo_server):
        type(self).params = {"url": echo_server}

    def expected_scores(self):
        return [1.0, 0.0, 0.0, 0.0]
