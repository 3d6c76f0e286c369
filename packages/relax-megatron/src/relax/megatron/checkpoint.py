"""Megatron ``dist_checkpointing`` checkpoints of a :class:`~relax.megatron.trainer.MegatronTrainer`.

One directory holds the model and AdamW state as sharded tensors (each TP rank writes its shard; a
checkpoint saved at TP=2 loads at TP=1 and back: megatron reshards on load), the step (common), every rank's
AdamW steps per parameter and RNG state (a media model's HF towers too, whole), plus ``hf/`` (config and tokenizer or
processor) so that ``relax convert`` can rebuild
the model without the run's model directory. The optimizer state is mapped onto the model's
sharding with megatron's own helpers (``dist_checkpointing.optimizer``), as ``MegatronOptimizer`` does;
a bf16 trainer's fp32 master weights are stored with their Adam moments (``precision.MASTER_KEY``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

HF_DIR = "hf"  # inside a checkpoint: the HF config and tokenizer
TOWERS = "towers"  # a media model's HF tower weights (media_front.py), next to megatron's own


def _ensure_adam_state(optimizer: torch.optim.Optimizer, stateless: frozenset[int] = frozenset()) -> None:
    """Zero AdamW state for every parameter (before the first step it has none), so that a load has
    tensors to fill; not for the ``stateless`` ones (ids: saved without state, never given a gradient)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in stateless and not optimizer.state.get(p):  # get: the state is a defaultdict
                optimizer.state[p] = {
                    "step": torch.zeros(()),
                    "exp_avg": torch.zeros_like(p),
                    "exp_avg_sq": torch.zeros_like(p),
                }


def layout(trainer: Any) -> list[int]:
    """[TP, PP, DP]: the RNG states are restored only into the layout that saved them."""
    return [trainer.tp, trainer.pp, trainer.dp]


def tower_tensors(trainer: Any) -> dict[str, Any]:
    """A media model's HF towers (first pipeline stage; replicated over TP and DP, one main replica) as
    whole-tensor ``ShardedTensor``s keyed ``towers.<HF name>``; {} for a text model or a later stage."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    front = getattr(trainer, "front", None)
    if front is None:
        return {}
    return {
        name: ShardedTensor.from_rank_offsets(
            f"{TOWERS}.{name}", param, replica_id=(0, trainer.tp_rank, trainer.dp_rank)
        )
        for name, param in front.tower_parameters()
    }


def _stateless_towers(trainer: Any, path: Path) -> frozenset[int]:
    """Tower parameters the checkpoint at ``path`` holds no Adam state for (ones no forward uses, such as
    Qwen2.5-Omni's ``audio_bos_eos_token``: AdamW never created state for them)."""
    from megatron.core import dist_checkpointing

    saved = set(dist_checkpointing.load_tensors_metadata(str(path)))
    return frozenset(
        id(p)
        for name, p in (trainer.front.tower_parameters() if getattr(trainer, "front", None) else ())
        if f"optimizer.state.exp_avg.{TOWERS}.{name}" not in saved
    )


def sharded_state(
    trainer: Any, loading: bool = False, stateless: frozenset[int] = frozenset()
) -> dict[str, Any]:
    """The trainer's state as a megatron sharded state dict (model, optimizer, step, RNG)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map,
        optim_state_to_sharding_state,
    )

    model = trainer.model.sharded_state_dict()
    towers = tower_tensors(trainer)
    if towers:  # in the model's dict, so that the optimizer state below is mapped onto them too
        model[TOWERS] = towers
    state: dict[str, Any] = {"model": model, "step": trainer.update.step, "layout": layout(trainer)}
    rng = {"torch": torch.get_rng_state()}  # one per rank: data-parallel replicas keep their own
    state["rng"] = ShardedObject(
        "rng_state",
        rng,
        (trainer.pp, trainer.tp, trainer.dp),
        (trainer.pp_rank, trainer.tp_rank, trainer.dp_rank),
        replica_id=0,
    )
    if getattr(trainer, "ddp", None) is not None:  # megatron's DistributedOptimizer (CUDA): its own sharding
        state["optimizer"] = trainer.optimizer.sharded_state_dict(model, is_loading=loading)
        state["adam_step"] = float(trainer.update.step)  # marks a trainable checkpoint (see load)
    elif trainer.optimizer is not None:
        from relax.megatron.precision import master_state

        if loading:
            _ensure_adam_state(trainer.optimizer, stateless)
        masters = getattr(trainer, "masters", None)
        optim = (
            trainer.optimizer.state_dict() if masters is None else master_state(trainer.optimizer, masters)
        )
        # per parameter: AdamW skips one without a gradient (a tower whose media a mini-batch lacks, an expert
        # no token reached), so steps differ; one object per rank, restored into the layout that saved them
        steps = {int(i): float(s["step"]) for i, s in optim["state"].items()}
        state["adam_steps"] = ShardedObject(
            "adam_steps",
            steps,
            (trainer.pp, trainer.tp, trainer.dp),
            (trainer.pp_rank, trainer.tp_rank, trainer.dp_rank),
            replica_id=0,
        )
        state["per_parameter_steps"] = True
        # the model parameters in the optimizer's order (bf16: those of its fp32 masters), for their sharding
        params = (
            [p for group in trainer.optimizer.param_groups for p in group["params"]]
            if masters is None
            else masters.params
        )
        optim_state_to_sharding_state(
            optim, get_param_id_to_sharded_param_map(model, params), exclude_keys=("step",)
        )
        state["optimizer"] = optim
        state["adam_step"] = max(
            steps.values(), default=0.0
        )  # marks a trainable checkpoint; the step elsewhere
    return state


def save(trainer: Any, directory: str) -> None:
    """Collective: every TP rank writes its shard into ``directory``; TP rank 0 adds ``hf/``."""
    from megatron.core import dist_checkpointing

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()  # the directory exists for every rank before megatron looks into it
    dist_checkpointing.save(sharded_state(trainer), str(out))
    if torch.distributed.get_rank() == 0:
        write_hf(
            str(out / HF_DIR),
            None,
            getattr(trainer, "media_config", None) or trainer.hf_config,
            trainer.model_path,
        )
    torch.distributed.barrier()


def load(trainer: Any, directory: str) -> None:
    """Restore what :func:`save` wrote, at this trainer's TP size (the RNG state only when the TP size
    is the one it was saved with: a resharded run has other ranks)."""
    from megatron.core import dist_checkpointing

    path = Path(directory)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"no megatron dist checkpoint at {path} (metadata.json missing)")
    common = dist_checkpointing.load_common_state_dict(str(path))
    state = sharded_state(trainer, loading=True, stateless=_stateless_towers(trainer, path))
    if list(common.get("layout", ())) != layout(trainer):
        state.pop("rng")
    if list(common.get("layout", ())) != layout(trainer) or not common.get("per_parameter_steps"):
        state.pop("adam_steps", None)  # other ranks (or none saved): the latest step for every parameter
    if trainer.optimizer is not None and "adam_step" not in common:
        raise ValueError(f"checkpoint {path} has no optimizer state (saved by a frozen trainer)")
    loaded = dist_checkpointing.load(state, str(path))
    towers = loaded["model"].pop(TOWERS, {})
    load_model(trainer.model, loaded["model"], path)
    if towers:
        with torch.no_grad():
            for name, param in trainer.front.tower_parameters():
                param.copy_(towers[name])
    if getattr(trainer, "ddp", None) is not None:
        trainer.optimizer.load_state_dict(loaded["optimizer"])
    elif trainer.optimizer is not None:
        from relax.megatron.precision import restore_masters

        optim, steps = loaded["optimizer"], loaded.get("adam_steps", {})
        for i, param_state in optim["state"].items():
            param_state["step"] = torch.tensor(steps.get(int(i), float(loaded["adam_step"])))
        if getattr(trainer, "masters", None) is not None:
            optim = restore_masters(optim, trainer.masters)
        trainer.optimizer.load_state_dict(optim)
    trainer.update.step = int(loaded["step"])
    if "rng" in loaded:
        torch.set_rng_state(loaded["rng"]["torch"])


def load_model(model: Any, state: dict[str, Any], path: Path) -> None:
    from relax.megatron.convert import EXTRA_STATE

    result = model.load_state_dict(state, strict=False)
    missing = [n for n in result.missing_keys if not n.endswith(EXTRA_STATE)]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"checkpoint {path} does not fit this model: missing {missing}, "
            f"unexpected {result.unexpected_keys}"
        )


def to_hf(checkpoint: str, hf_dir: str) -> list[str]:
    """``relax convert``: the model of a megatron checkpoint as an HF directory (config, tokenizer,
    safetensors; a media model's processor and towers too, under the checkpoint's own HF names), rebuilt in
    this process at TP=1 (gloo world of one). Returns the tensor names."""
    from transformers import AutoConfig

    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from relax.megatron import convert, gpt_model, media_front
    from relax.megatron.parallel import ensure_process_group, initialize_model_parallel

    src = Path(checkpoint)
    if not (src / "metadata.json").is_file() or not (src / HF_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"{src} is not a relax-megatron checkpoint (needs metadata.json and {HF_DIR}/config.json)"
        )
    ensure_process_group(0, 1)
    initialize_model_parallel(1, 1)
    config = AutoConfig.from_pretrained(src / HF_DIR)
    media = media_front.is_media_model(config)
    lm = media_front.lm_config(config) if media else config
    saved = dist_checkpointing.load_tensors_metadata(str(src))
    # the vocabulary rows as saved: padded to a multiple of the saving run's TP (the padding is dropped below)
    embedding = saved.get("embedding.word_embeddings.weight")
    rows = embedding.global_shape[0] if embedding is not None else None
    model = gpt_model.build_gpt_model(
        lm, vocab_rows=rows
    )  # the local spec: a TE run's checkpoint converts on CPU too
    state = {"model": local_keys_of(model, src, lm)}
    if media:  # the towers: whole tensors keyed ``towers.<HF name>`` (tower_tensors)
        state["model"][TOWERS] = {
            key[len(TOWERS) + 1 :]: ShardedTensor.from_rank_offsets(
                key, torch.empty(meta.global_shape, dtype=meta.dtype)
            )
            for key, meta in saved.items()
            if key.startswith(TOWERS + ".")
        }
    loaded = dist_checkpointing.load(state, str(src))
    towers = loaded["model"].pop(TOWERS, {})
    load_model(model, loaded["model"], src)
    hf = convert.megatron_to_hf([convert.weights_only(model.state_dict())], lm)
    if media:
        prefix = media_front.hooks(config).lm_prefix
        hf = {media_front.hf_name(n, prefix): t for n, t in hf.items()} | towers
    write_hf(hf_dir, hf, config, str(src / HF_DIR))
    return sorted(hf)


def local_keys_of(model: Any, src: Path, hf_config: Any) -> dict[str, Any]:
    """``model``'s (local spec) sharded state dict, keyed as the checkpoint at ``src`` names its tensors:
    a checkpoint written by the Transformer Engine spec keys the fused norms by their TE names."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from relax.megatron.convert import Dims
    from relax.megatron.layer_specs import te_name, uses_te_names

    sharded = model.sharded_state_dict()
    if uses_te_names(dist_checkpointing.load_tensors_metadata(str(src))):
        moe = bool(Dims.from_hf(hf_config).experts)
        for item in nested_values(sharded):
            if hasattr(item, "key"):
                item.key = te_name(item.key, moe)
    return sharded


def write_hf(
    directory: str, tensors: dict[str, torch.Tensor] | None, hf_config: Any, tokenizer_path: str
) -> None:
    """An HF directory plain transformers loads: config, tokenizer (a media model's processor too; from
    ``tokenizer_path``) and, unless ``tensors`` is None, the weights as safetensors."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from relax.megatron.media_front import is_media_model

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    hf_config.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_path).save_pretrained(out)
    if is_media_model(hf_config):  # its processor, for an engine (or relax convert) that loads the directory
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(tokenizer_path).save_pretrained(out)
    if tensors is not None:
        save_file(
            {n: t.contiguous() for n, t in tensors.items()},
            out / "model.safetensors",
            metadata={"format": "pt"},
        )
