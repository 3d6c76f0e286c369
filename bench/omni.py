"""Media pipeline throughput: group-shared vs per-sample processing (relax-omni, tiny Qwen2.5-VL processor).

A GRPO group is G samples of one prompt. Group-shared (what core does): load + process the prompt's media once
and give every sample the same inputs. Per-sample (the baseline): every sample loads and processes its own copy.
Rows are the generated media task (images of circles, few-frame videos). Also measures the resident memory of
1,000 queued image samples either way
(group-shared first, freed before the per-sample queue is built), and the HF engine's decoding of one media
group (G rows, ``--new-tokens`` each): KV-cached vs the full forward per token it replaced.

    python bench/omni.py [--group 8] [--prompts 16] [--rounds 3] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path


def setup(root: Path, rows: int):
    from relax.core.context import PluginContext
    from relax.omni.processors import OmniProcessorParams, make_factory
    from relax.omni.synthetic import make_dataset
    from relax.omni.tiny_models import tiny_multimodal_dir

    data = make_dataset(root / "data", ("image", "image", "video"), rows)
    params = OmniProcessorParams(
        min_pixels=56 * 56,
        max_pixels=112 * 112,
        video_min_pixels=28 * 28,
        video_max_pixels=56 * 56,
        max_frames=4,
        media_root=str(data.parent),
    )
    model = tiny_multimodal_dir(root, "qwen2_5_vl")
    proc = make_factory("qwen2_5_vl")(params, PluginContext(role="processor", model_path=model))
    prompts = [json.loads(line)["prompt"] for line in data.read_text().splitlines()]
    return proc, prompts, model


def decode_tokens_per_s(engine, processed: dict, group: int, new_tokens: int, kv_cache: bool) -> float:
    """Tokens/s of one media group decoded to exactly ``new_tokens`` each (eos ignored)."""
    from relax.core.protocols import GenerationRequest, SamplingParams
    from relax.core.testing.models import run_async

    engine.media_kv_cache = kv_cache
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    requests = [
        GenerationRequest(
            f"{kv_cache}/{j}",
            list(processed["prompt_ids"]),
            replace(params, seed=j),
            media=processed["inputs"],
        )
        for j in range(group)
    ]
    start = time.perf_counter()
    results = run_async(engine.generate(requests), 3600)
    assert all(len(r.response_ids) == new_tokens for r in results)
    return group * new_tokens / (time.perf_counter() - start)


def group_shared(proc, prompts, group: int) -> list:
    from relax.core.data_multimodal import share

    samples = []
    for i, messages in enumerate(prompts):
        ref = share(proc.process(messages, [], f"bench:{i}")["inputs"])  # once per prompt
        samples += [ref] * group
    return samples


def per_sample(proc, prompts, group: int) -> list:
    return [
        proc.process(messages, [], f"bench:{i}")["inputs"]
        for i, messages in enumerate(prompts)
        for _ in range(group)
    ]


def prompts_per_s(fn, proc, prompts, group: int) -> float:
    start = time.perf_counter()
    samples = fn(proc, prompts, group)
    assert len(samples) == group * len(prompts)
    return len(prompts) / (time.perf_counter() - start)


def queued_mb(fn, proc, prompts, group: int, samples: int) -> tuple[float, float]:
    """MB held by ``samples`` queued image samples built by ``fn``: distinct tensor storage (exact) and the
    process's RSS growth (noisy: the allocator reuses memory freed earlier); the queue is freed after."""
    import gc

    import psutil

    gc.collect()
    before = psutil.Process().memory_info().rss
    queue = fn(proc, prompts[: samples // group], group)
    grown = psutil.Process().memory_info().rss - before
    assert len(queue) == samples
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for q in queue for t in q.values()
    }
    del queue
    gc.collect()
    return sum(storages.values()) / 2**20, grown / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queued", type=int, default=1000, help="image samples held for the memory measure")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per row for the decode measure")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        proc, prompts, model = setup(
            root, max(args.prompts, 3 * args.queued // (2 * args.group) + 3)
        )  # 2/3 images
        bench_prompts = prompts[: args.prompts]
        group_shared(proc, bench_prompts[:3], 1)  # warm-up: decoder and processor imports, first calls
        shared, single = [], []
        for _ in range(args.rounds):  # alternated so machine-speed drift hits both alike
            shared.append(prompts_per_s(group_shared, proc, bench_prompts, args.group))
            single.append(prompts_per_s(per_sample, proc, bench_prompts, args.group))
        s, p = statistics.median(shared), statistics.median(single)
        print(f"group-shared: {s:.1f} prompts/s ({s * args.group:.0f} samples/s), median of {args.rounds}")
        print(f"per-sample:   {p:.1f} prompts/s ({p * args.group:.0f} samples/s)")
        images = [m for m in prompts if m[0]["content"][0]["type"] == "image"]
        mb_shared = queued_mb(group_shared, proc, images, args.group, args.queued)
        mb_single = queued_mb(per_sample, proc, images, args.group, args.queued)
        print(
            f"memory per {args.queued} queued image samples: group-shared {mb_shared[0]:.1f} MB, per-sample "
            f"{mb_single[0]:.1f} MB of tensors (RSS growth {mb_shared[1]:.1f} / {mb_single[1]:.1f} MB)"
        )
        from relax.core.engines.hf import HFRolloutEngine

        engine = HFRolloutEngine(model)
        processed = proc.process(images[0], [], "bench:decode")
        decode_tokens_per_s(engine, processed, args.group, 4, True)  # warm-up
        kv = decode_tokens_per_s(engine, processed, args.group, args.new_tokens, True)
        full = decode_tokens_per_s(engine, processed, args.group, args.new_tokens, False)
        print(
            f"media decode (G={args.group}, {args.new_tokens} new tokens, {len(processed['prompt_ids'])}-token "
            f"prompt): KV-cached {kv:.0f} tok/s vs full forward per token {full:.0f} tok/s ({kv / full:.1f}x)"
        )
        print(f"omni: {s / p:.1f}x prompts/s group-shared vs per-sample processing (G={args.group})")


if __name__ == "__main__":
    main()
