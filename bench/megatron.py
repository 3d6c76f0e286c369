"""Train throughput of the megatron trainer (TP=1, TP=2, DP=2) vs core's torch trainer on CPU.

Same locally built Qwen3-architecture model, same batch (``ROWS`` rows of ``PROMPT`` + ``RESPONSE``
tokens), same GRPO objective, one optimizer step per ``train_step``. Every process gets one thread,
so TP=2 and DP=2 use two cores where the others use one (this machine has two). The torch baseline runs in
this process; each megatron layout runs as its own ranks (``--worker``, gloo). Tokens/s counts the
batch's non-padding tokens over the timed steps (after ``WARMUP`` untimed ones).

With a CUDA device, also the MFU of the megatron trainer (TP=1, bf16 with fp32 master weights, the
Transformer Engine layer spec when ``transformer_engine`` imports, else the local one; one GPU) on a locally built,
randomly initialised Qwen3-0.6B-shaped model (config only, nothing downloaded): MFU = 6 * N * tokens/s /
peak, N = the model's parameters (tied embedding once; attention's own FLOPs not counted), peak = H200 /
H100 bf16 dense 989 TFLOP/s. The CPU layouts then run with CUDA_VISIBLE_DEVICES="" (megatron's CPU path).
Without a device MFU is skipped (printed); the headline stays the CPU ratio.

    python bench/megatron.py [steps]
    python bench/megatron.py --omni [steps]

``--omni``: the same comparison on the tiny Qwen2.5-VL (relax.omni.tiny_models; at TP=2
megatron pads its 71-row vocabulary to 72) with a batch of image and video prompts (``OMNI_ROWS`` rows, the
towers trained too): core's torch trainer vs the megatron trainer at TP=2 (two processes; towers replicated,
the LM sharded); headline ``megatron-omni: <x>x tokens/s vs torch trainer``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["OMP_NUM_THREADS"] = "1"
# this file is named megatron.py: keep its folder off the path, or it would shadow the megatron-core package
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

ROWS, PROMPT, RESPONSE = 32, 48, 48
WARMUP = 1
PEAK_FLOPS, PEAK_NAME = 989e12, "H200/H100 bf16 dense 989 TFLOP/s"
MFU_ROWS, MFU_PROMPT, MFU_RESPONSE = 16, 512, 512
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
}


def make_batch(model_dir: str, rows: int = ROWS, prompt: int = PROMPT, response: int = RESPONSE):
    import torch
    from transformers import AutoTokenizer

    from relax.core.data import Sample
    from relax.core.testing.trainer import make_batch as collate_with_advantages

    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(0)
    special = set(tok.all_special_ids)
    vocab = torch.tensor([t for t in range(len(tok)) if t not in special])

    def draw(n: int) -> list[int]:
        return vocab[torch.randint(len(vocab), (n,), generator=gen)].tolist()

    samples = [
        Sample(prompt_ids=draw(prompt), group_id=i // 4, response_ids=draw(response)) for i in range(rows)
    ]
    return collate_with_advantages(samples, tok.pad_token_id)


def timed_steps(trainer, batch, steps: int) -> float:
    """Tokens/s over ``steps`` train steps (after the warm-up); ``old_logprobs`` scored once, before."""
    batch = {**batch, "old_logprobs": trainer.forward_logprobs(batch)}
    for _ in range(WARMUP):
        trainer.train_step(batch)
    started = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(batch)
    return float(batch["attention_mask"].sum()) * steps / (time.perf_counter() - started)


def trainer_kwargs() -> dict:
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig

    return {"objective": build_policy_objective(AlgorithmConfig()), "lr": 1e-4, "micro_batch_size": ROWS}


def worker(
    rank: int, world: int, port: int, model_dir: str, batch_file: str, steps: int, out: str, kind: str
) -> None:
    """One rank at ``kind``_parallel = ``world`` (``tensor`` or ``data``)."""
    import torch

    from relax.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    trainer = MegatronTrainer(
        model_dir,
        **trainer_kwargs(),
        **{f"{kind}_parallel": world},
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
    )
    rate = timed_steps(trainer, torch.load(batch_file), steps)
    if rank == 0:
        Path(out).write_text(json.dumps({"tokens_per_s": rate}))


def mfu_worker(port: int, model_dir: str, batch_file: str, steps: int, out: str) -> None:
    """The megatron trainer on cuda:0 (NCCL world of one, bf16): train tokens/s."""
    import torch

    from relax.megatron.trainer import MegatronTrainer

    trainer = MegatronTrainer(
        model_dir,
        **{**trainer_kwargs(), "micro_batch_size": MFU_ROWS // 2},
        device="cuda",
        dtype="bfloat16",
        master_addr="127.0.0.1",
        master_port=port,
    )
    batch = torch.load(batch_file)
    torch.cuda.synchronize()
    rate = timed_steps(trainer, batch, steps)  # train_step returns floats: every step has synchronised
    Path(out).write_text(
        json.dumps(
            {
                "tokens_per_s": rate,
                "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
                "layer_spec": trainer.layer_spec,
            }
        )
    )


def mfu(root: Path, tokenizer_dir: str, steps: int) -> str:
    """The MFU report line (the device run in its own process, as a rank)."""
    import torch

    from relax.core.testing.models import build_qwen3_06b

    model_dir, params = build_qwen3_06b(root / "qwen3-0.6b", tokenizer_dir, device="cuda")
    batch_file = str(root / "mfu-batch.pt")
    torch.save(make_batch(model_dir, MFU_ROWS, MFU_PROMPT, MFU_RESPONSE), batch_file)
    out = root / "mfu.json"
    proc = subprocess.run(
        [
            sys.executable,
            __file__,
            "--mfu-worker",
            str(_free_port()),
            model_dir,
            batch_file,
            str(steps),
            str(out),
        ],
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"megatron MFU run failed (exit {proc.returncode})")
    result = json.loads(out.read_text())
    rate = result["tokens_per_s"]
    return (
        f"MFU (megatron TP=1 bf16, {result['layer_spec']} layer spec, {torch.cuda.get_device_name(0)}, "
        f"Qwen3-0.6B-shaped, N={params / 1e6:.0f}M, "
        f"{MFU_ROWS} x {MFU_PROMPT + MFU_RESPONSE} tokens/step): {rate:.0f} tokens/s, "
        f"{6 * params * rate / PEAK_FLOPS:.1%} of {PEAK_NAME} (peak memory {result['max_memory_gib']:.1f} GiB)"
    )


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def megatron_rate(
    size: int, model_dir: str, batch_file: str, steps: int, root: Path, kind: str = "tensor"
) -> float:
    port = _free_port()
    out = root / f"{kind}{size}.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # the CPU path, also on a host with a GPU
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(r),
                str(size),
                str(port),
                model_dir,
                batch_file,
                str(steps),
                str(out),
                kind,
            ],
            env=env,
        )
        for r in range(size)
    ]
    for p in procs:
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"megatron {kind}_parallel={size} rank failed (exit {p.returncode})")
    return json.loads(out.read_text())["tokens_per_s"]


OMNI_ROWS, OMNI_RESPONSE = 16, 16


def omni_inputs(root: Path) -> tuple[str, dict]:
    """(model_dir, batch): the tiny Qwen2.5-VL and ``OMNI_ROWS`` image / video rows."""
    import numpy as np
    import torch
    from PIL import Image

    from relax.core.data import Sample, collate
    from relax.core.testing.multimodal_processor import TinyMediaProcessor
    from relax.omni.tiny_models import tiny_multimodal_dir

    model_dir = tiny_multimodal_dir(root, "qwen2_5_vl")
    rng = np.random.default_rng(0)
    Image.fromarray((rng.random((60, 80, 3)) * 255).astype("uint8")).save(root / "img.png")
    np.save(root / "vid.npy", (rng.random((4, 56, 56, 3)) * 255).astype("uint8"))
    media = [
        {"type": "image", "image": str(root / "img.png")},
        {"type": "video", "video": f"file://{root / 'vid.npy'}"},
    ]
    processor = TinyMediaProcessor(str(model_dir))
    vocab = [
        t for t in range(len(processor.hf.tokenizer)) if t not in set(processor.hf.tokenizer.all_special_ids)
    ]
    samples = []
    for i in range(OMNI_ROWS):
        p = processor.process(
            [{"role": "user", "content": [media[i % 2], {"type": "text", "text": "what?"}]}], [], f"row {i}"
        )
        response = [vocab[j] for j in rng.integers(len(vocab), size=OMNI_RESPONSE)]
        samples.append(
            Sample(
                prompt_ids=list(p["prompt_ids"]),
                group_id=i // 4,
                response_ids=response,
                mm_inputs=p["inputs"],
            )
        )
    batch = collate(samples, pad_id=0)
    batch["advantages"] = (
        torch.where(torch.arange(OMNI_ROWS)[:, None] % 2 == 0, 1.0, -0.5) * batch["response_mask"]
    )
    return model_dir, batch


def main_omni(argv: list[str]) -> None:
    import torch

    from relax.core.trainers.torch_trainer import TorchTrainer

    steps = int(argv[0]) if argv else 5
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir, batch = omni_inputs(root)
        batch_file = str(root / "batch.pt")
        torch.save(batch, batch_file)
        base = timed_steps(TorchTrainer(model_dir, **trainer_kwargs()), batch, steps)
        tp2 = megatron_rate(2, model_dir, batch_file, steps, root)
    tokens = int(batch["attention_mask"].sum())
    print(
        f"tiny Qwen2.5-VL, {OMNI_ROWS} image/video rows, {tokens} tokens/step, {steps} timed steps, "
        "1 thread per process"
    )
    print(f"{'torch':<22} {base:>10.0f}\n{'megatron TP=2 (2 procs)':<22} {tp2:>10.0f}")
    print(f"megatron-omni: {tp2 / base:.2f}x tokens/s vs torch trainer")


def main(argv: list[str]) -> None:
    import torch

    from relax.core.quickstart_model import build_tiny_model
    from relax.core.trainers.torch_trainer import TorchTrainer

    steps = int(argv[0]) if argv else 5
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model_dir = build_tiny_model(root / "model", **MODEL)
        batch = make_batch(model_dir)
        batch_file = str(root / "batch.pt")
        torch.save(batch, batch_file)
        base = timed_steps(TorchTrainer(model_dir, **trainer_kwargs()), batch, steps)
        tp1 = megatron_rate(1, model_dir, batch_file, steps, root)
        tp2 = megatron_rate(2, model_dir, batch_file, steps, root)
        dp2 = megatron_rate(2, model_dir, batch_file, steps, root, kind="data")
        mfu_line = mfu(root, model_dir, steps) if torch.cuda.is_available() else "MFU: skipped (no device)"
    from relax.megatron import megatron_core_version

    print(f"megatron-core {megatron_core_version()}, torch {torch.__version__}")
    print(f"batch {ROWS} x {PROMPT + RESPONSE} tokens, {steps} timed steps, 1 thread per process")
    print(f"{'trainer':<22} {'tokens/s':>10} {'vs torch':>9}")
    for name, rate in [
        ("torch", base),
        ("megatron TP=1", tp1),
        ("megatron TP=2 (2 procs)", tp2),
        ("megatron DP=2 (2 procs)", dp2),
    ]:
        print(f"{name:<22} {rate:>10.0f} {rate / base:>8.2f}x")
    print(mfu_line)
    print(f"megatron: {tp1 / base:.2f}x train tokens/s TP=1 megatron vs torch trainer")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, p, m, b, s, o, k = sys.argv[2:10]
        worker(int(r), int(w), int(p), m, b, int(s), o, k)
    elif len(sys.argv) > 1 and sys.argv[1] == "--mfu-worker":
        p, m, b, s, o = sys.argv[2:7]
        mfu_worker(int(p), m, b, int(s), o)
    elif len(sys.argv) > 1 and sys.argv[1] == "--omni":
        main_omni(sys.argv[2:])
    else:
        main(sys.argv[1:])
