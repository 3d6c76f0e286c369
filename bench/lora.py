"""Weight-sync time and bytes per step, LoRA vs full weights, same model, trainer actor -> HF engine actor.

A tiny Qwen3 built from a config (default ~25M parameters: hidden 512, 8 layers; nothing downloaded)
is trained by the torch trainer in one Ray actor, twice: full weights, and ``trainer.lora`` (rank 16
on every decoder linear layer). After each train step its weights go to a real HF rollout engine in
another actor through a registered transport (default ``object_store``; the bytes never pass through
the driver); for LoRA the engine merges ``W0 + B @ A`` into its weights, which is part of the time.
Reported per step: the transport's seconds (median over ``--steps``, after a cold first sync) and bytes.
The headline (last line) is full sync time over LoRA sync time. On a CPU the merge (about 2 * rank
flops per adapted weight) is what LoRA's sync time is made of; on a GPU it is sub-millisecond.

    python bench/lora.py [--hidden 512] [--layers 8] [--rank 16] [--steps 5] [--transport object_store]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

for _key, _value in {
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)

import ray  # noqa: E402
import torch  # noqa: E402

from relax.core.config import LoraConfig  # noqa: E402
from relax.core.context import PluginContext  # noqa: E402
from relax.core.controller.ray_start import start_loopback_ray  # noqa: E402
from relax.core.data import Sample, collate  # noqa: E402
from relax.core.engines.hf import HFRolloutEngine  # noqa: E402
from relax.core.plugins import get_plugin_manager  # noqa: E402
from relax.core.quickstart_model import build_tiny_model  # noqa: E402
from relax.core.trainers.torch_trainer import TorchTrainer  # noqa: E402
from relax.core.weight_sync import serve_receiver, serve_sender  # noqa: E402


def objective(inputs):
    loss = -(inputs.logprobs * inputs.advantages * inputs.response_mask).sum() / inputs.global_token_count
    return loss, {}


def batch(rows: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(4, 24, (6,), generator=gen).tolist(),
            group_id=i,
            response_ids=torch.randint(4, 24, (4,), generator=gen).tolist(),
        )
        for i in range(rows)
    ]
    out = collate(samples, pad_id=0)
    out["advantages"] = torch.randn(out["response_mask"].shape, generator=gen)
    return out


@ray.remote(num_cpus=0)
class TrainerHost:
    def __init__(self, model_dir: str, lora: LoraConfig | None, device: str, threads: int):
        torch.set_num_threads(threads)
        self.trainer = TorchTrainer(
            model_dir, objective=objective, lr=1e-3, micro_batch_size=8, lora=lora, device=device
        )
        self.data = batch()

    def train_step(self) -> None:
        self.trainer.train_step(self.data)

    def weight_sender(self, spec, method, *args):
        yield from serve_sender(self, self.trainer, spec, method, *args)


@ray.remote(num_cpus=0, max_concurrency=4)
class EngineHost:
    def __init__(self, model_dir: str, device: str, threads: int):
        torch.set_num_threads(threads)
        self.engine = HFRolloutEngine(model_dir, device=device)

    def weight_receiver(self, spec, method, *args):
        return serve_receiver(self, self.engine, spec, method, *args)

    def version_and_params(self) -> tuple[int, int]:
        return self.engine.weight_version(), sum(p.numel() for p in self.engine.model.parameters())


def bench(model_dir: str, lora: LoraConfig | None, args: argparse.Namespace) -> dict[str, float]:
    trainer = TrainerHost.remote(model_dir, lora, args.device, args.threads)
    engine = EngineHost.remote(model_dir, args.device, args.threads)
    factory = get_plugin_manager().get("weight_sync", args.transport)
    ctx = PluginContext(role="weight_sync", timeout_s=300, bucket_bytes=args.bucket_mb << 20)
    sync = factory(factory.config(), ctx)
    seconds, sent = [], []
    for version in range(1, args.steps + 2):
        ray.get(trainer.train_step.remote())
        stats = sync.sync(trainer, [engine], version)
        if version > 1:  # the first sync is cold (buffers; LoRA: the pristine copies of the adapted weights)
            seconds.append(stats["seconds"])
            sent.append(stats["bytes"])
    served, params = ray.get(engine.version_and_params.remote())
    assert served == args.steps + 1, served
    sync.close()
    for actor in (trainer, engine):
        ray.kill(actor)
    return {"seconds": statistics.median(seconds), "bytes": statistics.median(sent), "params": params}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--transport", default="object_store")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="torch threads per actor"
    )
    args = parser.parse_args()
    start_loopback_ray(num_cpus=2)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(
            tmp,
            hidden_size=args.hidden,
            intermediate_size=3 * args.hidden,
            num_hidden_layers=args.layers,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=args.hidden // 8,
        )
        full = bench(model_dir, None, args)
        lora = bench(model_dir, LoraConfig(rank=args.rank, alpha=2.0 * args.rank), args)
    ray.shutdown()
    print(
        f"model: {full['params'] / 1e6:.1f}M parameters, {args.layers} layers, hidden {args.hidden}; "
        f"transport {args.transport}, {args.device}, {args.threads} torch threads per actor; median of {args.steps} steps"
    )
    for name, r in (("full", full), (f"lora r={args.rank}", lora)):
        print(f"{name:>10}: {r['seconds'] * 1e3:8.1f} ms/sync  {r['bytes'] / 2**20:8.2f} MiB/sync")
    print(f"bytes: {full['bytes'] / lora['bytes']:.1f}x fewer with LoRA")
    print(f"lora: {full['seconds'] / lora['seconds']:.1f}x less sync time than full weights")


if __name__ == "__main__":
    main()
