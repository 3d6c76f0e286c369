"""Right padding instead of a dense attention mask (padding.py): the rotations are exact, and the
trainer's attention receives no mask tensor (megatron's causal mask type) while its logprobs stay those
of transformers on the left-padded batch."""

from __future__ import annotations

import torch

from relax.core.testing import TinyModelFixtures, make_batch, make_samples, torch_trainer
from relax.megatron.padding import left_pads, response_logits, right_padded, rotate_left


def left_padded_batch() -> dict[str, torch.Tensor]:
    """Three rows as core's ``collate`` lays them out: prompts of 3, 1 and 2 tokens left-padded to 3,
    responses of 2, 3 and 1 tokens right-padded to 3."""
    valid = torch.tensor([[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]])
    input_ids = (torch.arange(1, 19).view(3, 6)) * valid
    return {
        "input_ids": input_ids,
        "attention_mask": valid,
        "position_ids": (valid.cumsum(-1) - 1).clamp(min=0),
        "responses": input_ids[:, 3:],
    }


def test_rows_are_rotated_to_right_padding():
    batch = left_padded_batch()
    assert left_pads(batch["attention_mask"]).tolist() == [0, 2, 1]
    assert left_pads(torch.zeros(1, 4, dtype=torch.long)).tolist() == [4]  # an empty row: all pads
    ids, positions = right_padded(batch)
    assert ids.tolist() == [[1, 2, 3, 4, 5, 0], [9, 10, 11, 12, 0, 0], [14, 15, 16, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 0, 0], [0, 1, 2, 2, 2, 0]]
    assert rotate_left(torch.arange(12).view(2, 3, 2), torch.tensor([1, 0])).tolist() == [
        [[2, 3], [4, 5], [0, 1]],
        [[6, 7], [8, 9], [10, 11]],
    ]
    aligned = {**batch, "attention_mask": torch.ones(3, 6, dtype=torch.long)}
    assert right_padded(aligned)[0] is batch["input_ids"]  # nothing to rotate: the batch's own tensor


def test_response_logits_read_the_rotated_positions_back():
    """Logits whose value is the input token at that position: the positions predicting each response
    token (P-1 .. P+R-2 left-padded) hold the token before it, in both layouts."""
    batch = left_padded_batch()
    ids, _ = right_padded(batch)
    logits = ids[..., None].float().expand(-1, -1, 5)  # (B, S, V)
    got = response_logits(logits, batch)[..., 0]
    assert torch.equal(got, batch["input_ids"][:, 2:5].float())
    aligned = {**batch, "attention_mask": torch.ones(3, 6, dtype=torch.long)}
    assert torch.equal(
        response_logits(batch["input_ids"][..., None].float(), aligned)[..., 0],
        batch["input_ids"][:, 2:5].float(),
    )


class TestNoDenseMask(TinyModelFixtures):
    def test_attention_gets_no_mask_and_logprobs_match_transformers(
        self, megatron_world, model_dir, tokenizer
    ):
        from relax.core.algorithms import build_policy_objective
        from relax.core.algorithms.config import AlgorithmConfig
        from relax.megatron.trainer import MegatronTrainer

        batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
        assert len(set(left_pads(batch["attention_mask"]).tolist())) > 1  # prompts of several lengths
        trainer = MegatronTrainer(
            model_dir, objective=build_policy_objective(AlgorithmConfig()), micro_batch_size=4
        )
        seen: list[object] = []

        def record(module, args, kwargs):
            seen.append(kwargs["attention_mask"] if "attention_mask" in kwargs else args[3])

        attention = [m for n, m in trainer.model.named_modules() if n.endswith("core_attention")]
        hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention]
        try:
            got = trainer.forward_logprobs(batch)
            trainer.train_step(batch)
        finally:
            for hook in hooks:
                hook.remove()
        assert len(attention) == 2 and len(seen) >= 2 * len(attention)
        assert all(mask is None for mask in seen)  # causal mask type: no (B, 1, S, S) tensor built
        torch.testing.assert_close(got, torch_trainer(model_dir).forward_logprobs(batch), atol=1e-5, rtol=0)
