"""Megatron context parallelism on CPU (``relax.megatron.context_parallel``): the load-balanced split of a sequence
into 2 x CP chunks and its inverse, the response columns the scores read, the config checks, and over gloo (world
2 = CP 2) the trainer's own split, score gather and gradient sum with a per-token stand-in for the model.

The model under CP is not run here: its attention exists only in Transformer Engine (megatron's local attention
asserts ``context_parallel_size == 1``). ``test_gpu_cp.py`` checks the whole trainer at CP 2 on two GPUs."""

from __future__ import annotations

import pytest
import torch

from relax.core.config import ConfigError, load_config
from relax.megatron.context_parallel import (
    TE_REASON,
    cp_response_scores,
    local_part,
    rank_columns,
    reassemble,
    response_columns,
    response_targets,
    sequence_multiple,
)
from relax.megatron.padding import pad_to_multiple, response_logits, right_padded

VOCAB = 13  # cp_worker.py's


def left_padded(prompts: list[int], responses: list[int], width: tuple[int, int], seed: int = 0) -> dict:
    """A core-shaped batch: prompts left-padded to ``width[0]``, responses right-padded to ``width[1]``."""
    p, r = width
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(len(prompts), p + r, dtype=torch.long)
    for row, (pl, rl) in enumerate(zip(prompts, responses, strict=True)):
        mask[row, p - pl : p + rl] = 1
    ids = torch.randint(1, VOCAB, mask.shape, generator=gen) * mask
    sign = torch.where(torch.arange(len(prompts))[:, None] % 2 == 0, 1.0, -0.5)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, p:],
        "response_mask": mask[:, p:].float(),
        "advantages": sign * mask[:, p:].float(),
    }


def test_each_rank_holds_chunks_i_and_2cp_minus_1_minus_i():
    assert rank_columns(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert rank_columns(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert rank_columns(16, 4, 1).tolist() == [2, 3, 12, 13]
    for cp in (1, 2, 4):
        held = torch.cat([rank_columns(24, cp, r) for r in range(cp)])
        assert sorted(held.tolist()) == list(range(24))  # every column once
    with pytest.raises(ValueError, match="not a multiple of 2 x context_parallel = 4"):
        rank_columns(6, 2, 0)


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("length", [1, 5, 13, 37])
def test_split_and_reassemble_round_trip(cp, length):
    """(B, T, V) logits and (B, T) logprobs of odd lengths: padded to a multiple of 2 x CP, split, reassembled."""
    logits = torch.randn(3, length, 5)
    padded = pad_to_multiple(logits, 1, sequence_multiple(1, False, cp))
    assert padded.shape[1] % (2 * cp if cp > 1 else 1) == 0 and padded.shape[1] - length < 2 * cp
    parts = [local_part(padded, cp, r) for r in range(cp)]
    assert {p.shape[1] for p in parts} == {padded.shape[1] // cp}
    assert torch.equal(reassemble(parts)[:, :length], logits)
    logprobs = logits[..., 0]
    parts = [local_part(pad_to_multiple(logprobs, 1, 2 * cp), cp, r) for r in range(cp)]
    assert torch.equal(reassemble(parts)[:, :length], logprobs)


def test_sequence_multiple_counts_cp_chunks_and_sequence_parallel_tp():
    assert sequence_multiple(4, False, 1) == 1
    assert sequence_multiple(4, True, 1) == 4  # sequence parallelism alone: TP
    assert sequence_multiple(1, False, 2) == 4
    assert sequence_multiple(2, True, 2) == 8  # each of the 2 x CP chunks split over TP


def test_position_ids_per_chunk_are_the_columns_of_a_right_padded_row():
    """Megatron's rotary embedding takes each rank's positions as its chunks' columns: for right-padded rows
    (padding.py) the position ids of every valid token are its column, so the split keeps them."""
    batch = left_padded([3, 5], [4, 2], (5, 4))
    _, positions = right_padded(batch)
    padded = pad_to_multiple(positions, 1, 4)
    for rank in (0, 1):
        local, columns = local_part(padded, 2, rank), rank_columns(padded.shape[1], 2, rank)
        for row, valid in enumerate(batch["attention_mask"].sum(-1).tolist()):
            kept = columns < valid
            assert torch.equal(local[row][kept], columns[kept])


def test_response_columns_are_the_positions_that_predict_the_responses():
    batch = left_padded([3, 5, 1], [4, 2, 3], (5, 4), seed=1)
    columns = response_columns(batch)
    logits = torch.randn(3, 9, 7)
    assert torch.equal(logits.gather(1, columns[..., None].expand(-1, -1, 7)), response_logits(logits, batch))
    ids, _ = right_padded(batch)
    valid = batch["response_mask"] > 0
    assert torch.equal(ids.gather(1, columns + 1)[valid], batch["responses"][valid])  # next token = response
    targets, predicts = response_targets(batch["responses"], columns, 12)
    assert predicts.sum() == 3 * 4 and torch.equal(targets.gather(1, columns), batch["responses"])


def test_cp1_scores_equal_the_plain_response_path():
    """At CP 1 the CP scoring (each rank's own positions, placed back) is the plain path's selection."""
    batch = left_padded([3, 5, 1], [4, 2, 3], (5, 4), seed=2)
    out = torch.randn(3, 9, VOCAB)

    def per_token(x, targets):
        logp = torch.log_softmax(x, -1)
        return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)

    want = per_token(response_logits(out, batch), batch["responses"])
    got = cp_response_scores(batch, out, per_token, 1, 0, None)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


def test_backend_params_refuse_cp_without_transformer_engine():
    from relax.megatron.plugin import MegatronParams, world_size

    for params in (
        MegatronParams(context_parallel=2),  # CPU
        MegatronParams(context_parallel=2, device="cuda"),  # layer_spec auto: may not be TE
        MegatronParams(context_parallel=2, device="cuda", layer_spec="local"),
    ):
        (error,) = params.validate()
        assert error == f"context_parallel: {TE_REASON}"
        assert "Transformer Engine" in error and "docs/gpu.md" in error
    te = MegatronParams(
        context_parallel=2, device="cuda", layer_spec="te", tensor_parallel=2, data_parallel=3
    )
    assert te.validate() == [] and world_size(te) == 2 * 2 * 3
    (ep,) = MegatronParams(context_parallel=2, device="cuda", layer_spec="te", expert_parallel=4).validate()
    assert "must divide tensor_parallel x context_parallel x data_parallel=2" in ep
    layout = te.memory_layout(load_config(None, []))
    assert layout.context_parallel == 2 and layout.world == 12 and "TP 2 x CP 2 x PP 1 x DP 3" in layout.note


def test_check_layout_and_model_config_under_cp():
    from relax.megatron.parallel import check_layout, model_overrides

    check_layout(8, 2, 1, 2, 1, cp=2)
    with pytest.raises(ValueError, match="world_size=4 != tensor_parallel=1 x context_parallel=2 x pipeline"):
        check_layout(4, 1, 1, 1, 1, cp=2)
    overrides = model_overrides(1, 1, torch.float32, per_token_loss=False, context_parallel=2)
    assert overrides == {"context_parallel_size": 2, "cp_comm_type": "p2p"}


def test_relax_validate_names_what_cp_does_not_take(tmp_path):
    """``relax validate`` (load_config's checks): packed rows and routing replay under CP, each by name."""
    cp = "trainer.backend_params={device: cuda, layer_spec: te, context_parallel: 2}"
    with pytest.raises(ConfigError) as err:
        load_config(None, ["trainer.backend=megatron", cp, "trainer.pack_sequences=true"])
    assert "trainer.pack_sequences with trainer.backend_params.context_parallel > 1" in str(err.value)
    with pytest.raises(
        ConfigError, match="algorithm.routing_replay with trainer.backend_params.context_parallel"
    ):
        load_config(None, ["trainer.backend=megatron", cp, "algorithm.routing_replay=rollout"])
    with pytest.raises(
        ConfigError, match="context_parallel: context_parallel > 1 runs in Transformer Engine"
    ):
        load_config(None, ["trainer.backend=megatron", "trainer.backend_params={context_parallel: 2}"])
    cfg = load_config(None, ["trainer.backend=megatron", cp])  # a text model on TE: accepted
    assert cfg.trainer.backend_params.context_parallel == 2


def test_cp2_over_gloo_scores_and_gradients_equal_cp1(run_ranks):
    """World 2 = CP 2 (megatron's groups from ``join_world``): the trainer's split, CP score gather (full logits
    and chunked) and DP x CP gradient sum with a per-token model equal CP 1; one batch's response tokens all
    lie in rank 1's chunks, so rank 0 scores none and still runs its backward."""
    data = {
        "odd": left_padded([3, 5, 1], [4, 2, 3], (5, 4), seed=3),  # 9 columns, padded to 12
        "rank1_only": left_padded(
            [4, 3], [2, 1], (4, 2), seed=4
        ),  # response columns 2-4 of 8: rank 1 holds 2-5
    }
    assert set(response_columns(data["rank1_only"]).unique().tolist()) <= set(rank_columns(8, 2, 1).tolist())
    got = run_ranks("cp", "none", data, script="cp_worker.py")
    assert got["groups"] == {"cp": (2, 0, [0, 1]), "dp": (1, [0]), "dp_cp": [0, 1]}
    for name in data:
        for chunk in (0, 3):
            cp, ref = got["cp"][name][chunk], got["reference"][name][chunk]
            for key in ("logprobs", "entropy"):
                torch.testing.assert_close(cp[key], ref[key], atol=1e-6, rtol=0, msg=f"{name} {chunk} {key}")
            assert cp["loss"] == pytest.approx(ref["loss"], abs=1e-6)
            for g, w in zip(cp["grads"], ref["grads"], strict=True):
                torch.testing.assert_close(g, w, atol=1e-6, rtol=0)
            assert bool(ref["grads"][0].abs().sum() > 0)
    columns = rank_columns(12, 2, 0)  # rank 0's positions for the 9-column batch: columns 0-2 and 9-11
    assert torch.equal(got["cp"]["odd"][0]["positions"][1], torch.where(columns < 7, columns, 0))
