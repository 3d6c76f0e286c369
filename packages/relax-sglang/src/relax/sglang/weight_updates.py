"""``SGLangEngine``'s weight updates: SGLang's update endpoints, each tagged with the new ``weight_version``
and called between ``begin_weight_update`` and ``end_weight_update`` (the ``sglang_*`` transports call
them; with ``trainer.lora`` they collect and load adapters instead, :mod:`relax.sglang.lora`).

Tensors reach a server as SGLang's ``serialized_named_tensors``: staged where each server rank reads them
(its GPU through CUDA IPC, else host shared memory) and pickled once per rank.
"""

from __future__ import annotations

import base64
import io
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from relax.sglang import lora as adapters
from relax.sglang.client import SGLangClient, SGLangHTTPError
from relax.sglang.device_defaults import staging_devices
from relax.sglang.params import SGLangEngineParams
from relax.sglang.served_layout import check_served_names, safetensors_names


def serialize_tensors(named: list[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> str:
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


def staged(named: list[tuple[str, torch.Tensor]], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """The bucket where a server rank reads it (``device_defaults.staging_devices``): on its GPU (CUDA IPC: no
    host round trip), else in host memory."""
    return [(n, t.detach().to(device).contiguous()) for n, t in named]


def staged_payloads(
    named: list[tuple[str, torch.Tensor]], layout: list[list[torch.device]]
) -> tuple[list[list[str]], list[Any]]:
    """Per server, its ranks' ``serialized_named_tensors``, and the staged copies (one per device, kept alive until
    the servers have answered: CUDA IPC and shared memory are read in place). Each rank gets its own pickle: torch
    counts a shared storage's references per pickle (each receiver drops one), so one pickle read by two processes
    lets the second one free the storage under the sender (the next bucket on it then finds no shared memory)."""
    copies = {device: staged(named, device) for device in dict.fromkeys(d for ranks in layout for d in ranks)}
    return [[serialize_tensors(copies[d]) for d in ranks] for ranks in layout], list(copies.values())


class WeightUpdates:
    """The weight-update half of ``SGLangEngine``, on the engine's state below (set by its constructor)."""

    name: str
    params: SGLangEngineParams
    lora: Any
    servers: list[Any]
    workers: list[SGLangClient]
    served_architecture: str | None
    last_sync_bytes: int
    _adapter: str | None
    _pending: adapters.PendingAdapter
    _version: int
    _running: threading.Event
    _each: Callable[..., list[Any]]
    _served_version: Callable[..., int]

    def begin_weight_update(self, version: int) -> None:
        self._pending = adapters.PendingAdapter()  # whatever a failed earlier update left
        for worker in self.workers:
            try:
                worker.post("/begin_weight_update", {})
            except SGLangHTTPError as exc:  # an earlier update failed between begin and end: close it first
                if "already open" not in str(exc):
                    raise
                worker.post("/end_weight_update", {})
                worker.post("/begin_weight_update", {})

    def end_weight_update(self, version: int) -> None:
        self._each("/end_weight_update", {})
        if self.lora is not None and self._pending:
            self._load_adapter(version)
        served = self._served_version(-1)
        if served != version:
            raise SGLangHTTPError(f"{self.name} serves weight version {served} after the update to {version}")
        self._version = version

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """One bucket through ``/update_weights_from_tensor`` (call between begin/end_weight_update); with
        ``lora``, one bucket of the adapter, loaded by ``end_weight_update``."""
        if self.lora is not None:
            self._pending.add(
                list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors),
                self.name,
            )
            return
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        check_served_names((n for n, _ in items), self.served_architecture, self.name)
        layout = staging_devices(
            self.params.device, len(self.workers), self.params.tp_size, launched=bool(self.servers)
        )
        payloads, _alive = staged_payloads(
            items, layout
        )  # each server rank's copy on its own GPU, alive until answered
        bodies = [
            {
                "serialized_named_tensors": ranks,
                "weight_version": str(version),
                "flush_cache": self._may_flush(),
            }
            for ranks in payloads
        ]
        self._each("/update_weights_from_tensor", bodies=bodies)
        self._version = version

    def update_weights_from_disk(self, path: str, version: int) -> None:
        """Load a whole HF checkpoint directory written by the trainer (``sglang_disk``)."""
        self._refuse_full_weights("update_weights_from_disk")
        if self.served_architecture:  # e.g. the trainer's own HF directory of the thinker alone
            check_served_names(safetensors_names(path), self.served_architecture, self.name)
        body = {"model_path": path, "weight_version": str(version), "flush_cache": self._may_flush()}
        self._each("/update_weights_from_disk", body)
        self._version = version

    def weight_update_ranks(self) -> int:
        """Ranks this engine adds to a ``sglang_distributed`` group: each server's tensor-parallel ranks."""
        return int(self.params.tp_size) * len(self.workers)

    def init_weights_update_group(
        self, addr: str, port: int, rank_offset: int, world: int, group: str, backend: str
    ) -> None:
        """Every server joins ``group``, the engine's ranks from ``rank_offset`` on, each server's TP ranks in
        a row (the calls return once the whole group formed, so they go out together)."""
        from concurrent.futures import ThreadPoolExecutor

        def join(j: int) -> Any:
            body = {
                "master_address": addr,
                "master_port": port,
                "rank_offset": rank_offset + j * self.params.tp_size,
                "world_size": world,
                "group_name": group,
                "backend": backend,
            }
            return self.workers[j].post("/init_weights_update_group", body)

        with ThreadPoolExecutor(len(self.workers)) as pool:
            list(pool.map(join, range(len(self.workers))))

    def update_weights_from_distributed(
        self, layout: list[tuple[str, str, list[int]]], group: str, version: int
    ) -> None:
        """Receive one bucket broadcast by the trainer (rank 0) over ``group``: (name, dtype, shape) each."""
        self._refuse_full_weights("update_weights_from_distributed")
        check_served_names((n for n, _, _ in layout), self.served_architecture, self.name)
        body = {
            "names": [n for n, _, _ in layout],
            "dtypes": [d for _, d, _ in layout],
            "shapes": [list(s) for _, _, s in layout],
            "group_name": group,
            "weight_version": str(version),
            "flush_cache": self._may_flush(),
        }
        self._each("/update_weights_from_distributed", body)
        self._version = version

    def _load_adapter(self, version: int) -> None:
        """Load the collected adapter as ``version``'s, serve it from now on, unload the one it replaces."""
        tensors = self._pending.take()
        name, old = adapters.adapter_name(version), self._adapter
        if (
            old == name
        ):  # the same version again (a retried sync): SGLang refuses a second adapter of one name
            self._each("/unload_lora_adapter", {"lora_name": old})
            self._adapter = old = None
        bodies = [
            {
                "lora_name": name,
                "config_dict": adapters.adapter_config(self.lora),
                "serialized_named_tensors": [serialize_tensors(tensors) for _ in range(self.params.tp_size)],
            }
            for _ in self.workers
        ]  # one pickle per receiving rank (see staged_payloads)
        self._each("/load_lora_adapter_from_tensors", bodies=bodies)
        self._adapter, self.last_sync_bytes = name, adapters.nbytes(tensors)
        if old is not None:  # waits for requests still on it (still tagged with its version; after pause(),
            self._each("/unload_lora_adapter", {"lora_name": old})  # which aborts them, there are none)
        self._each("/update_weight_version", {"new_version": str(version), "abort_all_requests": False})

    def _refuse_full_weights(self, call: str) -> None:
        if self.lora is not None:
            raise SGLangHTTPError(
                f"{self.name}: {call} loads full weights, but this engine serves trainer.lora "
                "adapters (use the sglang_tensor or a core transport)"
            )

    def _may_flush(self) -> bool:
        """Requests paused ``in_place`` keep their (old-weights) KV cache by definition, and SGLang refuses
        to flush while they exist: flush the prefix cache on every update except then."""
        return self._running.is_set() or self.params.pause_mode != "in_place"

    def destroy_weights_update_group(self, group: str) -> None:
        self._each("/destroy_weights_update_group", {"group_name": group})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        return self.workers[0].post("/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def flush_cache(self) -> None:
        self._each("/flush_cache", {})
