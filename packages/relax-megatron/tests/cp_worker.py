"""One rank of the CPU context-parallel check (gloo, world 2 = CP 2), run as a script by ``test_context_parallel.py``.

The ranks join megatron's parallel state at context_parallel 2 (``build.join_world``) and record their groups.
Then a per-token stand-in for the model (embedding -> linear head: no attention, which under CP exists only in
Transformer Engine, a GPU library) runs through the trainer's own ``MegatronForward._stage_forward`` and
``_scores`` at CP 2, with full logits and with chunked scores from hidden states: every rank gets the whole
(B, R) logprobs and entropy, a loss on them back-propagates into its own tokens only, and the gradients summed
over the DP x CP group are the whole batch's. Rank 0 also computes the same at CP 1 (the plain path, alone)
and saves {"groups", "cp", "reference"} to ``--out``.
"""

from __future__ import annotations

import argparse
import os
from types import SimpleNamespace

os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402 - after OMP_NUM_THREADS

VOCAB, HIDDEN = 13, 8


def main() -> None:
    ap = argparse.ArgumentParser()
    for name in ("--rank", "--world", "--port"):
        ap.add_argument(name, type=int, required=True)
    for name in ("--model-dir", "--input", "--out", "--mode"):
        ap.add_argument(name, required=True)
    args = ap.parse_args()

    import torch.distributed as dist

    from relax.megatron.build import join_world

    ranks = join_world(
        args.rank, args.world, "127.0.0.1", args.port, (1, 1, 1, 1), 0, torch.device("cpu"), 120, 2
    )
    groups = {
        "cp": (ranks.cp, ranks.cp_rank, dist.get_process_group_ranks(ranks.cp_group)),
        "dp": (ranks.dp, dist.get_process_group_ranks(ranks.dp_group)),
        "dp_cp": dist.get_process_group_ranks(ranks.dp_cp_group),
    }
    data = torch.load(args.input)
    results = {name: run(batch, ranks, cp=2) for name, batch in data.items()}
    if args.rank == 0:
        alone = SimpleNamespace(cp=1, cp_rank=0, cp_group=None, dp_cp_group=None)
        reference = {name: run(batch, alone, cp=1) for name, batch in data.items()}
        torch.save({"groups": groups, "cp": results, "reference": reference}, args.out)
    dist.barrier()
    dist.destroy_process_group()


class PerToken(torch.nn.Module):
    """Embedding then a linear head, per token; with ``hidden_out`` it returns the hidden states (the chunked
    scores' input). It also records the position ids it was given (this rank's chunks' columns)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
        self.hidden_out, self.positions = False, []

    def forward(self, input_ids, position_ids, attention_mask=None):
        assert attention_mask is None
        self.positions.append(position_ids)
        hidden = self.embed(input_ids)
        return hidden if self.hidden_out else self.head(hidden)


def run(batch: dict, ranks, cp: int) -> dict:
    """Logprobs, entropy, the gradients (summed over DP x CP) and the position ids seen, full logits and chunked."""
    from relax.megatron.context_parallel import sequence_multiple
    from relax.megatron.forward import MegatronForward
    from relax.megatron.parallel import all_reduce_grads

    out = {}
    for chunk in (0, 3):  # 0: full logits; 3: hidden states scored 3 tokens at a time
        model = PerToken()
        model.hidden_out = chunk > 0
        host = SimpleNamespace(
            front=None,
            routing=None,
            sequence_parallel=False,
            last_stage=True,
            seq_multiple=sequence_multiple(1, False, cp),
            tp=1,
            tp_rank=0,
            tp_group=None,
            cp=cp,
            cp_rank=ranks.cp_rank,
            cp_group=ranks.cp_group,
            head=SimpleNamespace(weight=model.head.weight) if chunk else None,
            settings=SimpleNamespace(temperature=0.7, logits_chunk_tokens=chunk),
            hf_config=SimpleNamespace(vocab_size=VOCAB),
        )
        logits = MegatronForward._stage_forward(host, model, batch)
        logprobs, entropy = MegatronForward._scores(host, batch, logits)
        mask = batch["response_mask"]
        loss = -(logprobs * batch["advantages"] * mask).sum() / mask.sum() - 0.1 * (entropy * mask).sum()
        loss.backward()
        params = list(model.parameters())
        if cp > 1:
            all_reduce_grads(params, ranks.dp_cp_group)
        out[chunk] = {
            "logprobs": logprobs.detach(),
            "entropy": entropy.detach(),
            "loss": float(loss),
            "grads": [p.grad.clone() for p in params],
            "positions": model.positions[0],
        }
    return out


if __name__ == "__main__":
    main()
