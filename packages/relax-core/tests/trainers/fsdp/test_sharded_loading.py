"""No full copy of the model per fsdp rank (issue 39): each rank of a world-2 trainer reads only its shards'
rows of a ~220 M-parameter checkpoint, so its peak host memory while loading stays under 0.6x a full fp32
copy, and the weights it ends with are the checkpoint's; ``save_hf`` streams (one gathered weight at a
time) and writes what ``save_pretrained`` of the fully loaded model writes. The safetensors reader and
writer agree with the safetensors library."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import ray
import torch

from relax.core.quickstart_model import build_tiny_model

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # build runs in the rank actors


@pytest.fixture(scope="session")
def big_model(tmp_path_factory) -> str:
    """~220 M parameters (Qwen3-shaped, untied head, 870 MB in fp32), written once per session."""
    from relax.core.testing.sharded_rss import session_model

    return session_model(tmp_path_factory.getbasetemp())  # relax-megatron's test_rank_load.py shares it


def test_each_rank_peaks_under_0_6_of_a_full_copy_and_holds_the_checkpoint_weights(big_model):
    from relax.core.testing.sharded_rss import free_port, model_bytes, run_world

    full = model_bytes(big_model)
    assert full > 800e6  # large enough that the interpreter's own growth is small next to it
    reports = run_world(big_model, 2, "sharded", free_port())
    for r in reports:
        assert r["peak_bytes"] <= 0.6 * full, (
            f"rank {r['rank']} peaked at {r['peak_bytes'] / full:.2f}x a full copy"
        )
    assert reports[0]["compared"] == 3 + 11 * 12  # every weight: embedding, norm, head and 12 layers' 11
    assert reports[0]["equal"] == reports[0]["compared"]


# ------------------------------------------------------------------ save_hf
def build(model_dir: str, rank: int, world: int, port: int):
    from relax.core.trainers.fsdp.params import FSDPParams
    from relax.core.trainers.fsdp.trainer import FSDPTrainer

    return FSDPTrainer(
        model_dir,
        params=FSDPParams(world_size=world),
        rank=rank,
        world_size=world,
        master_addr="127.0.0.1",
        master_port=port,
    )


def save_hf_in_shards(trainer, directory: str, max_bytes: int) -> None:
    from relax.core.trainers.fsdp import state

    state.save_hf(
        directory,
        trainer.model,
        trainer.tokenizer,
        trainer.compute_dtype,
        trainer.rank,
        trainer._comm_device(),
        max_shard_bytes=max_bytes,
    )


def moe_model(root: Path) -> str:
    """A tiny Qwen3-MoE (4 experts): transformers keeps its experts fused, its checkpoint names each one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3MoeConfig

    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model(root / "text", seed=5))
    torch.manual_seed(5)
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        decoder_sparse_step=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "moe")
    tokenizer.save_pretrained(root / "moe")
    return str(root / "moe")


def tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_save_hf_streams_what_save_pretrained_writes(world2, tmp_path, family):
    from transformers import AutoTokenizer

    from relax.core.multimodal_model import load_model

    model_dir = build_tiny_model(tmp_path / "text", seed=3) if family == "dense" else moe_model(tmp_path)
    world2.build(build, model_dir)
    world2.call("save_hf", str(tmp_path / "saved"))
    reference = load_model(model_dir, "float32")
    reference.save_pretrained(tmp_path / "reference")
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(tmp_path / "reference")
    saved, want = tmp_path / "saved", tmp_path / "reference"
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in want.iterdir())
    for name in ("config.json", "generation_config.json"):
        assert json.loads((saved / name).read_text()) == json.loads((want / name).read_text()), name
    got, expected = tensors(saved), tensors(want)
    assert sorted(got) == sorted(expected)  # MoE: one tensor per expert, as on disk
    for name, t in expected.items():
        assert torch.equal(got[name], t), name

    # several shards: the index save_pretrained writes, and transformers loads them
    world2.apply(save_hf_in_shards, str(tmp_path / "shards"), 40_000)
    index = json.loads((tmp_path / "shards" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and sorted(index["weight_map"]) == sorted(expected)
    loaded = type(reference).from_pretrained(tmp_path / "shards").state_dict()
    for name, t in reference.state_dict().items():
        assert torch.equal(loaded[name], t), name


# ------------------------------------------------------------------ the safetensors files
def test_reader_and_writer_agree_with_the_safetensors_library(tmp_path):
    from safetensors.torch import save_file

    from relax.core.safetensors_files import Checkpoint, write_streamed

    g = torch.Generator().manual_seed(0)
    named = {
        "a": torch.randn(7, 5, generator=g),
        "b": torch.randn(3, generator=g).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.tensor(2.5),
    }
    save_file(named, tmp_path / "lib.safetensors")
    read = Checkpoint(tmp_path)
    for name, t in named.items():
        assert read.shape(name) == tuple(t.shape) and torch.equal(read.read(name), t), name
    assert torch.equal(read.read("a", (2, 5)), named["a"][2:5])  # a run of rows: only those bytes are read
    files = write_streamed(tmp_path / "ours", named.items(), max_bytes=100)
    assert len(files) > 1 and (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    got = tensors(tmp_path / "ours")
    assert sorted(got) == sorted(named) and all(torch.equal(got[n], t) for n, t in named.items())
