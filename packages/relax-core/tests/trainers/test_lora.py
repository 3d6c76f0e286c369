"""LoRA on the torch trainer and adapter-only weight sync to the HF engine (``relax.core.trainers.lora``,
``relax.core.engines.lora_merge``), on the tiny conformance model."""

from __future__ import annotations

import pytest
import torch

from relax.core.config import LoraConfig
from relax.core.data import Sample, collate
from relax.core.engines.hf import HFRolloutEngine
from relax.core.protocols import GenerationRequest, SamplingParams
from relax.core.testing.models import run_async, tiny_model_dir
from relax.core.trainers import lora as lora_adapters
from relax.core.trainers.torch_trainer import TorchTrainer

LORA = LoraConfig(rank=4, alpha=8.0)


def objective(inputs):
    """REINFORCE on the advantages: enough to move the adapter."""
    mask = inputs.response_mask
    loss = -(inputs.logprobs * inputs.advantages * mask).sum() / inputs.global_token_count
    return loss, {}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.getbasetemp())


def make(model_dir, lora=LORA, **kw):
    return TorchTrainer(model_dir, objective=objective, lr=5e-2, micro_batch_size=8, lora=lora, **kw)


@pytest.fixture(scope="module")
def trained(model_dir, batch):
    """A LoRA trainer after two updates (B no longer zero) and the full model's parameter count."""
    trainer = make(model_dir)
    for _ in range(2):
        trainer.train_step(batch)
    return trainer


def test_only_adapter_params_require_grad_and_have_optimizer_state(trained):
    named = dict(trained.model.named_parameters())
    trainable = {n for n, p in named.items() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:4]
    assert all(p.dtype == torch.float32 for n, p in named.items())  # float32 base: the trainer's dtype
    in_optimizer = {id(p) for g in trained.optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(named[n]) for n in trainable}
    assert set(map(id, trained.optimizer.state)) == in_optimizer  # Adam moments only for the adapters
    base = [p for n, p in named.items() if n not in trainable]
    assert sum(p.numel() for p in base) > 10 * sum(named[n].numel() for n in trainable)


def test_bfloat16_base_stays_in_compute_dtype(model_dir):
    trainer = make(model_dir, dtype="bfloat16")
    named = dict(trainer.model.named_parameters())
    assert {p.dtype for n, p in named.items() if not p.requires_grad} == {torch.bfloat16}
    assert {p.dtype for n, p in named.items() if p.requires_grad} == {torch.float32}


def test_export_is_the_adapter_only_and_its_bytes_are_the_adapters_size(trained):
    exported = [pair for bucket in trained.export_weights(bucket_bytes=4096) for pair in bucket]
    names = [n for n, _ in exported]
    assert names and all(n.endswith((".lora_A.weight", ".lora_B.weight")) for n in names)
    assert not any(n.startswith("base_model.") for n in names)  # HF module names, as the engines know them
    rank = LORA.rank
    assert all(t.shape[0] == rank for n, t in exported if n.endswith("lora_A.weight"))
    sent = sum(t.numel() * t.element_size() for _, t in exported)
    assert sent == lora_adapters.adapter_bytes(trained.model)
    full = sum(t.numel() * t.element_size() for t in trained.model.get_base_model().state_dict().values())
    assert sent < full / 10


def test_engine_logprobs_equal_trainer_logprobs_after_an_adapter_sync(model_dir, trained):
    engine = HFRolloutEngine(model_dir, max_batch_size=8)
    base = engine.state_dict()
    for version in (1, 2):  # a second sync re-merges from the pristine base (no drift)
        for bucket in trained.export_weights(bucket_bytes=4096):
            engine.update_weights(bucket, version=version)
    assert engine.weight_version() == 2
    served = engine.state_dict()
    changed = {n for n in served if not torch.equal(served[n], base[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed)
    requests = [
        GenerationRequest(
            request_id=str(i),
            prompt_ids=[5 + i, 9, 12, 7],
            params=SamplingParams(max_new_tokens=6, temperature=1.0, seed=i, ignore_eos=True),
        )
        for i in range(4)
    ]
    results = run_async(engine.generate(requests), timeout_s=120)
    samples = [
        Sample(prompt_ids=r.prompt_ids, response_ids=res.response_ids, group_id=0)
        for r, res in zip(requests, results, strict=True)
    ]
    scored = trained.forward_logprobs(collate(samples, pad_id=0))
    for i, res in enumerate(results):
        torch.testing.assert_close(
            scored[i, : len(res.logprobs)], torch.tensor(res.logprobs), atol=2e-5, rtol=0
        )


def test_engine_refuses_an_adapter_that_does_not_fit_and_changes_nothing(model_dir, trained):
    engine = HFRolloutEngine(model_dir)
    before = engine.state_dict()
    name, a = next(iter(lora_adapters.adapter_tensors(trained.model)))
    with pytest.raises(ValueError, match="lora_A"):
        engine.update_weights([(name, a[:, :-1])], version=1)
    assert engine.weight_version() == 0
    assert all(torch.equal(before[n], t) for n, t in engine.state_dict().items())


def test_reference_is_the_base_with_adapters_disabled(model_dir, trained, batch):
    plain = TorchTrainer(model_dir, trainable=False)
    torch.testing.assert_close(
        trained.forward_reference_logprobs(batch), plain.forward_logprobs(batch), atol=1e-6, rtol=0
    )
    assert not torch.allclose(trained.forward_logprobs(batch), plain.forward_logprobs(batch), atol=1e-3)


def test_resume_restores_adapter_and_optimizer(model_dir, trained, batch, tmp_path):
    trained.save(str(tmp_path))
    resumed = make(model_dir)
    resumed.load(str(tmp_path))
    torch.testing.assert_close(
        resumed.forward_logprobs(batch), trained.forward_logprobs(batch), atol=0, rtol=0
    )
    assert resumed.step == trained.step
    a, b = trained.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert a.keys() == b.keys() and all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a)
    size = (tmp_path / "trainer_state.pt").stat().st_size
    base = sum(t.numel() * 4 for t in trained.model.get_base_model().state_dict().values())
    assert size < base / 3  # the adapter and its moments, not the base
    with pytest.raises(ValueError, match="LoRA"):
        TorchTrainer(model_dir, objective=objective, micro_batch_size=8).load(str(tmp_path))


def test_final_export_writes_peft_adapter_and_merged_weights(model_dir, batch, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = make(model_dir, lora=LoraConfig(rank=4, alpha=8.0, export_merged=True))
    trainer.train_step(batch)
    trainer.save_hf(str(tmp_path))
    assert (tmp_path / "adapter_config.json").exists() and (tmp_path / "adapter_model.safetensors").exists()
    expected = trainer.forward_logprobs(batch)
    merged = TorchTrainer(str(tmp_path / "merged"), trainable=False)
    torch.testing.assert_close(merged.forward_logprobs(batch), expected, atol=2e-5, rtol=0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), str(tmp_path))
    ids = batch["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(peft_model(ids).logits, merged.model(ids).logits, atol=1e-4, rtol=1e-4)


def test_a_target_tied_to_the_embeddings_is_refused(model_dir):
    with pytest.raises(ValueError, match="lm_head shares its weight with the input embeddings"):
        make(model_dir, lora=LoraConfig(rank=2, target_modules=["q_proj", "lm_head"]))


def test_dropout_applies_to_training_forwards_only(model_dir, batch):
    trainer = make(model_dir, lora=LoraConfig(rank=4, dropout=0.5))
    assert not trainer.fuses_old_logprobs()  # its training forward is not the policy's scoring forward
    trainer.train_step(dict(batch, old_logprobs=trainer.forward_logprobs(batch)))  # B != 0 from here
    old = trainer.forward_logprobs(batch)
    assert torch.equal(old, trainer.forward_logprobs(batch))  # scoring: no dropout
    seen = []
    objective_fn = trainer.update.objective
    trainer.update.objective = lambda inputs: (
        seen.append(inputs.logprobs.detach().clone()),
        objective_fn(inputs),
    )[1]
    trainer.train_step(dict(batch, old_logprobs=old))
    mask = batch["response_mask"] > 0
    assert not torch.allclose(
        seen[0][mask], old[mask], atol=1e-5
    )  # training: the adapters' inputs dropped out
    assert not any(m.training for m in trainer.model.modules())  # and dropout off again afterwards


def test_policy_and_reference_forwards_may_run_at_once(trained, batch):
    """A hosting actor runs the old- and reference-logprob forwards concurrently on one module: the
    reference's adapter toggle must not leak into the policy's forward."""
    from concurrent.futures import ThreadPoolExecutor

    policy, reference = trained.forward_logprobs(batch), trained.forward_reference_logprobs(batch)
    with ThreadPoolExecutor(2) as pool:
        runs = [
            (
                pool.submit(trained.forward_logprobs, batch),
                pool.submit(trained.forward_reference_logprobs, batch),
            )
            for _ in range(8)
        ]
        for p, r in runs:
            assert torch.equal(p.result(), policy) and torch.equal(r.result(), reference)


def saved_copies(model) -> dict[str, torch.Tensor]:
    """The ``modules_to_save`` copies' parameters (full tensors under FSDP)."""
    out = {}
    for n, p in model.named_parameters():
        if ".modules_to_save." in n:
            out[n] = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
    return out


def test_modules_to_save_train_with_fp32_masters_on_a_bfloat16_base(model_dir, batch):
    """peft upcasts only the adapters; the modules_to_save copies (here every RMSNorm, weights near 1.0) are fp32
    masters too: at lr 1e-6 AdamW moves nearly every element, where a bf16 copy (spacing 2^-7 near 1.0) could move
    none. The forward still runs (fp32 copy inside a bf16 model) and the export goes out in the engines' bf16."""
    lora = LoraConfig(rank=4, alpha=8.0, modules_to_save=["norm"])
    trainer = TorchTrainer(
        model_dir, objective=objective, lr=1e-6, micro_batch_size=8, lora=lora, dtype="bfloat16"
    )
    before = {n: t.clone() for n, t in saved_copies(trainer.model).items()}
    assert before and {t.dtype for t in before.values()} == {torch.float32}
    assert all(torch.equal(t.bfloat16() + 1e-6, t.bfloat16()) for t in before.values())  # bf16 would not move
    assert {p.dtype for n, p in trainer.model.named_parameters() if not p.requires_grad} == {torch.bfloat16}
    trainer.train_step(batch)
    after = saved_copies(trainer.model)
    moved = sum(int((after[n] != before[n]).sum()) for n in before) / sum(t.numel() for t in before.values())
    assert moved > 0.9, moved
    assert {s["exp_avg"].dtype for s in trainer.optimizer.state.values()} == {torch.float32}
    sent = dict(lora_adapters.adapter_tensors(trainer.model))
    assert any(n.endswith("norm.weight") for n in sent)
    exported = {n: t for bucket in trainer.export_weights() for n, t in bucket}
    assert {t.dtype for n, t in exported.items() if n.endswith("norm.weight")} == {torch.bfloat16}
