"""Scale-out by URL through the fleet: an engine plugin declares which ``engine_params`` field attaches it
(``register(..., attach="urls")``); each attached engine starts with that field set to its own URL, serves
only after the weight sync, and a replacement re-attaches to the same URL. The engines are real Ray actors
that reach real HTTP servers started here (health fails if an engine is not attached where it should be)."""

from __future__ import annotations

import http.server
import os
import signal
import threading
import time
from dataclasses import dataclass, field

import pytest
import ray
import requests

from relax.core.controller.faults import FaultCounters
from relax.core.controller.fleet import EngineFleet, attach_param, with_engine_params
from relax.core.plugins import RelaxPluginManager, get_plugin_manager


@dataclass(frozen=True)
class UrlParams:
    urls: list[str] = field(default_factory=list)
    label: str = "x"


@ray.remote(num_cpus=0)
class UrlEngine:
    """A rollout engine serving from the one server in ``params.urls`` (what it answers comes from there)."""

    def __init__(self, params: UrlParams) -> None:
        (self.url,) = params.urls
        self.version = 0

    def pid(self) -> int:
        return os.getpid()

    def health(self) -> dict:
        body = requests.get(self.url, timeout=5).text
        return {"ok": True, "url": self.url, "served_by": body, "weight_version": self.version}

    def update_weights(self, named_tensors, version: int) -> None:
        self.version = version

    def weight_version(self) -> int:
        return self.version


class UrlEnginePlugin:
    @staticmethod
    def relax_register_rollout_engines(register):
        register("url", lambda params, ctx: None, config=UrlParams, attach="urls")


@dataclass(frozen=True)
class _Rollout:
    engine: str = "url"
    engine_params: UrlParams = UrlParams()
    max_restarts: int = 1
    restart_backoff_s: float = 0.05
    timeout_s: float = 30.0
    control_timeout_s: float = 5.0


@dataclass(frozen=True)
class _Config:
    rollout: _Rollout = _Rollout()


def _server(name: str) -> tuple[str, http.server.HTTPServer]:
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(name)))
            self.end_headers()
            self.wfile.write(name.encode())

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", server


def test_engine_params_override_and_the_declared_attach_field():
    cfg = _Config()
    attached = with_engine_params(cfg, {"urls": ["http://h:1"]})
    assert (
        attached.rollout.engine_params == UrlParams(urls=["http://h:1"])
        and cfg.rollout.engine_params.urls == []
    )
    assert with_engine_params(_Config(_Rollout(engine_params={"a": 1})), {"b": 2}).rollout.engine_params == {
        "a": 1,
        "b": 2,
    }
    manager = RelaxPluginManager(extra_plugins={"url-engine": UrlEnginePlugin()}, load_entry_points=False)
    assert attach_param("url", manager) == "urls"
    assert attach_param("hf", get_plugin_manager()) is None  # core's HF engine cannot attach


def test_attached_engines_serve_from_their_urls_and_a_replacement_reattaches(ray_session):
    (url_a, server_a), (url_b, server_b) = _server("A"), _server("B")
    cfg, started, synced = _Config(), [], []

    def start_engine(index, slot, engine_params=None):  # as runtime.engine_starter does
        params = (
            with_engine_params(cfg, engine_params).rollout.engine_params
            if engine_params
            else UrlParams([url_a])
        )
        handle = UrlEngine.remote(params)
        started.append((index, slot, engine_params, handle))
        return handle

    class VersionSync:  # a WeightSync moving no bytes: each engine is told the version
        def sync(self, trainer, engines, version):
            ray.get([h.update_weights.remote([], version) for h in engines])
            synced.append(list(engines))
            return {}

        def check_engine(self, engine):
            pass

        def close(self):
            pass

    first = UrlEngine.remote(UrlParams([url_a]))
    fleet = EngineFleet(cfg, [first], start_engine, VersionSync(), None, FaultCounters(), version=5)
    field_name = attach_param(
        "url", RelaxPluginManager(extra_plugins={"u": UrlEnginePlugin()}, load_entry_points=False)
    )
    try:
        assert fleet.attach_engines([url_b], field=field_name) == [1]
        ((index, slot, params, new),) = started
        assert (index, slot, params) == (1, None, {"urls": [url_b]}) and synced == [[new]]
        health = ray.get(new.health.remote())
        assert (health["served_by"], health["weight_version"]) == ("B", 5), health
        assert sorted(fleet.live()) == [0, 1] and not fleet.on_reservation(1)
        os.kill(ray.get(new.pid.remote()), signal.SIGKILL)
        fleet.control("weight_version")  # finds it dead: evicted, replaced
        deadline = time.monotonic() + 60
        while 2 not in fleet.live() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(fleet.live()) == [0, 2]
        index, _, params, replacement = started[-1]
        assert (index, params) == (2, {"urls": [url_b]}), "the replacement must re-attach to the same server"
        assert ray.get(replacement.health.remote())["served_by"] == "B"
        with pytest.raises(ValueError, match="rollout engine 'hf' cannot attach external engines"):
            EngineFleet(_Config(_Rollout(engine="hf")), [], start_engine, VersionSync(), None).attach_engines(
                [url_a]
            )
    finally:
        fleet.close()
        for handle in [first, *(h for *_, h in started)]:
            ray.kill(handle)
        server_a.shutdown()
        server_b.shutdown()
