"""Memory of a trainer process: the peaks of one train step, and what it holds now (colocate phases).

Peaks: the accelerator's allocator peak and the host process's peak RSS.

Both peaks are reset when a step starts, so each step reports its own: CUDA through the caching
allocator's statistics, the host through Linux's ``/proc/self/clear_refs`` (writing ``5`` resets the
``VmHWM`` high-water mark, kernel >= 4.0). Where a reset is impossible the host figure is the
process's peak so far (never lower than the step's)."""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

_GB = float(1 << 30)


def reset_peaks() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def host_peak_gb() -> float | None:
    """This process's peak resident memory (``VmHWM``) in GiB, or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / _GB
    except OSError:
        return None
    return None


def peak_metrics() -> dict[str, float]:
    """``perf/peak_mem_gb`` (CUDA allocator, where CUDA runs) and ``perf/peak_rss_gb`` (host) since the reset."""
    out = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["perf/peak_mem_gb"] = torch.cuda.max_memory_allocated() / _GB
    if (rss := host_peak_gb()) is not None:
        out["perf/peak_rss_gb"] = rss
    return out


def _cuda_live() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def host_rss_gb() -> float | None:
    """This process's resident memory now (``VmRSS``) in GiB, or None off Linux."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / _GB
    except OSError:
        return None
    return None


def free_cached() -> None:
    """Drop what nothing references any more (activations of the last step held by reference cycles) and
    hand the CUDA caching allocator's free blocks back to the driver, so another process on the same GPU
    (a colocated engine) can map them. Only where CUDA runs: on the host there is no cache to hand back, and a
    full ``gc.collect`` of a process holding torch + transformers costs 0.1-0.3 s of CPU, twice per colocate
    step (more than a whole quick-start step on CPU)."""
    if _cuda_live():
        gc.collect()
        torch.cuda.empty_cache()


def memory_now() -> dict[str, float]:
    """What this process holds now: ``mem_gb`` (CUDA tensors), ``mem_reserved_gb`` (CUDA tensors plus the
    allocator's cache: what other processes on the GPU cannot use), where CUDA runs; ``rss_gb`` (host)."""
    out = {}
    if _cuda_live():
        out["mem_gb"] = torch.cuda.memory_allocated() / _GB
        out["mem_reserved_gb"] = torch.cuda.memory_reserved() / _GB
    if (rss := host_rss_gb()) is not None:
        out["rss_gb"] = rss
    return out


def phase_metrics(phase: str, snapshot: dict[str, float]) -> dict[str, float]:
    """A :func:`memory_now` snapshot as step metrics of ``phase``: ``perf/mem_<phase>_gb``,
    ``perf/mem_reserved_<phase>_gb``, ``perf/rss_<phase>_gb``."""
    return {f"perf/{key[:-3]}_{phase}_gb": float(value) for key, value in snapshot.items()}


def release(trainer: Any, parts: Sequence[str] = ()) -> dict[str, Any]:
    """``offload(parts)`` of any trainer (``relax.core.trainers.offload.Offloadable``): one without an
    ``offloader`` (a backend that does not offload) can still free its allocator's cache (``parts`` empty).
    ``before``: memory once the last step's activations are gone, before anything moved; ``after``: at the end."""
    offloader = getattr(trainer, "offloader", None) if parts else None  # built only when something moves
    if parts and offloader is None:
        raise RuntimeError(
            f"trainer.offload: {type(trainer).__name__} cannot move {', '.join(parts)} to the host"
        )
    free_cached()
    before = memory_now()
    moved = offloader.offload(tuple(parts)) if parts else 0
    free_cached()
    return {"before": before, "after": memory_now(), "moved_gb": moved / _GB}


@contextmanager
def onloaded(trainer: Any) -> Iterator[None]:
    """``trainer``'s state on its device for the block (a checkpoint or export while offloaded), then back."""
    offloader = getattr(trainer, "_offloader", None)  # only one in use: never built here
    if offloader is None:
        yield
        return
    with offloader.held():
        yield
