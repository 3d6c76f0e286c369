"""Transfer-queue throughput: put+get(+ack) through the queue actor vs raw ray.put/ray.get.

Both paths move the same tensors through the same object store in batches of ``--batch`` rows;
the queue adds two actor calls per batch (put_rows; get, which acknowledges the previous batch),
each carrying the batch as one pickled blob. Prints rows/s and MB/s per row
size, then the headline ratio for 1 MB rows last.

    python bench/queue.py [--batch 16] [--seconds-per-case 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

if __name__ == "queue":
    # Every script in bench/ has this folder on sys.path, so `import queue` (torch, concurrent.futures,
    # ...) lands on this file: hand the importer the standard-library module instead.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "queue", os.path.join(os.path.dirname(os.__file__), "queue.py")
    )
    sys.modules["queue"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["queue"])
else:
    for _key, _value in {
        "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_AUTH_MODE": "disabled",
    }.items():
        os.environ.setdefault(_key, _value)
    import ray
    import torch

    from relax.core.controller.ray_start import start_loopback_ray
    from relax.core.queue import TransferQueueClient


def raw_round(rows: list[torch.Tensor]) -> None:
    refs = [ray.put(r) for r in rows]
    out = ray.get(refs)
    assert len(out) == len(rows)


_last_keys: dict[int, list] = {}  # per client: the previous batch, acknowledged by the next get


def queue_round(client: TransferQueueClient, step: int, rows: list[torch.Tensor]) -> None:
    """One put and one get (which acknowledges the previous batch): two actor calls per batch."""
    client.put_rows(step, [{"payload": r, "id": i} for i, r in enumerate(rows)], timeout=60)
    ack = _last_keys.pop(id(client), [])
    batch = client.get("trainer", ["payload"], len(rows), timeout=60, group_aware=False, ack=ack)
    assert len(batch.data["payload"]) == len(rows)
    _last_keys[id(client)] = batch.keys


def measure_pair(fa, fb, seconds: float) -> tuple[float, float]:
    """Rounds per second of ``fa`` and ``fb``, alternated so machine-speed drift hits both alike."""
    fa(-1), fb(-1)  # warm-up
    spent = [0.0, 0.0]
    n = 0
    while sum(spent) < 2 * seconds or n < 3:
        for j, fn in enumerate((fa, fb)):
            start = time.perf_counter()
            fn(n)
            spent[j] += time.perf_counter() - start
        n += 1
    return n / spent[0], n / spent[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seconds-per-case", type=float, default=3.0)
    args = parser.parse_args()
    start_loopback_ray(num_cpus=2)  # 127.0.0.1 only, as `relax run` starts Ray
    client = TransferQueueClient.create(capacity=4 * args.batch, consumers=["trainer"], inline_bytes=64 << 10)
    client.metrics()  # actor started
    ratios = {}
    for label, numel in (("1KB", 256), ("1MB", 256 << 10)):
        rows = [torch.randn(numel) for _ in range(args.batch)]
        mb = args.batch * numel * 4 / 1e6
        raw_rps, q_rps = measure_pair(
            lambda i, rows=rows: raw_round(rows),
            lambda i, rows=rows: queue_round(client, i + 1, rows),
            args.seconds_per_case,
        )
        raw_rate, q_rate = raw_rps * args.batch, q_rps * args.batch
        ratios[label] = q_rate / raw_rate
        if label == "1KB":
            raw_rate_1kb = raw_rate
        print(
            f"{label} rows, batch {args.batch}: queue {q_rate:,.0f} rows/s ({q_rate * mb / args.batch:,.1f} MB/s)"
            f" | raw ray.put/get {raw_rate:,.0f} rows/s ({raw_rate * mb / args.batch:,.1f} MB/s)"
            f" | ratio {ratios[label]:.2f}x"
        )
    # small rows at a quick-start step batch (256 rows): the three actor calls are amortised
    big = 256
    step_client = TransferQueueClient.create(capacity=2 * big, consumers=["trainer"], inline_bytes=64 << 10)
    rows = [torch.randn(256) for _ in range(big)]
    raw_rps, q_rps = measure_pair(
        lambda i: raw_round(rows), lambda i: queue_round(step_client, i + 1, rows), args.seconds_per_case
    )
    print(
        f"1KB rows, batch {big}: queue {1e6 / (q_rps * big):.0f} us/row | raw ray.put/get {1e6 / (raw_rps * big):.0f} us/row"
        f" | ratio {q_rps / raw_rps:.2f}x"
    )
    print(f"1KB rows, batch {args.batch}: queue {1e6 / (ratios['1KB'] * raw_rate_1kb):.0f} us/row")
    m = client.metrics()
    print(
        f"queue metrics: rows_produced={m['queue/rows_produced']:.0f} max_rows={m['queue/max_rows']:.0f} rows={m['queue/rows']:.0f}"
    )
    ray.shutdown()
    print(f"queue: {ratios['1MB']:.2f}x queue 1MB put+get vs raw ray.put/get")


if __name__ == "__main__":
    main()
