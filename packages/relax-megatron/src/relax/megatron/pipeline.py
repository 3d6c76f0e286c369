"""Pipeline parallelism for :class:`~relax.megatron.trainer.MegatronTrainer`: megatron's 1F1B schedule
over the micro-batches, and moving what only the last stage has (scores, metrics) or only one stage has
(its layers, for an export) to the other stages of the pipeline group.

Every stage receives the whole batch (core's worker group calls each rank with it); the first stage
embeds the tokens, the last computes the scores and the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

Tensor = torch.Tensor


def run_schedule(
    model: Any,
    micros: Sequence[dict[str, Tensor]],
    forward: Callable[[Any, dict[str, Tensor]], Tensor],
    finish: Callable[[dict[str, Tensor], Tensor], tuple[Tensor, Any]],
    forward_only: bool,
    seq_multiple: int = 1,
) -> list[Any]:
    """1F1B over ``micros``: ``forward(model, sub)`` runs this stage; on the last stage
    ``finish(sub, logits)`` returns (loss to back-propagate, a record). Returns the records in order on
    the last stage, ``[]`` elsewhere. The loss is not rescaled (``calculate_per_token_loss``): core's
    objective already divides by step-global token counts. The schedule sends fixed-shape activations,
    so a shorter last micro-batch gets a schedule of its own (gradients accumulate across the two).
    ``seq_multiple``: the stages pad the sequence to a multiple of it (sequence parallelism: TP), and megatron
    sizes what it sends by the padded length (split over the TP ranks)."""
    records: list[Any] = []
    start = 0
    while start < len(micros):
        end = start + 1
        while end < len(micros) and micros[end]["input_ids"].shape == micros[start]["input_ids"].shape:
            end += 1
        records += _schedule(model, micros[start:end], forward, finish, forward_only, seq_multiple)
        start = end
    return records


def _schedule(model, micros, forward, finish, forward_only, seq_multiple) -> list[Any]:
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

    data = iter(micros)

    def step(data_iterator: Iterator, model: Any):
        sub = next(data_iterator)

        def loss_func(logits: Tensor):
            loss, record = finish(sub, logits)
            return loss, torch.tensor(0, dtype=torch.int, device=logits.device), record

        return forward(model, sub), loss_func

    return forward_backward_pipelining_without_interleaving(
        forward_step_func=step,
        data_iterator=data,
        model=[model],
        num_microbatches=len(micros),
        seq_length=-(-micros[0]["input_ids"].shape[1] // seq_multiple) * seq_multiple,
        micro_batch_size=micros[0]["input_ids"].shape[0],
        forward_only=forward_only,
    )


def pipeline_ranks() -> tuple[Any, list[int]]:
    """This rank's pipeline group and its global ranks in stage order."""
    from megatron.core import parallel_state

    group = parallel_state.get_pipeline_model_parallel_group()
    return group, dist.get_process_group_ranks(group)


def from_last_stage(tensors: list[Tensor], obj: Any = None) -> tuple[list[Tensor], Any]:
    """The last stage's ``tensors`` (same shapes on every stage) and picklable ``obj``, on every stage."""
    group, ranks = pipeline_ranks()
    for t in tensors:
        dist.broadcast(t, src=ranks[-1], group=group)
    box = [obj]
    dist.broadcast_object_list(box, src=ranks[-1], group=group)
    return tensors, box[0]


def global_layer_names(local: dict[str, Tensor], offset: int, drop: Sequence[str] = ()) -> dict[str, Tensor]:
    """A stage's weights under whole-model names: ``decoder.layers.i`` -> ``i + offset``; ``drop``
    (e.g. the last stage's copy of a tied embedding) left out."""
    out: dict[str, Tensor] = {}
    for name, t in local.items():
        if name in drop:
            continue
        if name.startswith("decoder.layers."):
            _, _, i, rest = name.split(".", 3)
            name = f"decoder.layers.{int(i) + offset}.{rest}"
        out[name] = t
    return out


def stage_units(units: list[list[str]], local: dict[str, Tensor]) -> Iterator[dict[str, Tensor]]:
    """Every stage's export units in stage order, on every stage of the pipeline group (collective):
    each stage in turn announces its units' names and shapes, then broadcasts one unit at a time."""
    group, ranks = pipeline_ranks()
    me = dist.get_rank()
    device = next(iter(local.values())).device if local else torch.device("cpu")  # NCCL: receive on the GPU
    for src in ranks:
        box = [
            [[(n, tuple(local[n].shape), local[n].dtype) for n in unit] for unit in units]
            if src == me
            else None
        ]
        dist.broadcast_object_list(box, src=src, group=group)
        for unit in box[0]:
            tensors = {
                n: local[n].detach().contiguous() if src == me else torch.empty(s, dtype=dt, device=device)
                for n, s, dt in unit
            }
            for t in tensors.values():
                dist.broadcast(t, src=src, group=group)
            yield tensors
