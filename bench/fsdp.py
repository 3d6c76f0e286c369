"""Per-rank memory and train throughput of the fsdp trainer at N = 2 vs the replicated torch trainer at N = 2.

Same locally built Qwen3-architecture model (config only, nothing downloaded), same batch, same GRPO
objective, one optimizer step per ``train_step``; each layout runs as two rank processes over gloo (one
thread each: this machine has two cores). Per rank: the training state held (parameters + gradients +
AdamW state, measured from the tensors' storage after a step), the peak resident memory the step added
(``ru_maxrss`` after the steps minus before the model loaded) and, on CUDA, ``max_memory_allocated``.
Tokens/s counts the batch's non-padding tokens over the timed steps (after one untimed step).

    python bench/fsdp.py [steps]
"""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
ROWS, PROMPT, RESPONSE = 16, 32, 32
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}
KW = {"lr": 1e-5, "micro_batch_size": 8, "num_minibatches": 1}


def make_batch(model_dir: str):
    import torch
    from transformers import AutoTokenizer

    from relax.core.data import Sample
    from relax.core.testing.trainer import make_batch as collate_with_advantages

    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    vocab = torch.tensor([t for t in range(len(tok)) if t not in set(tok.all_special_ids)])

    def draw(n: int) -> list[int]:
        return vocab[torch.randint(len(vocab), (n,), generator=gen)].tolist()

    samples = [
        Sample(prompt_ids=draw(PROMPT), group_id=i // 4, response_ids=draw(RESPONSE)) for i in range(ROWS)
    ]
    return collate_with_advantages(samples, tok.pad_token_id)


def build(layout: str, model_dir: str, rank: int, port: int):
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig

    objective = build_policy_objective(AlgorithmConfig())
    if layout == "fsdp":
        from relax.core.trainers.fsdp.trainer import FSDPTrainer

        return FSDPTrainer(
            model_dir,
            objective=objective,
            rank=rank,
            world_size=2,
            master_addr="127.0.0.1",
            master_port=port,
            **KW,
        )
    from relax.core.trainers.data_parallel import DataParallel
    from relax.core.trainers.torch_trainer import TorchTrainer

    return TorchTrainer(
        model_dir, objective=objective, data_parallel=DataParallel(rank, 2, "127.0.0.1", port), **KW
    )


def state_bytes(trainer) -> int:
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    params = list(trainer.model.parameters())
    tensors = [local(p) for p in params] + [local(p.grad) for p in params if p.grad is not None]
    tensors += [
        local(v)
        for s in trainer.optimizer.state.values()
        for v in s.values()
        if hasattr(v, "dim") and v.dim()
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def worker(layout: str, model_dir: str, rank: int, port: int, steps: int, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = build(layout, model_dir, rank, port)
    batch = make_batch(model_dir)
    tokens = float(batch["attention_mask"].sum())
    trainer.train_step(dict(batch))  # warm-up (allocates gradients and optimizer state)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(dict(batch))
    elapsed = time.perf_counter() - start
    result = {
        "state_bytes": state_bytes(trainer),
        "tokens_per_s": tokens * steps / elapsed,
        "rss_added": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before,
        "cuda_peak": torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None,
    }
    Path(out).write_text(json.dumps(result))
    close = getattr(trainer, "close", None) or getattr(trainer.dp, "close", None)
    if close:
        close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(layout: str, model_dir: str, steps: int, tmp: Path) -> list[dict]:
    port, outs = free_port(), [tmp / f"{layout}-{r}.json" for r in range(2)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                layout,
                model_dir,
                str(r),
                str(port),
                str(steps),
                str(outs[r]),
            ]
        )
        for r in range(2)
    ]
    for p in procs:
        if p.wait(timeout=900):
            raise RuntimeError(f"{layout} rank exited with {p.returncode}")
    return [json.loads(o.read_text()) for o in outs]


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    from relax.core.quickstart_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "model", **MODEL)
        results = {
            layout: run_layout(layout, model_dir, steps, Path(tmp)) for layout in ("replicated", "fsdp")
        }
    print(f"{'layout (N=2)':<14} {'state MiB/rank':>15} {'RSS added MiB/rank':>19} {'tokens/s':>9}")
    for layout, ranks in results.items():
        state = max(r["state_bytes"] for r in ranks) / 2**20
        rss = max(r["rss_added"] for r in ranks) / 2**20
        print(f"{layout:<14} {state:>15.1f} {rss:>19.1f} {ranks[0]['tokens_per_s']:>9.0f}")
    rep, fsdp = results["replicated"], results["fsdp"]
    if rep[0]["cuda_peak"] is not None:
        print(
            f"CUDA peak per rank: fsdp {max(r['cuda_peak'] for r in fsdp) / 2**20:.1f} MiB, "
            f"replicated {max(r['cuda_peak'] for r in rep) / 2**20:.1f} MiB"
        )
    speed = fsdp[0]["tokens_per_s"] / rep[0]["tokens_per_s"]
    print(f"train tokens/s: fsdp {speed:.2f}x replicated")
    ratio = max(r["state_bytes"] for r in fsdp) / max(r["state_bytes"] for r in rep)
    print(f"fsdp: {ratio:.2f}x memory per rank vs replicated")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        layout, model_dir, rank, port, steps, out = sys.argv[2:8]
        worker(layout, model_dir, int(rank), int(port), int(steps), out)
    else:
        main()
