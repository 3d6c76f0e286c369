"""``SGLangEngine``: a Relax rollout engine backed by one SGLang server (launched or attached).

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
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import threading
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from relax.core.protocols import GenerationRequest, GenerationResult
from relax.sglang.client import SGLangClient, SGLangHTTPError
from relax.sglang.media import MediaRequest, check_prompt_tokens, load_image_spec, media_request
from relax.sglang.params import SGLangEngineParams
from relax.sglang.payload import cut_at_stop_ids, generate_payload, parse_output, parse_version, result
from relax.sglang.server import ServerError, ServerProcess

_GATE_POLL_S = 0.01


def serialize_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """SGLang's ``serialized_named_tensors`` entry: a ForkingPickler dump in base64. CPU tensors share their
    storage through files in /dev/shm (the ``file_system`` strategy -- the default fd passing crashes the
    server); CUDA tensors travel as CUDA IPC handles (the server copies from this process's GPU memory, so
    the caller keeps the tensors alive until the server has answered)."""
    import multiprocessing.reduction

    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_system")
    buf = io.BytesIO()
    multiprocessing.reduction.ForkingPickler(buf).dump(named)
    return base64.b64encode(buf.getvalue()).decode()


def staged(named: list[tuple[str, torch.Tensor]], device: str) -> list[tuple[str, torch.Tensor]]:
    """The bucket where the server reads it: on a CUDA server's GPU (CUDA IPC: no host round trip), else
    in host memory."""
    target = torch.device("cuda") if device.startswith("cuda") else torch.device("cpu")
    return [(n, t.detach().to(target).contiguous()) for n, t in named]


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


class SGLangEngine:
    """``RolloutEngine`` over one SGLang server (see the module docstring)."""

    def __init__(
        self,
        params: SGLangEngineParams,
        model_path: str,
        *,
        dtype: str = "float32",
        index: int = 0,
        run_dir: str = ".",
        tokenizer_path: str | None = None,
    ) -> None:
        from transformers import AutoTokenizer

        if params.python == "auto" and not params.urls:
            from relax.sglang.server_env import server_python

            params = dataclasses.replace(params, python=server_python(Path(run_dir) / "logs" / "sglang-server-env-build.log"))
        self.params, self.model_path, self.index = params, model_path, index
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path)
        self.server: ServerProcess | None = None
        if params.urls:
            url = params.urls[index % len(params.urls)]
        else:
            log = Path(run_dir) / "logs" / f"sglang-engine-{index}.log"
            self.server = ServerProcess(params, model_path, dtype, log, index)
            self.server.start()
            url = self.server.url
        self.url = url
        self.name = f"sglang engine[{index}] at {url}"
        self.client = SGLangClient(url, self.name, params.control_timeout_s, params.request_timeout_s, params.max_concurrency)
        self._version = parse_version(self.client.get("/model_info").get("weight_version"), 0)
        self._running = threading.Event()
        self._running.set()
        self._abort_epoch = 0
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._image_spec: Any = None  # read from the model directory at the first media request

    # ------------------------------------------------------------------ generation
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        media: list[MediaRequest | None] = [None] * len(requests)
        if any(r.media is not None for r in requests):
            if self._image_spec is None:
                self._image_spec = load_image_spec(self.model_path)
            media = _media_requests([r.media for r in requests], [list(r.prompt_ids) for r in requests], self._image_spec,
                                    self.params.video_fps, self.tokenizer.decode)  # fmt: skip
        epoch = self._abort_epoch
        with self._count_lock:
            self._in_flight += 1
        try:
            return list(await asyncio.gather(*(self._one(r, m, epoch) for r, m in zip(requests, media, strict=True))))
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
            out = await self.client.generate(generate_payload(req, rid, done, media))
            if media is not None:
                check_prompt_tokens(out["meta_info"], len(req.prompt_ids) + len(done), self.name)
            got, lps, vers, reason = parse_output(out, self._version)
            ids, logprobs, versions, reason = cut_at_stop_ids(req.params, ids + got, logprobs + lps, versions + vers, reason)
            # aborted by a pause (pause_mode "abort"), not by abort(): continue from the tokens so far
            if reason != "abort" or self._abort_epoch != epoch:
                break
        response = list(req.prefix_response_ids) + ids
        text = self.tokenizer.decode(response, skip_special_tokens=True)
        return result(req, ids, logprobs, versions, reason, text)

    # ------------------------------------------------------------------ control
    def weight_version(self) -> int:
        return self._version

    def pause(self) -> None:
        self._running.clear()
        self.client.post("/pause_generation", {"mode": self.params.pause_mode})

    def resume(self) -> None:
        self.client.post("/continue_generation", {})
        self._running.set()

    def abort(self) -> None:
        self._abort_epoch += 1
        self.client.post("/abort_request", {"abort_all": True})

    def release_memory(self) -> None:
        """``rollout.release_memory``: the server frees its weights and KV cache (``/release_memory_occupation``;
        on CUDA through ``memory_saver``; a CPU server goes through the same calls and frees nothing)."""
        if self.server is not None and self.params.device.startswith("cuda") and not self.params.memory_saver:
            raise ServerError(f"{self.name}: rollout.release_memory needs engine_params.memory_saver (the server "
                              "was launched without --enable-memory-saver)")
        self.client.post("/release_memory_occupation", {})

    def resume_memory(self) -> None:
        self.client.post("/resume_memory_occupation", {})

    def health(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "url": self.url,
            "weight_version": self._version,
            "paused": not self._running.is_set(),
            "in_flight": self._in_flight,
            "model_path": self.model_path,
        }
        if self.server is not None and not self.server.alive():
            return {**info, "ok": False, "error": f"{self.name} exited with code {self.server.exit_code()}"}
        try:
            self.client.get("/health", timeout_s=min(10.0, self.params.control_timeout_s))
        except SGLangHTTPError as exc:
            return {**info, "ok": False, "error": str(exc)}
        return {**info, "ok": True}

    def restart(self) -> None:
        """Start a launched server again (after it died); the engine then serves the weights at
        ``model_path`` as version 0 until the next weight sync."""
        if self.server is None:
            raise ServerError(f"{self.name}: attached by URL, so it cannot be restarted from here")
        self.server.stop()
        self.server.start()
        self._version = parse_version(self.client.get("/model_info").get("weight_version"), 0)

    def close(self) -> None:
        self.client.close()
        if self.server is not None:
            self.server.stop()

    # ------------------------------------------------------------------ weight updates
    def begin_weight_update(self, version: int) -> None:
        try:
            self.client.post("/begin_weight_update", {})
        except SGLangHTTPError as exc:  # an earlier update failed between begin and end: close it first
            if "already open" not in str(exc):
                raise
            self.client.post("/end_weight_update", {})
            self.client.post("/begin_weight_update", {})

    def end_weight_update(self, version: int) -> None:
        self.client.post("/end_weight_update", {})
        served = parse_version(self.client.get("/model_info").get("weight_version"), -1)
        if served != version:
            raise SGLangHTTPError(f"{self.name} serves weight version {served} after the update to {version}")
        self._version = version

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """One bucket through ``/update_weights_from_tensor`` (call between begin/end_weight_update)."""
        items = staged(list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors),
                       self.params.device)  # kept alive until the server has answered (CUDA IPC)
        body = {"serialized_named_tensors": [serialize_tensors(items)] * self.params.tp_size,
                "weight_version": str(version), "flush_cache": self._may_flush()}  # fmt: skip
        self.client.post("/update_weights_from_tensor", body)
        self._version = version

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a whole HF checkpoint directory written by the trainer (``sglang_disk``)."""
        body = {"model_path": path, "weight_version": str(version), "flush_cache": self._may_flush()}
        self.client.post("/update_weights_from_disk", body)
        self._version = version

    def init_weights_update_group(self, addr: str, port: int, rank_offset: int, world: int, group: str, backend: str) -> None:
        body = {"master_address": addr, "master_port": port, "rank_offset": rank_offset, "world_size": world,
                "group_name": group, "backend": backend}  # fmt: skip
        self.client.post("/init_weights_update_group", body)

    def update_weights_from_distributed(self, layout: list[tuple[str, str, list[int]]], group: str, version: int) -> None:
        """Receive one bucket broadcast by the trainer (rank 0) over ``group``: (name, dtype, shape) each."""
        body = {"names": [n for n, _, _ in layout], "dtypes": [d for _, d, _ in layout],
                "shapes": [list(s) for _, _, s in layout], "group_name": group, "weight_version": str(version),
                "flush_cache": self._may_flush()}  # fmt: skip
        self.client.post("/update_weights_from_distributed", body)
        self._version = version

    def _may_flush(self) -> bool:
        """Requests paused ``in_place`` keep their (old-weights) KV cache by definition, and SGLang refuses
        to flush while they exist: flush the prefix cache on every update except then."""
        return self._running.is_set() or self.params.pause_mode != "in_place"

    def destroy_weights_update_group(self, group: str) -> None:
        self.client.post("/destroy_weights_update_group", {"group_name": group})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.client.post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def flush_cache(self) -> None:
        self.client.post("/flush_cache", {})

