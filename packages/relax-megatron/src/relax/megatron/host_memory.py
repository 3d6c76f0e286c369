"""Host memory while a CPU megatron rank is built and loaded: its shard and little more (issue 39).

Measured with ``relax.megatron.load_rss`` (~218 M parameters, world 2), two things kept a rank's peak
well above its shard (0.5x a full fp32 copy), besides the load reading one unit at a time:

* megatron's CPU initialisation (``use_cpu_initialization``) builds every TP-split weight as a whole
  ``torch.empty`` master and copies this rank's part out of it through a temporary (``torch.cat`` of
  its chunks): for the output layer that is a rank-sized (at TP 1 a full-sized) temporary on top of the
  rest of the model. :func:`built_unfilled` builds with each ``torch.empty`` that names no device on the
  meta device, then gives each parameter its own untouched host storage, megatron's attributes
  (``tensor_model_parallel``, ``partition_dim``, ...) kept: the load fills it.
* glibc's dynamic mmap threshold: once a large block is freed, blocks up to its size come from the heap,
  whose freed pages stay resident and fragment, so the load's per-unit temporaries add up.
  :func:`large_blocks_returned` has glibc map each large block on its own (returned when freed) meanwhile.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
#: the threshold while building and loading: glibc's initial one (its dynamic growth is what is stopped)
LOAD_THRESHOLD = 128 * 1024
#: afterwards: the most glibc's dynamic threshold grows to on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``), where a
#: training process's threshold ends up, since it frees large tensors all the time
AFTER_THRESHOLD = 32 * 1024 * 1024


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` without a device (how megatron allocates weights and masters on CPU) -> meta."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs["device"] = "meta"
        return func(*args, **kwargs)


def meta_left(model: torch.nn.Module) -> list[str]:
    """Tensors of ``model`` still on the meta device other than parameters (buffers, plain attributes)."""
    left = [n for n, b in model.named_buffers() if b.is_meta]
    for prefix, module in model.named_modules():
        for key, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.is_meta:
                left.append(f"{prefix}.{key}" if prefix else key)
    return left


def materialize(model: torch.nn.Module) -> None:
    """Give each meta parameter its own untouched host storage, its attributes kept (tied ones stay tied)."""
    done: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in done:
                real = torch.nn.Parameter(torch.empty_like(p, device="cpu"), requires_grad=p.requires_grad)
                real.__dict__.update(p.__dict__)
                done[id(p)] = real
            module._parameters[name] = done[id(p)]


def built_unfilled(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """``build()`` (a CPU-initialised megatron model whose init method leaves weights as they are) with its
    parameters allocated once and untouched, for a load to fill. Where a meta tensor would be left that is
    not a parameter (a buffer made by ``torch.empty``: its values would be lost), built again as is."""
    with _EmptyOnMeta():
        model = build()
    if left := meta_left(model):
        log.warning("megatron model built without meta weights (meta tensors left: %s)", left[:4])
        return build()
    materialize(model)
    return model


def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    return getattr(libc, "mallopt", None) if libc is not None and hasattr(libc, "malloc_trim") else None


@contextlib.contextmanager
def large_blocks_returned() -> Iterator[None]:
    """glibc (elsewhere a no-op): blocks over ``LOAD_THRESHOLD`` mapped on their own meanwhile, so a
    freed temporary leaves the resident set; afterwards the threshold is ``AFTER_THRESHOLD``."""
    mallopt = _mallopt()
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, LOAD_THRESHOLD):
        yield
        return
    try:
        yield
    finally:
        mallopt(M_MMAP_THRESHOLD, AFTER_THRESHOLD)
