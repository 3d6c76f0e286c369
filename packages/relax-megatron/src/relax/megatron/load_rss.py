"""Peak host memory of one megatron rank while its trainer loads (``rank_load``): the megatron rows of
``bench/sharded_loading.py``, measured as core's ``relax.core.testing.sharded_rss`` measures an fsdp rank.

``python -m relax.megatron.load_rss MODEL RANK WORLD PORT MODE``, ``MODE`` ``megatron_tp`` or ``megatron_pp``
(TP or PP = WORLD); prints one JSON line: the load's peak bytes and how many of the rank's weights equal
its shard of the checkpoint.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def warm_megatron_imports() -> None:
    """Import what the trainer imports lazily on its way (megatron-core's parallel state, layers and GPT
    model, the layer specs), so the baseline holds it as core's ``warm_imports`` holds FSDP's: none of it
    grows with the model (~80 MB that the load would otherwise be charged with)."""
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.parallel_state  # noqa: F401
    import megatron.core.tensor_parallel  # noqa: F401
    import relax.megatron.cpu_compat  # noqa: F401
    import relax.megatron.gpt_model  # noqa: F401
    import relax.megatron.layer_specs  # noqa: F401


def rank_main(model_dir: str, rank: int, world: int, port: int, mode: str) -> dict[str, Any]:
    import torch

    from relax.core.testing.sharded_rss import resident_bytes, warm_imports
    from relax.megatron.trainer import MegatronTrainer

    torch.set_num_threads(1)
    warm_imports(model_dir)
    warm_megatron_imports()
    layout = {"tensor_parallel" if mode == "megatron_tp" else "pipeline_parallel": world}
    before = resident_bytes()
    t = MegatronTrainer(
        model_dir, rank=rank, world_size=world, master_addr="127.0.0.1", master_port=port, **layout
    )
    peak = resident_bytes("VmHWM") - before
    equal, compared = equal_to_checkpoint(t, model_dir)
    return {"rank": rank, "peak_bytes": peak, "equal": equal, "compared": compared}


def equal_to_checkpoint(t: Any, model_dir: str) -> tuple[int, int]:
    """(weights equal to, weights compared with) this rank's shard of the whole-checkpoint conversion
    (``convert``, the mapping's reference), every one of the rank's; after the peak is taken."""
    import torch

    from relax.megatron import convert

    hf = convert.read_hf_checkpoint(model_dir)
    want = convert.hf_to_megatron(hf, t.hf_config, t.tp, t.ep)[t.tp_rank * t.ep + t.ep_rank]
    want = convert.to_stage(want, t.hf_config, t.pp, t.pp_rank)
    have = convert.weights_only(t.model.state_dict())
    return sum(n in want and torch.equal(w, want[n]) for n, w in have.items()), len(have)


if __name__ == "__main__":
    model, rank, world, port, mode = sys.argv[1:6]
    print(json.dumps(rank_main(model, int(rank), int(world), int(port), mode)), flush=True)
