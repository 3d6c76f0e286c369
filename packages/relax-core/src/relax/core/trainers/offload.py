"""``trainer.offload`` (colocate): a trainer's parameters and optimizer state to host memory and back.

When trainer and engines share a GPU, the engines need the memory the trainer holds between its updates.
verl and slime offload after the update and the weight sync and onload before the next training step;
so does Relax (``relax.core.controller.handoff`` calls :meth:`Offloadable.offload` / :meth:`Offloadable.onload`).

Every tensor moves to fresh storage (``copy=True``) and back, bit for bit, while the objects stay: the
optimizer keeps its parameters (``Module._apply`` replaces ``param.data``), and FSDP2 re-pads and re-registers
its sharded DTensor parameters' local shards in its own ``_apply``. Gradients are dropped, not moved: the
policy-update loop zeroes them before every mini-batch, so after the optimizer step they are dead, and a
parameter's ``.grad`` may not live on another device than the parameter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from relax.core.policy_update.memory import memory_now, release

#: what :meth:`Offloader.offload` can move; ``params`` includes the modules' buffers
PARTS = ("grads", "optimizer", "params")
HOST = torch.device("cpu")
_GB = float(1 << 30)


def _nbytes(t: torch.Tensor) -> int:
    local = getattr(t, "_local_tensor", t)  # a DTensor: this rank's shard
    return local.numel() * local.element_size()


class Offloader:
    """Moves ``modules`` (parameters, their gradients, buffers), ``params`` outside any of them (e.g. fp32 master
    copies the optimizer steps) and ``optimizers``' state between ``device`` and host memory; remembers what is
    on the host, so every call is idempotent."""

    def __init__(
        self,
        device: torch.device | str,
        modules: Sequence[torch.nn.Module | None],
        optimizers: Sequence[torch.optim.Optimizer | None],
        params: Sequence[torch.nn.Parameter] = (),
    ) -> None:
        self.device = torch.device(device)
        self.modules = [m for m in modules if m is not None]
        self.optimizers = [o for o in optimizers if o is not None]
        inside = {id(p) for m in self.modules for p in m.parameters()}
        self.params = [p for p in params if id(p) not in inside]
        self.on_host: set[str] = set()
        self._lock = (
            threading.RLock()
        )  # an export that brings the state back holds it: an offload waits for its end
        self._state_devices: dict[tuple[int, str], torch.device] = {}

    def offload(self, parts: Sequence[str]) -> int:
        """Move ``parts`` (of :data:`PARTS`) to the host; the bytes moved (or freed, for gradients)."""
        if unknown := set(parts) - set(PARTS):
            raise ValueError(f"offload: unknown part(s) {sorted(unknown)}; known: {', '.join(PARTS)}")
        with self._lock:
            return self._offload(parts)

    def _offload(self, parts: Sequence[str]) -> int:
        moved = 0
        if "grads" in parts:
            for p in self._params():
                if p.grad is not None:
                    moved += _nbytes(p.grad)
                    p.grad = None
        if "optimizer" in parts and "optimizer" not in self.on_host:
            for key, state, name, value in self._state_tensors():
                self._state_devices[key] = value.device
                state[name] = value.to(HOST, copy=True)
                moved += _nbytes(value)
            self.on_host.add("optimizer")
        if "params" in parts and "params" not in self.on_host:
            moved += self._move_modules(HOST)
            self.on_host.add("params")
        return moved

    def onload(self) -> int:
        """Everything back on the device (optimizer state where each tensor was); the bytes moved."""
        with self._lock:
            return self._onload()

    def _onload(self) -> int:
        moved = 0
        if "params" in self.on_host:
            moved += self._move_modules(self.device)
            self.on_host.discard("params")
        if "optimizer" in self.on_host:
            for key, state, name, value in self._state_tensors():
                state[name] = value.to(self._state_devices.pop(key, self.device), copy=True)
                moved += _nbytes(value)
            self.on_host.discard("optimizer")
        return moved

    @contextmanager
    def held(self) -> Iterator[None]:
        """Everything on the device for the block (a checkpoint or export of an offloaded trainer), then back where
        it was; an offload or onload from another thread waits for the block's end."""
        with self._lock:
            was = tuple(self.on_host)
            self._onload()
            try:
                yield
            finally:
                self._offload(was)

    def _params(self) -> Iterator[torch.nn.Parameter]:
        for module in self.modules:
            yield from module.parameters()
        yield from self.params

    def _state_tensors(self) -> Iterator[tuple[tuple[int, str], dict, str, torch.Tensor]]:
        for optimizer in self.optimizers:
            for param, state in optimizer.state.items():
                for name, value in list(state.items()):
                    if isinstance(value, torch.Tensor):
                        yield (id(param), name), state, name, value

    @torch.no_grad()
    def _move_modules(self, device: torch.device) -> int:
        moved = 0
        for module in self.modules:  # an FSDP2 unit re-registers its shards in its own _apply
            moved += sum(_nbytes(t) for t in (*module.parameters(), *module.buffers()))
            module._apply(lambda t: t.to(device, copy=True))
        for param in self.params:
            moved += _nbytes(param)
            param.data = param.data.to(device, copy=True)
        return moved


class Offloadable:
    """The trainer side of ``trainer.offload`` (a mixin): ``offload(parts)`` / ``onload()`` over the trainer's
    ``model`` and ``optimizer`` and, where it has one, its critic's; each answers the memory it left (see
    ``relax.core.policy_update.memory.memory_now``) and the GiB it moved."""

    device: torch.device

    @property
    def offloader(self) -> Offloader:
        if getattr(self, "_offloader", None) is None:
            self._offloader = Offloader(self.device, *self.offloaded_parts())
        return self._offloader

    def offloaded_parts(self) -> tuple[list[Any], list[Any], list[torch.nn.Parameter]]:
        """What moves: (modules, optimizers, parameters outside the modules); by default the trainer's ``model``
        and ``optimizer`` and its critic's. A backend with more (or other) state overrides this."""
        critic = getattr(self, "critic", None)
        modules = [getattr(self, "model", None), getattr(critic, "model", None)]
        return modules, [getattr(self, "optimizer", None), getattr(critic, "optimizer", None)], []

    def offload(self, parts: Sequence[str] = ()) -> dict[str, Any]:
        """Release what this trainer holds on its device: with no ``parts`` only the allocator's cache (the
        last step's activations), else also ``parts`` of ``grads``, ``optimizer``, ``params`` (to the host).
        ``before``: memory after the activations were freed, before anything moved; ``after``: at the end."""
        return release(self, parts)

    def onload(self) -> dict[str, Any]:
        """Everything :meth:`offload` moved back on the device (a no-op when nothing is on the host)."""
        moved = self.offloader.onload()
        return {"after": memory_now(), "moved_gb": moved / _GB}
