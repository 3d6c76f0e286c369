"""Throughput of ``math`` through the hub's process pool vs math-verify called serially in one process.

The same 2,000 outputs (boxed integers, fractions, decimals, percentages, sets, intervals, "Answer:"
lines, wrong answers, long reasoning) are scored twice: serially by ``math_score`` in this process
(the baseline: what a reward without a pool does), and by a hub with ``workers`` processes, groups
of 8 in flight as the reward role sends them. Pool start-up (imports, warm-up) is excluded; the
scores must be identical. The two alternate in rounds (other load on the machine drifts) and the
headline (last line) is the median per-round ratio: ``rewards: <ratio>x ...``.

    python bench/rewards.py [--n 2000] [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time


def outputs(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b = rng.randint(1, 99), rng.randint(2, 12)
        kind = i % 8
        pad = "Let me work through this carefully. " * rng.randint(1, 40)
        if kind == 0:
            out.append((f"{pad} So the total is \\boxed{{{a + b}}}.", str(a + b)))
        elif kind == 1:
            out.append((f"{pad} \\boxed{{\\frac{{{a}}}{{{b}}}}}", f"{a / b:.6f}".rstrip("0")))
        elif kind == 2:
            out.append((f"<think>{pad}</think> Answer: {a / 100}", f"{a}\\%"))
        elif kind == 3:
            out.append((f"{pad} \\boxed{{\\{{{a}, {b}\\}}}}", f"\\{{{b},{a}\\}}"))
        elif kind == 4:
            out.append((f"{pad} The answer is $[{a}, {a + b})$.", f"[{a},{a + b})"))
        elif kind == 5:
            out.append((f"{pad} \\boxed{{{a + 1}}}", str(a)))  # wrong
        elif kind == 6:
            out.append((f"{pad} \\boxed{{{a}\\sqrt{{2}}}}", f"\\sqrt{{{2 * a * a}}}"))
        else:
            out.append((f"{pad} I am not sure.", str(a)))  # no answer
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=4, help="alternating serial/pool rounds (load drifts)")
    args = parser.parse_args()

    from relax.rewards.hub import Hub, HubParams
    from relax.rewards.mathverify import MathParams, math_score, warm_math
    from relax.rewards.testing import make_sample

    data = outputs(args.n)
    warm_math()
    hub = Hub(
        HubParams(
            routes={"math": "math"},
            default="math",
            workers=args.workers,
            max_concurrency=4 * args.workers,
            call_timeout_s=60,
        )
    )
    asyncio.run(
        hub.score_group([make_sample("\\boxed{1}", "1", index=i) for i in range(2 * args.workers)])
    )  # warm

    def serial(chunk):
        return [math_score(r, lab, {}, MathParams())["score"] for r, lab in chunk]

    def pooled(chunk):
        samples = [make_sample(r, lab, group=i // 8, index=i % 8) for i, (r, lab) in enumerate(chunk)]
        groups = [samples[i : i + 8] for i in range(0, len(samples), 8)]

        async def score_all():
            return await asyncio.gather(*(hub.score_group(g) for g in groups))

        return [o["score"] for group in asyncio.run(score_all()) for o in group]

    size = -(-len(data) // args.rounds)
    totals, ratios = {"serial": 0.0, "pool": 0.0}, []
    for r in range(args.rounds):
        chunk = data[r * size : (r + 1) * size]
        seconds, scores = {}, {}
        for name in ("serial", "pool") if r % 2 == 0 else ("pool", "serial"):
            start = time.perf_counter()
            scores[name] = (serial if name == "serial" else pooled)(chunk)
            seconds[name] = time.perf_counter() - start
            totals[name] += seconds[name]
        if scores["pool"] != scores["serial"]:
            diff = sum(p != s for p, s in zip(scores["pool"], scores["serial"], strict=True))
            raise SystemExit(
                f"rewards: the pool's scores differ from the serial ones on {diff} of {len(chunk)} outputs"
            )
        ratios.append(seconds["serial"] / seconds["pool"])
        print(
            f"round {r}: serial {len(chunk) / seconds['serial']:.0f}/s, pool {len(chunk) / seconds['pool']:.0f}/s, "
            f"{ratios[-1]:.2f}x"
        )
    hub.close()
    n = len(data)
    print(
        f"serial math-verify: {n / totals['serial']:.0f} samples/s; hub pool ({args.workers} workers): "
        f"{n / totals['pool']:.0f} samples/s; rounds {', '.join(f'{x:.2f}' for x in ratios)}"
    )
    print(
        f"rewards: {statistics.median(ratios):.2f}x math samples/s through the hub's {args.workers}-process pool "
        f"vs serial math-verify in one process (median of {args.rounds} rounds, {n} outputs)"
    )


if __name__ == "__main__":
    main()
