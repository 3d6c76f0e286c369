"""The control API's HTTP contract on a real Ray Serve instance: every endpoint, bad payloads ->
exact 4xx messages, the bearer token, the OpenAPI schema. The test plays the driver's side of the
hub (publishes a snapshot, takes commands, reports phases) as the run's agent does."""

from __future__ import annotations

import socket

import pytest
import requests

pytest.importorskip("ray.serve")

TOKEN = "t0ken-for-the-contract-test"
ENGINES = [
    {"engine_id": 0, "healthy": True, "weight_version": 2, "load": 1, "draining": False, "protected": True},
    {"engine_id": 3, "healthy": True, "weight_version": 2, "load": 4, "draining": False, "protected": False},
]
SNAPSHOT = {
    "name": "contract",
    "state": "running",
    "mode": "async",
    "engine": "hf",
    "attach": False,
    "step": 2,
    "total_steps": 10,
    "weight_version": 2,
    "engines": ENGINES,
    "trainer_idle_frac": 0.4,
    "queue": {"rows": 16.0, "capacity": 64.0, "depth": {"sample": 16.0}},
    "metrics": {"reward/mean": 0.5, "queue/rows": 16.0},
}


@pytest.fixture(scope="module")
def api(ray_session):
    """(base URL, hub): the control app with a token, on a shared Serve instance."""
    import ray
    from ray import serve

    from relax.core.control.server import deploy, serve_address, start_hub

    if serve_address() is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    hub = start_hub("relax-control-hub-contract")
    _, base = deploy(
        "relax-control-hub-contract", TOKEN, "127.0.0.1", 0, app_name="contract", route_prefix="/contract"
    )
    ray.get(hub.exchange.remote(SNAPSHOT))
    yield base, hub
    serve.delete("contract")
    ray.kill(hub)


def call(api, method, path, body=None, token=TOKEN):
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return requests.request(method, api[0] + path, json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("path", "body", "status", "detail"),
    [
        (
            "/engines/scale_out",
            {"num_engines": -1},
            422,
            "num_engines: Input should be greater than or equal to 1",
        ),
        ("/engines/scale_out", {"num_engines": 1, "rm": "-rf"}, 422, "rm: unknown field"),
        ("/engines/scale_out", {}, 422, "body: give exactly one of num_engines or urls"),
        (
            "/engines/scale_out",
            {"num_engines": 1, "urls": ["http://a:1"]},
            422,
            "body: give exactly one of num_engines or urls",
        ),
        (
            "/engines/scale_out",
            {"urls": ["file:///etc/passwd"]},
            422,
            "urls: 'file:///etc/passwd' is not an http(s)://host[:port] URL",
        ),
        (
            "/engines/scale_out",
            {"urls": ["http://h:99999"]},
            422,
            "urls: 'http://h:99999' has a bad port (Port out of range 0-65535)",
        ),
        (
            "/engines/scale_out",
            {"urls": ["http://10.0.0.2:30000"]},
            400,
            "urls: rollout engine 'hf' cannot attach external engines; scale out with num_engines",
        ),
        (
            "/engines/scale_out",
            {"num_engines": "two"},
            422,
            "num_engines: Input should be a valid integer, unable to parse string as an integer",
        ),
        ("/engines/scale_in", {"engine_ids": [-1]}, 422, "engine_ids: engine ids are >= 0, got -1"),
        (
            "/engines/scale_in",
            {"engine_ids": [0]},
            409,
            "engine_ids: [0] are protected (present from the start; control.protect_initial_engines)",
        ),
        ("/engines/scale_in", {"engine_ids": [9]}, 404, "engine_ids: [9] not serving; serving: [0, 3]"),
        (
            "/engines/scale_in",
            {"num_engines": 1, "drain_timeout_s": -5},
            422,
            "drain_timeout_s: Input should be greater than or equal to 0",
        ),
    ],
)
def test_bad_payloads_get_exact_4xx_messages(api, path, body, status, detail):
    resp = call(api, "POST", path, body)
    assert (resp.status_code, resp.json()) == (status, {"detail": detail})


def test_token_required_and_openapi_served(api):
    for token in (None, "wrong-token-of-some-length"):
        resp = call(api, "GET", "/status", token=token)
        assert resp.status_code == 401 and resp.headers["www-authenticate"] == "Bearer"
        assert resp.json() == {
            "detail": "missing or wrong bearer token (send Authorization: Bearer <control token>)"
        }
    schema = requests.get(api[0] + "/openapi.json", timeout=30).json()
    assert {
        "/status",
        "/metrics",
        "/pause",
        "/resume",
        "/engines",
        "/engines/scale_out",
        "/engines/scale_in",
        "/operations/{op_id}",
        "/checkpoint",
    } <= set(schema["paths"])
    assert "ScaleOutRequest" in schema["components"]["schemas"]


def test_every_endpoint_against_the_hub(api):
    import ray

    _, hub = api
    status = call(api, "GET", "/status").json()
    assert (status["step"], status["weight_version"], status["trainer_idle_frac"]) == (2, 2, 0.4)
    assert status["queue"] == {"rows": 16.0, "capacity": 64.0, "depth": {"sample": 16.0}}
    assert [e["engine_id"] for e in call(api, "GET", "/engines").json()["engines"]] == [0, 3]
    metrics = call(api, "GET", "/metrics").json()
    assert metrics["metrics"]["reward/mean"] == 0.5 and metrics["metrics"]["control/engines"] == 2.0
    prom = call(api, "GET", "/metrics?format=prometheus")
    assert prom.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert 'relax_reward_mean{run="contract"} 0.5' in prom.text.splitlines()
    assert call(api, "GET", "/metrics?format=xml").json() == {
        "detail": "format: 'xml' is not allowed; allowed values: 'json', 'prometheus'"
    }
    # operations: queued for the driver, one scale operation at a time, phases as the driver reports them
    ops = [
        call(api, "POST", path, body)
        for path, body in [
            ("/pause", None),
            ("/resume", None),
            ("/checkpoint", None),
            ("/engines/scale_out", {"num_engines": 2}),
        ]
    ]
    assert [(r.status_code, r.json()["kind"], r.json()["state"]) for r in ops] == [
        (202, "pause", "pending"),
        (202, "resume", "pending"),
        (202, "checkpoint", "pending"),
        (202, "scale_out", "pending"),
    ]
    busy = call(api, "POST", "/engines/scale_in", {"num_engines": 1})
    assert (busy.status_code, busy.json()["detail"]) == (
        409,
        f"operation {ops[3].json()['id']} (scale_out) is still pending; one scale operation at a time",
    )
    commands = ray.get(hub.exchange.remote(SNAPSHOT))
    assert [(c["kind"], c["request"]) for c in commands] == [
        ("pause", {}),
        ("resume", {}),
        ("checkpoint", {}),
        ("scale_out", {"num_engines": 2}),
    ]
    scale_id = ops[3].json()["id"]
    ray.get(hub.update.remote(scale_id, "creating", engine_ids=[4, 5]))
    assert call(api, "GET", "/status").json()["operation"]["state"] == "creating"
    ray.get(hub.update.remote(scale_id, "active"))
    op = call(api, "GET", f"/operations/{scale_id}").json()
    assert (op["state"], op["engine_ids"], op["history"]) == (
        "active",
        [4, 5],
        ["pending", "taken", "creating", "active"],
    )
    scale_in = call(api, "POST", "/engines/scale_in", {"num_engines": 1}).json()
    assert scale_in["engine_ids"] == [3]
    assert call(api, "POST", f"/operations/{scale_in['id']}/cancel").json()["state"] == "cancelled"
    assert call(api, "GET", "/operations/op-999").status_code == 404
    assert len(call(api, "GET", "/operations").json()) == 5
