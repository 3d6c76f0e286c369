"""Peak memory of one train step: the accelerator's allocator peak and the host process's peak RSS.

Both peaks are reset when a step starts, so each step reports its own: CUDA through the caching
allocator's statistics, the host through Linux's ``/proc/self/clear_refs`` (writing ``5`` resets the
``VmHWM`` high-water mark, kernel >= 4.0). Where a reset is impossible the host figure is the
process's peak so far (never lower than the step's)."""

from __future__ import annotations

from pathlib import Path

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
