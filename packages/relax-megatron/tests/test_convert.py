"""HF Qwen3 <-> megatron GPTModel: bit-exact round trips at TP=1/2 and logprob parity with transformers."""

from __future__ import annotations

import itertools

import pytest
import torch

from relax.megatron import convert, gpt_model


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("tp", [1, 2])
def test_hf_megatron_hf_round_trip_is_bit_exact(tiny_qwen3, tp):
    _, config, hf = tiny_qwen3
    shards = convert.hf_to_megatron(hf, config, tp=tp)
    assert len(shards) == tp
    d = convert.Dims.from_hf(config)
    qkv = shards[0]["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert qkv.shape == ((d.heads + 2 * d.groups) * d.head_dim // tp, d.hidden)
    assert shards[0]["mlp.linear_fc1.weight".join(["decoder.layers.1.", ""])].shape == (
        2 * d.ffn // tp,
        d.hidden,
    )
    back = convert.megatron_to_hf(shards, config)
    assert sorted(back) == sorted(convert.hf_weight_names(config))
    _assert_same(back, hf)


def test_pipeline_stages_split_and_merge_back_exactly(tiny_qwen3):
    _, config, hf = tiny_qwen3
    shards = convert.hf_to_megatron(hf, config, tp=2)
    stages = [[convert.to_stage(shard, config, 2, r) for r in range(2)] for shard in shards]
    first, last = stages[0]
    assert "embedding.word_embeddings.weight" in first and "decoder.final_layernorm.weight" not in first
    assert "decoder.final_layernorm.weight" in last and "embedding.word_embeddings.weight" not in last
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])  # tied copy
    assert {n.split(".")[2] for n in last if n.startswith("decoder.layers.")} == {
        "0"
    }  # stage-local numbering
    merged = [convert.from_stages(per_stage, config) for per_stage in stages]
    _assert_same(convert.megatron_to_hf(merged, config), hf)
    with pytest.raises(ValueError, match="pipeline_parallel=3 must divide num_hidden_layers=2"):
        convert.to_stage(shards[0], config, 3, 0)


def test_qkv_fusion_groups_query_heads_with_their_kv_head(tiny_qwen3):
    """Row blocks of linear_qkv follow megatron's [q heads of group g, k_g, v_g] order."""
    _, config, _ = tiny_qwen3
    d = convert.Dims.from_hf(config)
    hd, per = d.head_dim, d.heads // d.groups
    q = torch.arange(d.heads).repeat_interleave(hd)[:, None].float()
    k = 100 + torch.arange(d.groups).repeat_interleave(hd)[:, None].float()
    v = 200 + torch.arange(d.groups).repeat_interleave(hd)[:, None].float()
    blocks = convert.fuse_qkv(q, k, v, d)[::hd, 0].tolist()
    expected = [x for g in range(d.groups) for x in [*range(g * per, (g + 1) * per), 100 + g, 200 + g]]
    assert blocks == expected
    # a TP rank fuses its rows of q, k and v (its run of KV groups): its rows of the whole fused weight
    for rank in range(2):
        mine = convert.fuse_qkv(*(torch.chunk(t, 2)[rank] for t in (q, k, v)), d)
        assert torch.equal(mine, torch.chunk(convert.fuse_qkv(q, k, v, d), 2)[rank])


def test_bad_inputs_name_what_is_wrong(tiny_qwen3):
    _, config, hf = tiny_qwen3
    with pytest.raises(ValueError, match="tensor_parallel=3 must divide num_key_value_heads=2"):
        convert.hf_to_megatron(hf, config, tp=3)
    llama = type("Cfg", (), {"model_type": "llama"})()
    with pytest.raises(
        ValueError, match="model_type 'llama': no installed plugin's model adapter declares a megatron"
    ):
        convert.Dims.from_hf(llama)


def test_megatron_logprobs_match_transformers_tp1(megatron_world, tiny_qwen3):
    """Same weights and tokens: megatron's vocab-parallel per-token logprobs equal HF's within 1e-5 (fp32)."""
    from transformers import AutoModelForCausalLM

    model_dir, config, hf = tiny_qwen3
    model = gpt_model.build_gpt_model(config)
    convert.load_hf_into(model, hf, config)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (3, 33), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(inputs.shape[1])[None].expand_as(inputs)
    with torch.no_grad():
        # with labels, GPTModel returns the vocab-parallel cross entropy per token: logprob = -loss
        logprobs = -model(inputs, positions, attention_mask=None, labels=targets)
        reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ref_logits = reference(inputs).logits
    ref = torch.log_softmax(ref_logits, -1).gather(-1, targets[..., None])[..., 0]
    assert logprobs.shape == ref.shape == (3, 32)
    assert ref.std() > 0.1  # the tiny model's distributions are far from uniform: the check is not vacuous
    # atol 1e-5 plus float32's own rtol (1.3e-6): logprobs reach -13 here, where one float32 ulp is 1e-6
    # (measured: max abs 1.05e-5 at -12.8, max rel 8.2e-7)
    torch.testing.assert_close(logprobs, ref, rtol=1.3e-6, atol=1e-5)
    # and a perturbed weight is caught: the parity check can fail
    convert.load_hf_into(model, {**hf, "model.norm.weight": hf["model.norm.weight"] * 1.01}, config)
    with torch.no_grad():
        perturbed = -model(inputs, positions, attention_mask=None, labels=targets)
    assert (perturbed - ref).abs().max() > 1e-4


def test_load_hf_into_rejects_a_missing_weight(megatron_world, tiny_qwen3):
    _, config, hf = tiny_qwen3
    model = gpt_model.build_gpt_model(config)
    partial = {n: t for n, t in hf.items() if n != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(KeyError, match="model.layers.1.mlp.up_proj.weight"):
        convert.load_hf_into(model, partial, config)


@pytest.mark.parametrize("ep", [1, 2])
def test_moe_round_trip_is_bit_exact_and_shards_the_experts(tiny_qwen3_moe, ep):
    _, config, hf = tiny_qwen3_moe
    shards = convert.hf_to_megatron(hf, config, ep=ep)
    assert len(shards) == ep
    local = {n.split(".")[6] for n in shards[-1] if ".mlp.experts.local_experts." in n}
    assert local == {str(k) for k in range(4 // ep)}  # each EP rank holds its share, numbered locally
    fc1 = shards[-1]["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    last_rank_first = 4 - 4 // ep  # the last rank's first expert, as an HF index
    want = torch.cat(
        [hf[f"model.layers.1.mlp.experts.{last_rank_first}.{w}.weight"] for w in ("gate_proj", "up_proj")]
    )
    assert torch.equal(fc1, want)
    back = convert.megatron_to_hf(shards, config)
    assert sorted(back) == sorted(convert.hf_weight_names(config))
    _assert_same(back, hf)


def test_moe_at_tp2_shards_attention_and_keeps_experts_whole(tiny_qwen3_moe):
    """TP=2 x EP=2: shard ``t * ep + e`` has TP rank ``t``'s attention rows and EP rank ``e``'s two whole experts
    (expert tensor parallelism 1); the TP shards and the EP ranks' experts map back to HF bit-exactly."""
    _, config, hf = tiny_qwen3_moe
    shards = convert.hf_to_megatron(hf, config, tp=2, ep=2)
    assert len(shards) == 4
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert torch.equal(shards[1][qkv], shards[0][qkv]) and not torch.equal(shards[2][qkv], shards[0][qkv])
    fc1 = "decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"
    assert shards[1][fc1].shape == (
        2 * config.moe_intermediate_size,
        config.hidden_size,
    )  # whole, not TP-split
    assert torch.equal(shards[3][fc1], shards[1][fc1]) and not torch.equal(shards[1][fc1], shards[0][fc1])
    back = convert.megatron_to_hf([shards[0], shards[2]], config, expert_shards=shards[:2])
    assert sorted(back) == sorted(convert.hf_weight_names(config))
    _assert_same(back, hf)
    for t, e in itertools.product(range(2), range(2)):  # what a loading rank makes: its own shard only
        _assert_same(convert.hf_to_megatron_rank(hf, config, 2, t, 2, e), shards[t * 2 + e])
    with pytest.raises(ValueError, match="outside tensor_parallel=2 x expert_parallel=2"):
        convert.hf_to_megatron_rank(hf, config, 2, 2, 2, 0)


def test_moe_bad_layouts_name_what_is_wrong(tiny_qwen3, tiny_qwen3_moe):
    _, moe_config, moe_hf = tiny_qwen3_moe
    with pytest.raises(ValueError, match="expert_parallel=3 must divide num_experts=4"):
        convert.hf_to_megatron(moe_hf, moe_config, ep=3)
    _, config, hf = tiny_qwen3
    with pytest.raises(ValueError, match="expert_parallel=2 needs an MoE model"):
        convert.hf_to_megatron(hf, config, ep=2)


def test_moe_logprobs_match_transformers_ep1(megatron_world, tiny_qwen3_moe, logprobs_match_transformers):
    """Router (softmax, top 2, renormalised) and experts: megatron's logprobs equal HF Qwen3-MoE's."""
    logprobs_match_transformers(*tiny_qwen3_moe)


def test_unit_by_unit_conversion_equals_the_whole(tiny_qwen3):
    """What a streaming export does: convert one layer (or top-level weight) of every TP shard at a time."""
    _, config, hf = tiny_qwen3
    shards = convert.hf_to_megatron(hf, config, tp=2)
    units = convert.export_units(list(shards[0]))
    assert (
        len(units) == 2 + config.num_hidden_layers
    )  # embedding, each layer, final norm (tied: no output layer)
    streamed: dict[str, torch.Tensor] = {}
    for unit in units:
        part = convert.megatron_to_hf([{n: s[n] for n in unit} for s in shards], config, partial=True)
        assert not set(part) & set(streamed)
        streamed.update(part)
    _assert_same(streamed, hf)
