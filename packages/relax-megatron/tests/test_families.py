"""Families that reach megatron only through their model adapter (relax-models): GLM-4.5-style MoE (``glm4_moe``:
partial rotary, q/k/v biases, a dense first layer, shared experts, a sigmoid router with expert bias) and
DeepSeek-V3 (``deepseek_v3``: multi-latent attention on megatron-core's own ``MLASelfAttention``, the same
MoE). Tiny seeded models built from configs: the HF <-> megatron mapping is bit-exact at TP / EP 1 and 2,
megatron's logprobs equal transformers' (fp32, the tolerance of ``test_convert.py``), and one step of the
megatron trainer equals core's torch trainer on transformers' model. GLM-5 (``glm_moe_dsa``: MLA with a
sparse-attention indexer) is refused by name."""

from __future__ import annotations

import pytest
import torch

from relax.core.testing import make_batch, make_samples, torch_trainer
from relax.core.testing.trainer import exported
from relax.megatron import convert, gpt_model
from relax.models.tiny import CONFIGS, MOE, tiny_family_dir

TRAINER_KW = {"lr": 1e-2, "micro_batch_size": 4, "eps": 1e-4}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def family(request, tmp_path_factory, tiny_qwen3):
    """(model_dir, HF config, HF state dict) of a seeded tiny model of the family, with the tiny Qwen3's
    tokenizer, saved as transformers writes it (one tensor per expert); the routers' selection biases random
    so that they change which experts are picked."""
    from transformers import AutoConfig, AutoTokenizer

    from relax.core.testing.models import load_hf_weights

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3[0])
    model_dir = tiny_family_dir(
        tmp_path_factory.mktemp(request.param) / request.param, request.param, tokenizer
    )
    return str(model_dir), AutoConfig.from_pretrained(model_dir), load_hf_weights(str(model_dir))


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def test_the_adapter_declares_the_layout(family):
    _, config, _ = family
    d = convert.Dims.from_hf(config)
    assert (d.experts, d.topk, d.dense_layers, d.router, d.expert_bias) == (4, 2, 1, "sigmoid", True)
    assert d.shared_ffn == 16 and d.topk_scaling == config.routed_scaling_factor
    if config.model_type == "glm4_moe":
        assert (d.attention, d.rotary_percent, d.qkv_bias, d.qk_norm) == ("gqa", 0.5, True, False)
    else:
        assert (d.attention, d.q_lora_rank, d.kv_lora_rank, d.qk_rope_dim, d.v_head_dim) == (
            "mla",
            16,
            8,
            4,
            8,
        )


@pytest.mark.parametrize("tp, ep", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_round_trip_is_bit_exact(family, tp, ep):
    """TP shards (attention, shared experts, dense MLP) x EP ranks (routed experts) map back to HF exactly."""
    _, config, hf = family
    shards = convert.hf_to_megatron(hf, config, tp=tp, ep=ep)
    assert len(shards) == tp * ep
    assert "decoder.layers.0.mlp.linear_fc1.weight" in shards[0]  # the dense first layer
    assert "decoder.layers.1.mlp.shared_experts.linear_fc1.weight" in shards[0]
    assert shards[0]["decoder.layers.1.mlp.router.expert_bias"].dtype == torch.float32
    back = convert.megatron_to_hf([shards[t * ep] for t in range(tp)], config, expert_shards=shards[:ep])
    assert sorted(back) == sorted(convert.hf_weight_names(config))
    _assert_same(back, hf)
    for rank, shard in enumerate(shards):  # one rank's conversion (what a loading rank makes) is its shard
        _assert_same(convert.hf_to_megatron_rank(hf, config, tp, rank // ep, ep, rank % ep), shard)


def test_logprobs_match_transformers_tp1(megatron_world, family, logprobs_match_transformers):
    """Same weights and tokens: megatron-core's model (MLA or partial-rotary GQA, sigmoid router with expert
    bias, shared experts) gives transformers' per-token logprobs within 1e-5 (fp32)."""
    logprobs_match_transformers(*family)


def _fused(weights: dict, config) -> dict:
    """Per-expert HF names (the megatron trainer's export) as transformers' in-memory fused experts."""
    out = dict(weights)
    for i in range(config.first_k_dense_replace, config.num_hidden_layers):
        e, experts = f"model.layers.{i}.mlp.experts.", range(config.n_routed_experts)
        out[e + "gate_up_proj"] = torch.stack(
            [
                torch.cat([out.pop(f"{e}{j}.gate_proj.weight"), out.pop(f"{e}{j}.up_proj.weight")])
                for j in experts
            ]
        )
        out[e + "down_proj"] = torch.stack([out.pop(f"{e}{j}.down_proj.weight") for j in experts])
    return out


def test_one_step_matches_the_torch_trainer(megatron_world, family):
    """TP=1: the same logprobs, loss, grad norm and updated weights as core's torch trainer on transformers'
    model; the selection biases stay as loaded (no rebalancing in RL fine-tuning)."""
    from transformers import AutoTokenizer

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    model_dir, config, hf = family
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    ref = torch_trainer(model_dir, **TRAINER_KW)
    meg = MegatronTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), **TRAINER_KW)
    old = ref.forward_logprobs(batch)
    torch.testing.assert_close(meg.forward_logprobs(batch), old, atol=1e-5, rtol=0)
    m_ref, m_meg = (
        ref.train_step({**batch, "old_logprobs": old}),
        meg.train_step({**batch, "old_logprobs": old}),
    )
    for key in (
        "loss",
        "entropy",
        "grad_norm",
    ):  # float32 sums in another order: ~1e-6 relative (grad norm ~9)
        assert m_meg[key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-5), key
    want, got = exported(ref), _fused(exported(meg), config)
    assert sorted(got) == sorted(want)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert torch.equal(got[bias], hf[bias])
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_sparse_attention_is_refused_by_name(megatron_world):
    """GLM-5's MLA with a sparse-attention indexer: the adapter declares it, megatron refuses it naming why."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("glm_moe_dsa", vocab_size=64, **MOE, **CONFIGS["deepseek_v3"])
    assert convert.Dims.from_hf(config).attention == "sparse"
    with pytest.raises(ValueError, match="sparse-attention indexer.*use trainer.backend: torch or fsdp"):
        gpt_model.build_gpt_model(config)


#: two processes at TP=2 x EP=2: sequence parallelism, each rank two whole experts (DP x EP is Qwen3-MoE's
#: check in test_tensor_parallel.py; nothing in it is family-specific)
LAYOUT = {"tensor_parallel": 2, "expert_parallel": 2}


def test_tp2_ep2_equals_the_torch_trainer(family, run_ranks):
    """Two ranks (``LAYOUT``): the logprobs equal the torch trainer's, and one step gives its loss, grad norm
    and updated weights."""
    from transformers import AutoTokenizer

    model_dir, config, _ = family
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    batch = make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id)
    ref = torch_trainer(model_dir, **TRAINER_KW)
    batch["old_logprobs"] = old = ref.forward_logprobs(batch)
    m_ref = ref.train_step(batch)
    got = run_ranks("ep", model_dir, {"batch": batch, "layout": LAYOUT}, script="families_worker.py")
    torch.testing.assert_close(got["logprobs"], old, atol=1e-5, rtol=0)
    for key in ("loss", "entropy", "grad_norm"):
        assert got["metrics"][key] == pytest.approx(m_ref[key], rel=1e-5, abs=1e-5), key
    want, weights = exported(ref), _fused(got["weights"], config)
    assert sorted(weights) == sorted(want)
    for name, tensor in want.items():
        torch.testing.assert_close(
            weights[name], tensor, atol=2e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_relax_validate_names_what_megatron_cannot_run(tmp_path):
    """``validate_run``'s model check, from ``config.json`` alone: GLM-5's sparse attention and a family no adapter
    declares a layout for are named; DeepSeek-V3 and GLM-4-MoE at TP=2 pass."""
    from transformers import AutoConfig, LlamaConfig

    from relax.megatron.family_check import family_problems

    def saved(name: str, config) -> str:
        config.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    glm5 = saved("glm5", AutoConfig.for_model("glm_moe_dsa", vocab_size=64, **MOE, **CONFIGS["deepseek_v3"]))
    (sparse,) = family_problems(glm5)
    assert "'glm_moe_dsa' uses multi-latent attention with a sparse-attention indexer" in sparse
    assert "trainer.backend: torch or fsdp" in sparse
    deepseek = saved(
        "dsv3", AutoConfig.for_model("deepseek_v3", vocab_size=64, **MOE, **CONFIGS["deepseek_v3"])
    )
    glm = saved("glm", AutoConfig.for_model("glm4_moe", vocab_size=64, **MOE, **CONFIGS["glm4_moe"]))
    assert family_problems(deepseek) == [] and family_problems(glm) == []
    llama = saved(
        "llama", LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    )
    (missing,) = family_problems(llama)
    assert "model_type 'llama': no installed plugin's model adapter declares a megatron layout" in missing
    assert family_problems("org/not-a-local-dir") == []  # the run checks a hub id itself


def test_relax_convert_writes_a_transformers_model(megatron_world, family, tmp_path):
    """A dist checkpoint of a trainer after one step: ``relax convert`` writes an HF directory transformers loads,
    holding the trainer's weights (experts fused as transformers holds them, the selection biases included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.core.cli import main
    from relax.megatron.trainer import MegatronTrainer

    model_dir, config, _ = family
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = MegatronTrainer(model_dir, objective=build_policy_objective(AlgorithmConfig()), **TRAINER_KW)
    trainer.train_step(make_batch(make_samples(tokenizer, rows=8, seed=3), tokenizer.pad_token_id))
    trainer.save(str(tmp_path / "ckpt"))
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf")]) == 0
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).state_dict()
    want = _fused(exported(trainer), config)
    assert sorted(converted) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(converted[name], tensor), name


def test_routing_replay_columns_skip_the_dense_layers(megatron_world, family):
    """Core records the MoE layers' routing only (``(B, T, moe_layers, k)``): megatron's routers of global
    layers 1 and 2 (layer 0 dense) read columns 0 and 1, and a batch column must have two MoE layers."""
    from relax.megatron.routing import MegatronRouting, moe_layer_pattern

    _, config, _ = family
    assert moe_layer_pattern([0, 1, 1], 3) == [0, 1, 1] and moe_layer_pattern(2, 4) == [1, 0, 1, 0]
    routing = MegatronRouting.for_model(gpt_model.build_gpt_model(config), True, config.num_hidden_layers)
    assert routing.layers == [0, 1] and routing.num_layers == 2
    batch = {
        "input_ids": torch.zeros(1, 4, dtype=torch.long),
        "attention_mask": torch.ones(1, 4, dtype=torch.long),
    }
    with pytest.raises(ValueError, match=r"should be \(rows, tokens, 2 MoE layers, k\)"):
        with routing.applied({**batch, "routed_experts": torch.zeros(1, 4, 3, 2, dtype=torch.long)}):
            pass


@pytest.fixture(scope="module")
def rollout(family, tmp_path_factory):
    """Core's HF engine rolling out the family's model with routing recorded (what ``algorithm.routing_replay``
    turns on), the results as a batch; and a copy of the model whose routers' selection biases differ: it picks
    other experts but weights a given choice alike (a sigmoid router weights experts by their unbiased scores),
    so replaying the rollout's routing must give the rollout's logprobs."""
    import asyncio

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from relax.core.data import Sample
    from relax.core.engines.hf import HFRolloutEngine
    from relax.core.protocols import GenerationRequest, SamplingParams

    model_dir = family[0]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [s.prompt_ids for s in make_samples(tokenizer, rows=6, seed=5)]
    engine = HFRolloutEngine(model_dir, record_routing=True, max_batch_size=3)
    requests = [
        GenerationRequest(str(i), p, SamplingParams(max_new_tokens=5, seed=i, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    results = asyncio.run(engine.generate(requests))
    samples = [
        Sample(
            prompt_ids=p,
            group_id=i,
            response_ids=r.response_ids,
            rollout_logprobs=r.logprobs,
            routed_experts=r.routed_experts,
        )
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]
    shifted = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    for name, buffer in shifted.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.randn(buffer.shape, generator=gen))
    shifted_dir = tmp_path_factory.mktemp("shifted") / "model"
    shifted.save_pretrained(shifted_dir)
    tokenizer.save_pretrained(shifted_dir)
    return samples, make_batch(samples, tokenizer.pad_token_id), str(shifted_dir)


def test_rollout_routing_replays_on_megatron(megatron_world, family, rollout):
    """End to end: the HF engine records each token's experts for the MoE layers only (layer 0 is dense), the
    last sampled token unrecorded; megatron (and core's torch trainer) replaying them on a model that would
    route otherwise give the rollout's logprobs (1e-5, fp32), its own routing does not."""
    from relax.core.algorithms import build_policy_objective
    from relax.core.algorithms.config import AlgorithmConfig
    from relax.megatron.trainer import MegatronTrainer

    samples, batch, shifted_dir = rollout
    for s in samples:
        routed = s.routed_experts
        assert routed.shape == (len(s.prompt_ids) + len(s.response_ids), 2, 2)  # (tokens, MoE layers, k)
        assert (routed[-1] == -1).all() and ((routed[:-1] >= 0) & (routed[:-1] < 4)).all()
    assert batch["routed_experts"].shape[2:] == (2, 2)
    mask = batch["response_mask"] > 0
    want = batch["rollout_logprobs"][mask]
    meg = MegatronTrainer(
        shifted_dir,
        objective=build_policy_objective(AlgorithmConfig()),
        routing_replay=True,
        **TRAINER_KW,
    )
    replayed = meg.forward_logprobs(batch)[mask]
    free = meg.forward_logprobs({k: v for k, v in batch.items() if k != "routed_experts"})[mask]
    torch.testing.assert_close(replayed, want, atol=1e-5, rtol=0)
    assert float((free - want).abs().max()) > 1e-3  # the shifted biases moved tokens: not vacuous
    ref = torch_trainer(shifted_dir, routing_replay=True, **TRAINER_KW)
    torch.testing.assert_close(ref.forward_logprobs(batch)[mask], want, atol=1e-5, rtol=0)
