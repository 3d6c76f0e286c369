"""Peak memory and tokens/s of a training step on a long-tailed batch: today's padded path against token
budgets, packing, chunked logprobs and recompute; then memory per token as the longest row grows.

A tiny Qwen3 (hidden 128, 2 layers) with a 16K vocabulary (built from a config, nothing downloaded),
the same rows for every variant: 32 rows of a 64-token prompt, 30 responses of 16-64 tokens and two of
1,024 (16x the longest short one). Variants, cumulative:

  (a) padded     micro_batch_size 8 rows, full (tokens x V) logits: the path before real lengths
  (b) budget     trainer.max_tokens_per_micro_batch 2,048 (rows bin-packed, micro-batches trimmed)
  (c) packed     + trainer.pack_sequences (no padding at all)
  (d) chunked    + trainer.logits_chunk_tokens 256 (no (tokens x V) fp32 tensor beyond a chunk)
  (e) recompute  + trainer.recompute full

Each variant runs in a fresh process: peak memory is the step's own (``VmHWM`` after the first step
minus ``VmRSS`` before it: activations, logits, gradients and the optimizer state the step allocates);
tokens/s counts real tokens over two more (timed) steps. The sweep runs (e) with one row of L = 1K .. 16K
tokens and 15 short rows, budget L + 64: memory per budget token should not grow with L.

    python bench/long_context.py [--quick]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB, PROMPT = 16384, 64
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
VARIANTS = {
    "padded": {"micro_batch_size": 8, "logits_chunk_tokens": 0},
    "budget": {"max_tokens_per_micro_batch": 2048, "logits_chunk_tokens": 0},
    "packed": {"max_tokens_per_micro_batch": 2048, "pack_sequences": True, "logits_chunk_tokens": 0},
    "chunked": {"max_tokens_per_micro_batch": 2048, "pack_sequences": True, "logits_chunk_tokens": 256},
    "recompute": {
        "max_tokens_per_micro_batch": 2048,
        "pack_sequences": True,
        "logits_chunk_tokens": 256,
        "recompute": "full",
    },
}


def build_model(directory: Path) -> str:
    """The quick-start tokenizer (for its pad id) beside a 16K-vocabulary Qwen3: ids are drawn directly."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.core.quickstart_model import build_tiny_model

    path = build_tiny_model(directory, **MODEL)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, pad_token_id=0, eos_token_id=1, **MODEL)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


def make_batch(long_rows: list[int], short_rows: int, seed: int = 0, group: int = 0):
    import torch

    from relax.core.data import Sample
    from relax.core.testing.trainer import make_batch as with_advantages

    gen = torch.Generator().manual_seed(seed)

    def draw(n: int) -> list[int]:
        return torch.randint(4, VOCAB, (n,), generator=gen).tolist()

    lengths = [int(torch.randint(16, 65, (1,), generator=gen)) for _ in range(short_rows)] + long_rows
    order = torch.randperm(len(lengths), generator=gen).tolist()  # the long rows anywhere in the batch
    if group:  # GRPO groups: ``group`` responses share each prompt
        prompts = [draw(PROMPT) for _ in range(-(-len(order) // group))]
        samples = [
            Sample(prompt_ids=prompts[i // group], group_id=i // group, response_ids=draw(lengths[j]))
            for i, j in enumerate(order)
        ]
        return with_advantages(samples, pad_id=0)
    samples = [
        Sample(prompt_ids=draw(PROMPT), group_id=i // 4, response_ids=draw(lengths[j]))
        for i, j in enumerate(order)
    ]
    return with_advantages(samples, pad_id=0)


def status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def worker(
    model_dir: str, settings: dict, long_rows: list[int], short_rows: int, out: str, group: int = 0
) -> None:
    import torch

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.trainers.torch_trainer import TorchTrainer

    torch.set_num_threads(2)
    trainer = TorchTrainer(
        model_dir, objective=build_policy_objective(AlgorithmConfig()), lr=1e-5, **settings
    )
    batch = make_batch(long_rows, short_rows, group=group)
    tokens = float(batch["attention_mask"].sum())
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = status_kb("VmRSS")
    metrics = trainer.train_step(dict(batch))
    peak = status_kb("VmHWM") - before
    start = time.perf_counter()
    for _ in range(2):
        trainer.train_step(dict(batch))
    seconds = (time.perf_counter() - start) / 2
    Path(out).write_text(
        json.dumps(
            {
                "peak_mb": peak / 1024,
                "tokens_per_s": tokens / seconds,
                "tokens": tokens,
                "padding_frac": metrics["perf/padding_frac"],
                "micro_batches": metrics["perf/micro_batches"],
            }
        )
    )


def run(
    model_dir: str, settings: dict, long_rows: list[int], short_rows: int, tmp: Path, group: int = 0
) -> dict:
    out = tmp / "result.json"
    args = [
        sys.executable,
        __file__,
        "--worker",
        model_dir,
        json.dumps(settings),
        json.dumps(long_rows),
        str(short_rows),
        str(out),
        str(group),
    ]
    subprocess.run(args, check=True, timeout=1800, env={**os.environ, "OMP_NUM_THREADS": "2"})
    return json.loads(out.read_text())


def main() -> None:
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        model_dir = build_model(tmp / "model")
        results = {}
        print(f"{'variant':<10} {'peak MB':>8} {'tokens/s':>9} {'padding':>8} {'micro':>6}")
        for name, settings in VARIANTS.items():
            results[name] = r = run(model_dir, settings, [1024, 1024], 30, tmp)
            print(
                f"{name:<10} {r['peak_mb']:>8.0f} {r['tokens_per_s']:>9.0f} {r['padding_frac']:>8.2f} {r['micro_batches']:>6.1f}"
            )
        sweep = {}
        print(
            f"\n{'longest':>7} {'peak MB':>8} {'KB/token':>9} {'tokens/s':>9}  (recompute variant, budget = longest + 64)"
        )
        for longest in [1024, 2048, 4096] if quick else [1024, 2048, 4096, 8192, 16384]:
            settings = {**VARIANTS["recompute"], "max_tokens_per_micro_batch": longest + PROMPT}
            sweep[longest] = r = run(model_dir, settings, [longest], 15, tmp)
            r["kb_per_token"] = r["peak_mb"] * 1024 / (longest + PROMPT)
            print(f"{longest:>7} {r['peak_mb']:>8.0f} {r['kb_per_token']:>9.1f} {r['tokens_per_s']:>9.0f}")
        print(
            f"\n{'GRPO, G=8':<10} {'peak MB':>8} {'tokens/s':>9}  (64 rows, 8 prompts; responses 16-64 tokens)"
        )
        for name, settings in {"shared": {"micro_batch_size": 16}, "packed": VARIANTS["chunked"]}.items():
            r = run(model_dir, settings, [], 64, tmp, group=8)
            print(f"{name:<10} {r['peak_mb']:>8.0f} {r['tokens_per_s']:>9.0f}")
        per_token = [r["kb_per_token"] for r in sweep.values()]
        print(
            f"memory per token, longest / shortest row: {per_token[-1] / per_token[0]:.2f}x (goal: <= 1.2, flat or falling)"
        )
        head, base = results["chunked"], results["padded"]  # (d): no recompute, so no extra compute
        memory, speed = base["peak_mb"] / head["peak_mb"], head["tokens_per_s"] / base["tokens_per_s"]
        recompute = results["recompute"]
        print(
            f"with recompute: {base['peak_mb'] / recompute['peak_mb']:.1f}x less peak memory, "
            f"{recompute['tokens_per_s'] / base['tokens_per_s']:.2f}x tokens/s"
        )
        print(f"long_context: {memory:.1f}x less peak memory, {speed:.2f}x tokens/s vs padded")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, model_dir, settings, long_rows, short_rows, out, group = sys.argv
        worker(model_dir, json.loads(settings), json.loads(long_rows), int(short_rows), out, int(group))
    else:
        main()
