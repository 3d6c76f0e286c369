"""``SGLangEngine``: a Relax rollout engine backed by one SGLang server (launched or attached), or by several
behind one sglang-router (``router: sglang``: generation through the router, every control call below to
each server; :mod:`relax.sglang.router`). At start-up each server must report an SGLang release with the
endpoints used here (:mod:`relax.sglang.server_site.relax_sglang_version_guard`).

Generation goes through SGLang's native token-id ``/generate`` (per-token logprobs, finish reason and
per-token weight-version spans). Control maps onto SGLang's endpoints:

- ``pause()``: new requests wait in the engine, and ``/pause_generation`` with ``pause_mode`` handles the
  ones in flight -- ``retract`` / ``in_place`` keep them on the server (they continue after ``resume()``,
  under whatever weights are loaded by then), ``abort`` ends them and the engine resubmits each as a
  continuation (prompt + tokens so far) after ``resume()``. In every mode the tokens of one response carry
  the version that produced each of them.
- ``abort()`` (``rollout.partial_rollout: abort``): ``/abort_request`` for everything; results come back
  with finish reason ``"abort"`` and the tokens so far (the controller resubmits them).
- Weight updates: ``update_weights`` (tensors, ``/update_weights_from_tensor``), ``update_weights_from_disk``,
  and the distributed group calls used by the ``sglang_*`` transports -- all between
  ``begin_weight_update`` and ``end_weight_update``, each tagged with the new ``weight_version``.
- With ``trainer.lora`` (``lora``): adapter-only syncs (:mod:`relax.sglang.lora`). ``update_weights`` collects
  the adapter, ``end_weight_update`` loads it as a new adapter and every later ``/generate`` names it; since
  SGLang cannot move a running request to another adapter, ``pause()`` aborts the requests in flight and
  resubmits them as continuations under the new adapter (``pause_mode`` ``abort``'s path, whatever it says).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid
from pathlib import Path
from typing import Any

from relax.core.protocols import GenerationRequest, GenerationResult
from relax.sglang import lora as adapters
from relax.sglang.client import SGLangClient, SGLangHTTPError
from relax.sglang.device_defaults import server_settings
from relax.sglang.media import MediaRequest, check_prompt_tokens, load_image_spec, media_request
from relax.sglang.params import SGLangEngineParams
from relax.sglang.payload import cut_at_stop_ids, generate_payload, parse_output, parse_version, result
from relax.sglang.routing import SERVER_FLAG, RoutingLayout
from relax.sglang.served_layout import served_architecture
from relax.sglang.server import ServerError, ServerProcess
from relax.sglang.server_site.relax_sglang_version_guard import endpoints_problem
from relax.sglang.weight_updates import WeightUpdates

_GATE_POLL_S = 0.01


def _media_requests(
    refs: list[Any], prompts: list[list[int]], spec: Any, video_fps: float = 2.0, decode: Any = None
) -> list[MediaRequest | None]:
    """Each request's media in SGLang's HTTP form, built once per distinct media object (a group's requests
    share one: its images and videos are rebuilt and encoded once, not once per sample)."""
    from relax.core.data_multimodal import resolve_all

    built: dict[int, MediaRequest] = {}
    out: list[MediaRequest | None] = []
    for inputs, prompt in zip(resolve_all(refs), prompts, strict=True):
        if inputs is not None and id(inputs) not in built:
            built[id(inputs)] = media_request(inputs, prompt, spec, video_fps, decode=decode)
        out.append(None if inputs is None else built[id(inputs)])
    return out


class SGLangEngine(WeightUpdates):
    """``RolloutEngine`` over one SGLang server (see the module docstring); its weight-update calls are
    :class:`relax.sglang.weight_updates.WeightUpdates`."""

    def __init__(
        self,
        params: SGLangEngineParams,
        model_path: str,
        *,
        dtype: str = "float32",
        index: int = 0,
        run_dir: str = ".",
        tokenizer_path: str | None = None,
        record_routing: bool = False,
        lora: Any = None,
    ) -> None:
        """``record_routing``: return each request's MoE routing (``relax.sglang.routing``; text requests).
        ``lora``: the run's ``trainer.lora`` (a ``LoraConfig``): launch for its adapters, sync adapters only."""
        from transformers import AutoTokenizer

        if params.python == "auto" and not params.urls:
            from relax.sglang.server_env import server_python

            params = dataclasses.replace(
                params, python=server_python(Path(run_dir) / "logs" / "sglang-server-env-build.log")
            )
        self._routing: RoutingLayout | None = None
        if record_routing:
            from relax.core.multimodal_model import model_config

            self._routing = RoutingLayout.from_config(model_config(model_path))
            if SERVER_FLAG not in params.extra_args:
                params = dataclasses.replace(params, extra_args=[*params.extra_args, SERVER_FLAG])
        if lora is not None and not params.urls and "--enable-lora" not in params.extra_args:
            params = dataclasses.replace(
                params, extra_args=[*adapters.server_args(lora, params.device), *params.extra_args]
            )
        self.lora = lora
        self._adapter: str | None = None  # the loaded adapter every /generate names (None: the base model)
        self._pending = adapters.PendingAdapter()
        self.last_sync_bytes = 0  # bytes of the last adapter loaded into the server(s)
        self.params, self.model_path, self.index = params, model_path, index
        self.served_architecture = served_architecture(
            model_path
        )  # one whose loader takes its own names (served_layout)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.servers: list[ServerProcess] = []  # launched ones (none when attached by URL)
        self.router: Any = None  # the sglang-router process in front of them (router: sglang)
        self.workers: list[SGLangClient] = []
        concurrency = server_settings(params, dtype).max_concurrency

        def client(url: str, name: str) -> SGLangClient:
            return SGLangClient(url, name, params.control_timeout_s, params.request_timeout_s, concurrency)

        try:
            urls = self._start_servers(dtype, Path(run_dir) / "logs")
            #: control calls go to every server; with one server (router: relax) it is the generation client
            self.workers = [client(u, f"sglang engine[{index}] server at {u}") for u in urls]
            for worker in self.workers:
                check_server_version(worker)
            url = self._start_router(urls, Path(run_dir) / "logs") if params.router == "sglang" else urls[0]
        except BaseException:
            self.close()
            raise
        self.url = url
        self.name = f"sglang engine[{index}] at {url}"
        if params.router == "sglang":
            self.client = client(url, self.name)
        else:
            self.client = self.workers[0]
            self.client.name = self.name
        self._version = self._served_version(0, agree=False)
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._image_spec: Any = None  # read from the model directory at the first media request

    @property
    def server(self) -> ServerProcess | None:
        """The (first) launched server; None when attached by URL."""
        return self.servers[0] if self.servers else None

    def _processes(self) -> list[ServerProcess]:
        """What this engine launched: its servers, then the router in front of them (if any)."""
        return [*self.servers, *([self.router] if self.router is not None else [])]

    def _start_servers(self, dtype: str, logs: Path) -> list[str]:
        """Launch this engine's servers (or pick the attached URLs): their URLs."""
        p = self.params
        if p.urls:
            return list(p.urls) if p.router == "sglang" else [p.urls[self.index % len(p.urls)]]
        n = p.servers if p.router == "sglang" else 1
        for j in range(n):
            i = self.index * n + j
            name = (
                f"sglang-engine-{self.index}.log" if n == 1 else f"sglang-engine-{self.index}-server-{j}.log"
            )
            server = ServerProcess(p, self.model_path, dtype, logs / name, i, base_gpu=j * p.tp_size)
            self.servers.append(server)
            server.start()
        return [s.url for s in self.servers]

    def _start_router(self, urls: list[str], logs: Path) -> str:
        from relax.sglang.router import RouterProcess, router_python

        python = router_python(self.params, self.params.python)  # the server env may have the router too
        self.router = RouterProcess(
            self.params, python, urls, logs / f"sglang-router-{self.index}.log", self.index
        )
        self.router.start()
        return self.router.url

    def _each(
        self, endpoint: str, body: dict[str, Any] | None = None, bodies: list[Any] | None = None
    ) -> list[Any]:
        """POST ``endpoint`` to every server at once (a distributed weight update blocks each call until all
        of them received the broadcast, so they cannot go one after another); ``bodies``: one per server."""
        bodies = bodies if bodies is not None else [body] * len(self.workers)
        if len(self.workers) == 1:
            return [self.workers[0].post(endpoint, bodies[0])]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(len(self.workers)) as pool:
            return list(
                pool.map(lambda wb: wb[0].post(endpoint, wb[1]), zip(self.workers, bodies, strict=True))
            )

    def _served_version(self, default: int, agree: bool = True) -> int:
        """The weight version the servers report: after an update they must agree; at start-up (``agree``
        False) servers attached at different versions count as the oldest until the first sync."""
        versions = {parse_version(w.get("/model_info").get("weight_version"), default) for w in self.workers}
        if agree and len(versions) != 1:
            raise SGLangHTTPError(
                f"{self.name}: its servers serve different weight versions {sorted(versions)}"
            )
        return min(versions)

    # ------------------------------------------------------------------ generation
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        media: list[MediaRequest | None] = [None] * len(requests)
        if any(r.media is not None for r in requests):
            if self._image_spec is None:
                self._image_spec = load_image_spec(self.model_path)
            media = _media_requests(
                [r.media for r in requests],
                [list(r.prompt_ids) for r in requests],
                self._image_spec,
                self.params.video_fps,
                self.tokenizer.decode,
            )
        epoch = self._abort_epoch
        with self._count_lock:
            self._in_flight += 1
        try:
            return list(
                await asyncio.gather(*(self._one(r, m, epoch) for r, m in zip(requests, media, strict=True)))
            )
        finally:
            with self._count_lock:
                self._in_flight -= 1

    async def _one(self, req: GenerationRequest, media: MediaRequest | None, epoch: int) -> GenerationResult:
        """One request to its end; ``media``: its HTTP media form (sent with every continuation)."""
        ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "abort"
        while True:
            while not self._running.is_set() and self._abort_epoch == epoch:
                await asyncio.sleep(_GATE_POLL_S)
            if self._abort_epoch != epoch:
                break
            done = list(req.prefix_response_ids) + ids
            if len(done) >= req.params.max_new_tokens:
                reason = "length"
                break
            rid = f"{req.request_id}-{uuid.uuid4().hex[:8]}"
            routed = self._routing is not None and media is None
            adapter = self._adapter
            payload = generate_payload(req, rid, done, media, routed_experts=routed, lora_path=adapter)
            try:
                out = await self.client.generate(payload)
            except SGLangHTTPError as exc:
                # a sync replaced (and unloaded) the adapter before the request reached the server, which then
                # cannot find it: the request has not started, so it goes again under the adapter now served
                if adapter is None or adapter == self._adapter or "LoRA adapter" not in str(exc):
                    raise
                continue
            if media is not None:
                check_prompt_tokens(out["meta_info"], len(req.prompt_ids) + len(done), self.name)
            got, lps, vers, reason = parse_output(out, self._version)
            if self._abort_epoch != epoch and reason != "abort":
                # sent before abort() but reached the server after it: the pause held it and it ran on the
                # weights loaded during the pause; abort() ends every request in flight when it is called
                got, lps, vers, reason = [], [], [], "abort"
            ids, logprobs, versions, reason = cut_at_stop_ids(
                req.params, ids + got, logprobs + lps, versions + vers, reason
            )
            # aborted by a pause (pause_mode "abort"), not by abort(): continue from the tokens so far
            if reason != "abort" or self._abort_epoch != epoch:
                break
        response = list(req.prefix_response_ids) + ids
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        res = result(req, ids, logprobs, versions, reason, text)
        if self._routing is not None and media is None and ids:  # the last call saw the whole sequence
            res.routed_experts = self._routing.decode(out["meta_info"], len(req.prompt_ids) + len(response))
        return res

    # ------------------------------------------------------------------ control
    def weight_version(self) -> int:
        return self._version

    def pause(self) -> None:
        self._running.clear()
        self._each(
            "/pause_generation", {"mode": "abort" if self.lora is not None else self.params.pause_mode}
        )

    def resume(self) -> None:
        self._each("/continue_generation", {})
        self._running.set()

    def abort(self) -> None:
        self._abort_epoch += 1
        self._each("/abort_request", {"abort_all": True})

    def release_memory(self) -> None:
        """``rollout.release_memory``: the server frees its weights and KV cache (``/release_memory_occupation``;
        on CUDA through ``memory_saver``; a CPU server goes through the same calls and frees nothing)."""
        if self.servers and self.params.device.startswith("cuda") and not self.params.memory_saver:
            raise ServerError(
                f"{self.name}: rollout.release_memory needs engine_params.memory_saver (the server "
                "was launched without --enable-memory-saver)"
            )
        self._each("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self._each("/resume_memory_occupation", {})

    def health(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "url": self.url,
            "weight_version": self._version,
            "paused": not self._running.is_set(),
            "in_flight": self._in_flight,
            "model_path": self.model_path,
        }
        for proc in self._processes():
            if not proc.alive():
                error = (
                    f"{self.name} exited with code {proc.exit_code()}"
                    if len(self.servers) == 1 and proc is self.server
                    else f"{proc.name} exited with code {proc.exit_code()}"
                )
                return {**info, "ok": False, "error": error}
        try:
            for client in dict.fromkeys([*self.workers, self.client]):
                client.get("/health", timeout_s=min(10.0, self.params.control_timeout_s))
        except SGLangHTTPError as exc:
            return {**info, "ok": False, "error": str(exc)}
        return {**info, "ok": True}

    def restart(self) -> None:
        """Start a launched server again (after it died); the engine then serves the weights at
        ``model_path`` as version 0 until the next weight sync."""
        if not self.servers:
            raise ServerError(f"{self.name}: attached by URL, so it cannot be restarted from here")
        for proc in reversed(self._processes()):
            proc.stop()
        for proc in self._processes():
            proc.start()
        self._adapter = None
        self._version = self._served_version(0, agree=False)

    def close(self) -> None:
        for client in dict.fromkeys([*self.workers, *([self.client] if hasattr(self, "client") else [])]):
            client.close()
        for proc in reversed(self._processes()):
            proc.stop()


def check_server_version(client: SGLangClient) -> None:
    """Refuse a server older than the endpoints the engine calls, at start-up (naming its version) rather
    than with a 404 in the middle of a run."""
    try:
        info = client.get("/server_info")
    except SGLangHTTPError:
        info = client.get("/get_server_info")  # releases before /server_info
    problem = endpoints_problem((info or {}).get("version"))
    if problem:
        raise ServerError(f"{client.name}: {problem}")
