"""Per-expert MoE names (checkpoints, SGLang, the megatron export) into the HF engine's fused experts."""

import asyncio

import pytest
import torch

from relax.core.engines import weight_names
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import load_hf_weights
from relax.core.testing.moe_models import tiny_moe_dir

PROMPTS = [[4, 23, 10, 17, 11, 20], [12, 18, 9], [7]]
EXPERT = "model.layers.1.mlp.experts."


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return tiny_moe_dir(root / "a", seed=0), tiny_moe_dir(root / "b", seed=1)  # saved one tensor per expert


@pytest.fixture
def engine(moe_dirs):
    return HFRolloutEngine(moe_dirs[0])


def greedy(engine, steps=5):
    reqs = [
        GenerationRequest(str(i), p, SamplingParams(temperature=0.0, max_new_tokens=steps, ignore_eos=True))
        for i, p in enumerate(PROMPTS)
    ]
    return [r.response_ids for r in asyncio.run(engine.generate(reqs))]


def test_per_expert_names_fill_the_fused_experts(engine, moe_dirs):
    from transformers import AutoModelForCausalLM

    new = load_hf_weights(moe_dirs[1])  # the checkpoint layout: one name per expert
    assert f"{EXPERT}3.up_proj.weight" in new and f"{EXPERT}gate_up_proj" in engine.state_dict()
    # two buckets splitting one layer's experts (and an expert's gate from its up): slices are written alone
    names = sorted(new)
    cut = names.index(f"{EXPERT}1.up_proj.weight")
    for version, bucket in enumerate((names[:cut], names[cut:]), start=1):
        engine.update_weights({n: new[n] for n in bucket}, version)

    reference = AutoModelForCausalLM.from_pretrained(moe_dirs[1]).eval()
    served = engine.state_dict()
    assert served.keys() == reference.state_dict().keys()
    changed = [n for n, t in reference.state_dict().items() if not torch.equal(served[n], t)]
    assert changed == [] and engine.weight_version() == 2
    assert greedy(engine) == greedy(HFRolloutEngine(moe_dirs[1], model=reference))

    # the fused names (what the torch trainer exports) still load as they are
    old = AutoModelForCausalLM.from_pretrained(moe_dirs[0]).state_dict()
    engine.update_weights({n: t for n, t in old.items() if "experts" in n}, 3)
    assert torch.equal(engine.state_dict()[f"{EXPERT}down_proj"], old[f"{EXPERT}down_proj"])


@pytest.mark.parametrize(
    ("name", "shape", "error", "says"),
    [
        (f"{EXPERT}0.gate_projj.weight", (16, 32), KeyError, "unknown parameter names"),
        (f"{EXPERT}4.gate_proj.weight", (16, 32), ValueError, "expert 4 does not fit"),
        (f"{EXPERT}2.down_proj.weight", (16, 32), ValueError, "(16, 32) != (32, 16)"),
    ],
)
def test_a_wrong_expert_name_or_shape_names_it_and_writes_nothing(engine, name, shape, error, says):
    before = engine.state_dict()
    good = {f"{EXPERT}0.up_proj.weight": torch.ones(16, 32)}
    with pytest.raises(error, match=r"\(model|mismatch") as info:
        engine.update_weights({**good, name: torch.zeros(shape)}, 7)
    assert name in str(info.value) and says in str(info.value)
    after = engine.state_dict()
    assert engine.weight_version() == 0 and all(torch.equal(before[n], after[n]) for n in before)


def test_rules_mirror_transformers_qwen3_moe_mapping(engine):
    rules = weight_names.expert_rules(engine.model)
    name, expert, rule = weight_names.fused_slot(
        "model.language_model.layers.0.mlp.experts.12.up_proj.weight", rules
    )
    assert (name, expert, rule.part, rule.parts, rule.dim) == (
        "model.language_model.layers.0.mlp.experts.gate_up_proj",
        12,
        1,
        2,
        0,
    )
    assert weight_names.fused_slot("model.layers.0.mlp.gate.weight", rules) is None
    assert weight_names.fused_slot("model.layers.0.xmlp.experts.1.down_proj.weight", rules) is None
