"""Weight-sync bandwidth of each transport for a ~100 MB model vs a plain in-process tensor copy.

One trainer (local object) and one engine that copies into preallocated parameters (a Ray actor,
except for ``in_process`` where it is local, as in colocate mode). Each transport is synced once to
warm up (the broadcast group is built then), then timed over ``--repeats`` syncs (median).

    python bench/weight_sync.py [--mb 100] [--bucket-mb 32] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
}.items():
    os.environ.setdefault(_key, _value)

import ray  # noqa: E402
import torch  # noqa: E402

from relax.core.weight_sync import TRANSPORTS, BroadcastReceiver, DiskReceiver  # noqa: E402


class Trainer:
    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state

    def export_weights(self, bucket_bytes: int):
        bucket, size = [], 0
        for name, t in self.state.items():
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size >= bucket_bytes:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


class Engine(BroadcastReceiver, DiskReceiver):
    """Copies received tensors into preallocated parameters, like a real engine."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.params = {name: torch.empty(shape) for name, shape in shapes.items()}
        self.version = -1

    def update_weights(self, named_tensors, version: int) -> None:
        for name, t in named_tensors:
            self.params[name].copy_(t)
        self.version = version

    def weight_version(self) -> int:
        return self.version

    def checksum(self) -> float:
        return float(sum(p.double().sum() for p in self.params.values()))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    n_tensors = max(1, args.mb // 4)
    state = {f"layers.{i}.weight": torch.randn(1024, 1024) for i in range(n_tensors)}  # 4 MiB each
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())

    dst = {name: torch.empty_like(t) for name, t in state.items()}

    def copy_seconds() -> list[float]:
        times = []
        for _ in range(args.repeats + 1):
            start = time.perf_counter()
            for name, t in state.items():
                dst[name].copy_(t)
            times.append(time.perf_counter() - start)
        return times[1:]

    copy_times = copy_seconds()
    print(f"model: {n_tensors} tensors, {nbytes / 2**20:.0f} MiB; bucket {args.bucket_mb} MiB")

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    actor = ray.remote(num_cpus=0)(Engine).remote(shapes)
    ray.get(actor.weight_version.remote())
    trainer = Trainer(state)
    want = float(sum(t.double().sum() for t in state.values()))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cls in TRANSPORTS.items():
            kw = {"directory": tmp} if name == "disk" else {}
            sync = cls(timeout_s=300, bucket_bytes=args.bucket_mb << 20, **kw)
            engine = Engine(shapes) if name == "in_process" else actor
            seconds = []
            for version in range(args.repeats + 1):
                seconds.append(sync.sync(trainer, [engine], version + 1)["seconds"])
            got = engine.checksum() if name == "in_process" else ray.get(actor.checksum.remote())
            assert abs(got - want) < 1e-6 * max(1.0, abs(want)), (name, got, want)
            results[name] = nbytes / statistics.median(seconds[1:])
    ray.shutdown()
    copy_bps = nbytes / statistics.median(copy_times + copy_seconds())  # before and after: speed drifts here
    print(f"in-process tensor copy: {copy_bps / 1e9:.2f} GB/s (median of runs before and after)")
    for name, bps in results.items():
        print(f"{name:>12}: {bps / 1e9:.3f} GB/s  ({bps / copy_bps:.3f}x tensor copy)")
    print(
        f"weight_sync: {results['object_store'] / copy_bps:.3f}x object_store {args.mb}MiB sync bytes/s vs in-process tensor copy"
    )


if __name__ == "__main__":
    main()
