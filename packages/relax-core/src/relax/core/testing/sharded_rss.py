"""Peak host memory of one fsdp rank while it loads a model: the measure behind issue 39's "no full copy
per rank" (``tests/trainers/fsdp/test_sharded_loading.py``, ``bench/sharded_loading.py``).

Each rank is a fresh process (``python -m relax.core.testing.sharded_rss MODEL RANK WORLD PORT MODE``), so
its peak resident set (``VmHWM``) is the load's: what it holds before the load (interpreter, torch,
transformers, the model's code, imported first) is read from ``/proc/self/status`` and subtracted. ``MODE``
``sharded`` is the trainer as shipped; ``full`` loads the whole model first (the trainer before issue 39 and
its fallback). It prints one JSON line: the load's peak bytes and, on rank 0, how many exported weights
equal the checkpoint's (every weight is gathered and compared, after the peak is taken).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def model_bytes(model_dir: str) -> int:
    """Bytes of a full fp32 copy of the model's weights (what the trainer keeps: fp32 masters)."""
    from relax.core.trainers.fsdp.params import model_parameters

    return 4 * model_parameters(model_dir)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (``VmRSS``) or at its peak (``VmHWM``). Not ``ru_maxrss``: Linux
    carries that over ``exec``, so a rank started from a big parent would report the parent's size."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def warm_imports(model_dir: str) -> None:
    """Load what a trainer loads on the way (the model's modeling code, its tokenizer, FSDP, the plugins),
    so the baseline holds it: none of it grows with the model."""
    import torch
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from relax.core.plugins import get_plugin_manager
    from relax.core.trainers.fsdp import trainer  # noqa: F401

    get_plugin_manager()  # every installed plugin's modules (model adapters among them)
    AutoTokenizer.from_pretrained(model_dir)
    with torch.device("meta"):
        AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def rank_main(model_dir: str, rank: int, world: int, port: int, mode: str) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    warm_imports(model_dir)
    from relax.core.trainers.fsdp import trainer as fsdp
    from relax.core.trainers.fsdp.params import FSDPParams

    if mode == "full":
        fsdp.empty_sharded = lambda model_path: (None, None)  # the whole-model load: every rank reads it all
    before = resident_bytes()
    t = fsdp.FSDPTrainer(
        model_dir,
        params=FSDPParams(world_size=world),
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
    )
    peak = resident_bytes("VmHWM") - before
    equal = compared = 0
    checkpoint = None
    if rank == 0:
        from relax.core.safetensors_files import Checkpoint

        checkpoint = Checkpoint(model_dir)
    for bucket in t.export_weights(bucket_bytes=1):  # rank 0 gets each full weight, one at a time
        for name, tensor in bucket:
            compared += 1
            equal += int(torch.equal(tensor, checkpoint.read(name).to(tensor.dtype)))
    t.close()
    return {"rank": rank, "peak_bytes": peak, "equal": equal, "compared": compared}


def run_world(
    model_dir: str, world: int, mode: str, port: int, timeout: float = 600, module: str = __name__
) -> list[dict[str, Any]]:
    """Every rank of one load in its own fresh process (``python -m module``: this one, or a backend's own, as
    ``relax.megatron.load_rss``); their reports, in rank order."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", module, model_dir, str(r), str(world), str(port), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    reports = []
    for r, p in enumerate(procs):
        out, err = p.communicate(timeout=timeout)
        if p.returncode:
            raise RuntimeError(f"rank {r} ({mode}) failed with exit code {p.returncode}:\n{err[-3000:]}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def write_model(
    directory: str, *, hidden: int = 1024, layers: int = 12, vocab: int = 32768, seed: int = 0
) -> str:
    """A Qwen3-shaped causal LM of ~220 M parameters (defaults; untied head) with random weights, built
    from a config and saved once in fp32, with the quick-start tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    from relax.core.quickstart_model import build_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(
        build_tiny_model(Path(directory) / "tokenizer_source", seed=seed)
    )
    config = Qwen3Config(
        vocab_size=max(vocab, len(tokenizer)),
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=hidden // 16,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # quicker than the model's own init, and as good for a load test
            p.normal_(0.0, 0.02, generator=generator)
    out = Path(directory) / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def session_model(base: Path) -> str:
    """:func:`write_model`'s default model under ``base`` (a pytest session's base temp), written by the
    first caller only: core's fsdp and relax-megatron's loading tests share it."""
    out = Path(base) / "sharded-loading"
    if not (out / "model" / "tokenizer_config.json").exists():  # written last
        write_model(str(out))
    return str(out / "model")


if __name__ == "__main__":
    model, rank, world, port, mode = sys.argv[1:6]
    print(json.dumps(rank_main(model, int(rank), int(world), int(port), mode)), flush=True)
