"""Generated tokens/s of the SGLang engine vs core's HF engine on the same tiny model and batch, and the
latency of each ``sglang_*`` weight-update transport.

Both engines get the same requests (``--requests`` prompts, ``--tokens`` new tokens each, ignore_eos,
temperature 1, per-request seeds), each warmed up once and then timed ``--repeats`` times, alternating
HF / SGLang per round so drifting load from other processes hits both alike; the ratio is the median over
rounds of (SGLang tokens/s) / (HF tokens/s). The SGLang server is launched from its own environment
(``python: auto`` builds or reuses the cached CPU venv). Transport latency: the torch trainer (other
weights) syncs into the server ``--repeats`` times per transport (median, seconds, begin..end incl.).

On a device (``--device cuda``): both engines on the GPU in bf16, the server from ``$RELAX_SGLANG_PYTHON``
(an environment with CUDA SGLang), CUDA IPC for ``sglang_tensor``; ``--qwen3-0.6b`` serves a locally built,
randomly initialised Qwen3-0.6B-shaped model instead of the tiny one (no transports then: they need the
trainer's model to match the server's). ``sglang_distributed`` over NCCL needs a second GPU.

    python bench/sglang.py [--requests 64] [--tokens 64] [--repeats 3] [--model DIR] [--device cuda [--qwen3-0.6b]]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import torch

from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing import tiny_model_dir, torch_trainer
from relax.sglang.engine import SGLangEngine
from relax.sglang.params import SGLangEngineParams
from relax.sglang.transports import SGLangDiskSync, SGLangDistributedSync, SGLangTensorSync


def tokens_per_s(engine, requests: int, tokens: int, seed: int) -> float:
    reqs = [
        GenerationRequest(
            f"b{seed}-{i}",
            [4 + i % 7, 5, 6 + i % 5],
            SamplingParams(max_new_tokens=tokens, ignore_eos=True, seed=seed + i),
        )
        for i in range(requests)
    ]
    start = time.perf_counter()
    results = asyncio.run(asyncio.wait_for(engine.generate(reqs), 1800))
    elapsed = time.perf_counter() - start
    return sum(len(r.response_ids) for r in results) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default=None, help="HF model dir (default: the conformance kit's tiny Qwen3)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument(
        "--qwen3-0.6b",
        dest="qwen3",
        action="store_true",
        help="a Qwen3-0.6B-shaped model (with --device cuda)",
    )
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="relax-bench-sglang-")
    model, other = args.model or tiny_model_dir(root, 1), tiny_model_dir(root, 2)
    params = SGLangEngineParams(python="auto", startup_timeout_s=1200)
    dtype = "float32"
    if args.device == "cuda":
        if not os.environ.get("RELAX_SGLANG_PYTHON"):
            raise SystemExit(
                "--device cuda: set RELAX_SGLANG_PYTHON to an environment's python with CUDA SGLang"
            )
        dtype = "bfloat16"
        # the CUDA defaults otherwise (relax.sglang.device_defaults): SGLang sizes the KV pool, fast kernels
        params = SGLangEngineParams(
            python=os.environ["RELAX_SGLANG_PYTHON"],
            device="cuda",
            dtype=dtype,
            mem_fraction_static=0.4,
            startup_timeout_s=1200,
        )
        if args.qwen3:
            from relax.core.testing.models import build_qwen3_06b

            model = build_qwen3_06b(os.path.join(root, "qwen3-0.6b"), model, device="cuda")[0]
    hf = HFRolloutEngine(model, device=args.device, dtype=dtype)
    sgl = SGLangEngine(params, model, dtype=dtype, run_dir=root)
    try:
        for engine in (hf, sgl):
            tokens_per_s(engine, args.requests, args.tokens, seed=0)  # warm-up
        ratios, hf_rates, sgl_rates = [], [], []
        for r in range(args.repeats):
            h = tokens_per_s(hf, args.requests, args.tokens, seed=100 * (r + 1))
            s = tokens_per_s(sgl, args.requests, args.tokens, seed=100 * (r + 1))
            hf_rates.append(h)
            sgl_rates.append(s)
            ratios.append(s / h)
            print(f"round {r}: HF {h:,.0f} tok/s, SGLang {s:,.0f} tok/s, ratio {s / h:.2f}")
        if args.model is None and not args.qwen3:  # transports need the trainer's model to match the server's
            trainers = {
                "other": torch_trainer(other, device=args.device),
                "same": torch_trainer(model, device=args.device),
            }
            makes = [SGLangDiskSync, SGLangTensorSync]
            if args.device == "cpu":
                makes.append(SGLangDistributedSync)
            elif torch.cuda.device_count() > 1:  # NCCL: one rank per GPU
                makes.append(lambda **kw: SGLangDistributedSync({"backend": "nccl"}, **kw))
            for make in makes:
                transport = make(timeout_s=300)
                times = []
                for _ in range(args.repeats):
                    for which in ("other", "same"):
                        version = sgl.weight_version() + 1
                        start = time.perf_counter()
                        transport.sync(trainers[which], [sgl], version)
                        times.append(time.perf_counter() - start)
                transport.close()
                print(
                    f"{transport.name}: {statistics.median(times) * 1e3:.0f} ms per sync (median of {len(times)})"
                )
        print(
            f"HF engine: {statistics.median(hf_rates):,.0f} tok/s; SGLang engine: {statistics.median(sgl_rates):,.0f} tok/s "
            f"({args.requests} requests x {args.tokens} tokens)"
        )
        version = sgl.workers[0].get("/server_info").get("version")
        where = (
            ""
            if args.device == "cpu"
            else f" on {torch.cuda.get_device_name(0)}, bf16" + (", Qwen3-0.6B-shaped" if args.qwen3 else "")
        )
        where += f", sglang {version}"
        print(f"sglang: {statistics.median(ratios):.2f}x tokens/s SGLang vs HF engine{where}")
    finally:
        sgl.close()


if __name__ == "__main__":
    main()
