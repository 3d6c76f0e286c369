"""Weight-sync bandwidth and memory, trainer actor -> engine actor, against a memcpy in the same run.

A trainer actor holding ~100 MiB (25 4-MiB matrices plus 25 small vectors) pushes its weights
to an engine actor that copies them into preallocated parameters (as the HF engine does), through
every built-in transport; the bytes never pass through this (driver) process. Each transport gets
fresh actors, is synced once cold (buffers, broadcast group) and then ``--repeats`` times (median).

Baseline: single-process memcpy of the same 100 MiB in this process, ``torch.empty_like(x).copy_(x)``
(the issue's definition: it includes the page faults of a fresh buffer), timed right before each
timed sync; a ratio is the median over rounds of memcpy time / sync time, so that load from other
processes drifting during the run affects both sides alike. A copy into a preallocated buffer is
paired the same way and printed for context. Peak extra RSS is the
process's peak resident memory during the timed syncs minus its resident memory before them, in
buckets (RssShmem growth, the Ray object store's shared pages mapped by the process, is shown
apart). The headline (last line) is gloo broadcast bandwidth over that memcpy bandwidth.

    python bench/weight_sync.py [--mb 100] [--bucket-mb 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile
import time

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    "OMP_NUM_THREADS": "1",
}.items():
    os.environ.setdefault(_key, _value)

import ray  # noqa: E402
import torch  # noqa: E402

from relax.core.context import PluginContext  # noqa: E402
from relax.core.controller.ray_start import start_loopback_ray  # noqa: E402
from relax.core.plugins import get_plugin_manager  # noqa: E402
from relax.core.weight_sync import TRANSPORTS, serve_receiver, serve_sender  # noqa: E402


def memory() -> dict[str, int]:
    """This process's resident and peak resident bytes."""
    status = open("/proc/self/status").read()
    return {
        k: int(re.search(rf"{k}:\s+(\d+) kB", status).group(1)) << 10 for k in ("VmRSS", "VmHWM", "RssShmem")
    }


def reset_peak() -> dict[str, int]:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return memory()


class Trainer:
    def __init__(self, mb: int):
        n = max(1, mb // 4)
        self.state = {}
        for i in range(n):
            self.state[f"layers.{i}.mlp.weight"] = torch.randn(1024, 1024)  # 4 MiB
            self.state[f"layers.{i}.norm.weight"] = torch.randn(1024)  # 4 KiB

    def export_weights(self, bucket_bytes: int):
        """Views of the live weights, as ``TorchTrainer.export_weights``."""
        bucket, size = [], 0
        for name, t in self.state.items():
            if bucket and size + t.numel() * t.element_size() > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, t))
            size += t.numel() * t.element_size()
        if bucket:
            yield bucket


class Engine:
    """Copies received tensors into preallocated parameters, like a real engine."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.params = {name: torch.zeros(shape) for name, shape in shapes.items()}
        self.version = -1

    def update_weights(self, named_tensors, version: int) -> None:
        for name, t in named_tensors:
            self.params[name].copy_(t)
        self.version = version

    def weight_version(self) -> int:
        return self.version

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.params.values()))


@ray.remote(num_cpus=0)
class TrainerHost:
    def __init__(self, mb: int):
        self.trainer = Trainer(mb)

    def weight_sender(self, spec, method, *args):
        yield from serve_sender(self, self.trainer, spec, method, *args)

    def shapes_and_checksum(self):
        state = self.trainer.state
        return {n: tuple(t.shape) for n, t in state.items()}, float(
            sum(t.double().sum() for t in state.values())
        )

    def reset_peak(self):
        return reset_peak()

    def memory(self):
        return memory()


@ray.remote(num_cpus=0, max_concurrency=4)
class EngineHost:
    def __init__(self, shapes):
        self.engine = Engine(shapes)

    def weight_receiver(self, spec, method, *args):
        return serve_receiver(self, self.engine, spec, method, *args)

    def checksum(self):
        return self.engine.checksum()

    def reset_peak(self):
        return reset_peak()

    def memory(self):
        return memory()


def memcpy_seconds(x: torch.Tensor, repeats: int, fresh: bool) -> list[float]:
    out = torch.empty_like(x)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        if fresh:
            torch.empty_like(x).copy_(x)
        else:
            out.copy_(x)
        times.append(time.perf_counter() - start)
    return times[1:]


def bench_transport(name: str, args, directory: str, x: torch.Tensor) -> dict[str, float]:
    nbytes = x.numel() * x.element_size()
    bucket = args.bucket_mb << 20
    trainer = TrainerHost.remote(args.mb)
    shapes, want = ray.get(trainer.shapes_and_checksum.remote())
    engine = EngineHost.remote(shapes)
    hosts = {"trainer": trainer, "engine": engine}
    ray.get([h.memory.remote() for h in hosts.values()])
    params = {"directory": directory} if name == "disk" else {}
    factory = get_plugin_manager().get("weight_sync", name)
    ctx = PluginContext(role="weight_sync", timeout_s=300, bucket_bytes=bucket)
    sync = factory(factory.config(**params), ctx)

    fresh, warm = [], []

    def timed(versions) -> tuple[list[float], dict[str, float]]:
        before = {r: ray.get(h.reset_peak.remote()) for r, h in hosts.items()}
        seconds = []
        for v in versions:
            fresh.append(statistics.median(memcpy_seconds(x, 3, fresh=True)))
            warm.append(statistics.median(memcpy_seconds(x, 3, fresh=False)))
            seconds.append(sync.sync(trainer, [engine], v)["seconds"])
        after = {r: ray.get(h.memory.remote()) for r, h in hosts.items()}
        extra = {r: (after[r]["VmHWM"] - before[r]["VmRSS"]) / bucket for r in hosts}
        shm = {f"{r}_shm": (after[r]["RssShmem"] - before[r]["RssShmem"]) / bucket for r in hosts}
        return seconds, {**extra, **shm}

    (cold,), cold_extra = timed([1])
    fresh.clear(), warm.clear()
    seconds, extra = timed(range(2, args.repeats + 2))
    got = ray.get(engine.checksum.remote())
    assert abs(got - want) < 1e-6 * max(1.0, abs(want)), (name, got, want)
    for h in hosts.values():
        ray.kill(h)
    return {
        "bps": nbytes / statistics.median(seconds),
        "cold_bps": nbytes / cold,
        "ratio": statistics.median(f / t for f, t in zip(fresh, seconds, strict=True)),
        "warm_ratio": statistics.median(w / t for w, t in zip(warm, seconds, strict=True)),
        "memcpy_bps": nbytes / statistics.median(fresh),
        "warm_bps": nbytes / statistics.median(warm),
        "extra": extra,
        "cold_extra": cold_extra,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    nbytes = sum(t.numel() * t.element_size() for t in Trainer(args.mb).state.values())
    x = torch.randn(nbytes // 4)

    start_loopback_ray(num_cpus=2)  # 127.0.0.1 only, as `relax run` starts Ray
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in TRANSPORTS:
            results[name] = bench_transport(name, args, tmp, x)
    ray.shutdown()

    print(
        f"model: {nbytes / 2**20:.1f} MiB in {len(Trainer(args.mb).state)} tensors; bucket {args.bucket_mb} MiB; "
        f"median of {args.repeats} syncs after a cold one; torch threads {torch.get_num_threads()}"
    )
    for name, r in results.items():
        print(
            f"{name:>12}: {r['bps'] / 1e9:.2f} GB/s = {r['ratio']:.2f}x memcpy ({r['memcpy_bps'] / 1e9:.2f} GB/s), "
            f"{r['warm_ratio']:.2f}x preallocated copy ({r['warm_bps'] / 1e9:.2f} GB/s); "
            f"cold first sync {r['cold_bps'] / 1e9:.2f} GB/s; "
            f"peak extra RSS in buckets: trainer {r['extra']['trainer']:.2f}, engine {r['extra']['engine']:.2f} "
            f"(cold sync: {r['cold_extra']['trainer']:.2f}, {r['cold_extra']['engine']:.2f}; of the timed peak, "
            f"shared object-store pages: {r['extra']['trainer_shm']:.2f}, {r['extra']['engine_shm']:.2f})"
        )
    print(
        f"weight_sync: {results['broadcast']['ratio']:.2f}x gloo broadcast vs single-process memcpy bandwidth"
    )


if __name__ == "__main__":
    main()
