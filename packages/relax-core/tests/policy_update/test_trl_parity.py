"""Gradient parity with TRL 1.16's ``GRPOTrainer`` (a dev dependency): the same weights and the same batch of
prompts, completions and rewards give the same advantages, masks, loss, entropy and gradient in Relax's
policy-update loop (core's torch trainer) as in TRL's own ``_generate_and_score_completions`` +
``compute_loss`` (``bench/vs_trl.py``'s matched settings: ``loss_type=dapo`` = token-mean, group-std
advantages [``scale_rewards=group``] with TRL's epsilon 1e-4, no KL, an entropy bonus, clip 0.2 / 0.2).

Only TRL's sampler is replaced (its ``_generate_single_turn`` returns the fixed completions): they are cut
after EOS as TRL cuts them, some stop at EOS, one is truncated at the length limit without EOS, one group has
all-equal rewards (zero std). Everything else is TRL's code: tokenising the prompts, decoding the completions
for the reward function, the advantages, the masks and the loss.
"""

from __future__ import annotations

import random

import pytest
import torch

from relax.core.algorithms import AdvantageInputs, AlgorithmConfig, build_policy_objective, compute_advantages
from relax.core.data import Sample, collate
from relax.core.testing.models import tiny_model_dir
from relax.core.trainers.torch_trainer import TorchTrainer

G, MAX_NEW, ENTROPY_COEF, CLIP = 4, 4, 0.02, 0.2
PROMPTS = ["3+4=", "1+2=", "9+9="]
#: completions as text (EOS appended where "$" ends one), and each one's reward: group 0 mixed (one truncated
#: at the limit, no EOS), group 1 all equal (zero std: advantage 0), group 2 mixed, EOS right away in one
COMPLETIONS = [
    ("7$", 1.0),
    ("7$", 1.0),
    ("12$", 0.0),
    ("7777", 0.0),
    ("3$", 1.0),
    ("3$", 1.0),
    ("3$", 1.0),
    ("3$", 1.0),
    ("18$", 1.0),
    ("$", 0.0),
    ("1=8", 0.0),
    ("18$", 1.0),
]
MATCHED = AlgorithmConfig(
    advantage_estimator="grpo",
    policy_loss="ppo",
    loss_agg_mode="token-mean",
    clip_ratio_low=CLIP,
    clip_ratio_high=CLIP,
    entropy_coef=ENTROPY_COEF,
    advantage_params={"epsilon": 1e-4},
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def completion_ids(tokenizer):
    eos = tokenizer.eos_token_id
    return [
        tokenizer.encode(text.rstrip("$"), add_special_tokens=False) + [eos] * text.endswith("$")
        for text, _ in COMPLETIONS
    ]


def trl_trainer(model_dir, tmp_path, generate, reward, **overrides):
    """TRL's ``GRPOTrainer`` with the matched settings; ``generate(prompt_ids) -> completion ids`` replaces its
    sampler, ``reward(text) -> float`` scores each decoded completion."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        use_cpu=True,
        bf16=False,
        num_generations=G,
        per_device_train_batch_size=len(COMPLETIONS),
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        epsilon=CLIP,
        epsilon_high=CLIP,
        entropy_coef=ENTROPY_COEF,
        loss_type="dapo",
        scale_rewards="group",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **overrides,
    )
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        reward_funcs=lambda prompts, completions, **_: [reward(c) for c in completions],
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]),
        processing_class=AutoTokenizer.from_pretrained(model_dir),
    )
    trainer._generate_single_turn = lambda prompt_ids, *_: ([generate(ids) for ids in prompt_ids], None)
    return trainer


def trl_step(model_dir, tmp_path, tokenizer, completion_ids, old_logprobs=None):
    """TRL's advantages, completion mask, loss, entropy and gradient (by parameter name) for the batch."""
    queue = list(completion_ids)
    rewards = {
        tokenizer.decode(ids, skip_special_tokens=True): r
        for ids, (_, r) in zip(completion_ids, COMPLETIONS, strict=True)
    }
    trainer = trl_trainer(model_dir, tmp_path, lambda _: queue.pop(0), rewards.__getitem__)
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS for _ in range(G)])
    assert not queue, "TRL asked for a different number of completions"
    if old_logprobs is not None:  # an earlier policy: ratios away from 1, some clipped
        out["old_per_token_logps"] = old_logprobs
    trainer.current_gradient_accumulation_steps = 1
    loss = trainer.compute_loss(trainer.model, out)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return out, float(loss.detach()), trainer._metrics["train"]["entropy"][-1], grads


def relax_batch(prompt_ids, completion_ids, rewards, pad_id):
    """Collated rows (groups of ``G`` consecutive rows) with core's advantages."""
    samples = [
        Sample(prompt_ids=list(p), group_id=i // G, index_in_group=i % G, response_ids=list(c), reward=r)
        for i, (p, c, r) in enumerate(zip(prompt_ids, completion_ids, rewards, strict=True))
    ]
    batch = collate(samples, pad_id=pad_id)
    inputs = AdvantageInputs(
        rewards=batch["rewards"], response_mask=batch["response_mask"], index=batch["group_index"]
    )
    batch["advantages"], _ = compute_advantages(MATCHED, inputs)
    return batch


def relax_step(model_dir, tokenizer, completion_ids, old_logprobs=None, micro_batch_size=5):
    """Relax's batch, train-step metrics and gradient (before the optimizer applies it: lr 0, no clipping)."""
    prompt_ids = [
        tokenizer.encode(PROMPTS[i // G], add_special_tokens=False) for i in range(len(COMPLETIONS))
    ]
    batch = relax_batch(prompt_ids, completion_ids, [r for _, r in COMPLETIONS], tokenizer.pad_token_id)
    if old_logprobs is not None:
        batch["old_logprobs"] = old_logprobs
    objective = build_policy_objective(MATCHED)
    trainer = TorchTrainer(
        model_dir, objective=objective, lr=0.0, grad_clip=0.0, micro_batch_size=micro_batch_size
    )
    metrics = trainer.train_step(batch)
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    return batch, metrics, grads, trainer


def assert_same_grads(got, want):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_on_policy_step_matches_trl(model_dir, tokenizer, completion_ids, tmp_path):
    """One update per generation (ratio 1): TRL detaches its own logprobs, Relax fuses them from the same forward."""
    out, trl_loss, trl_entropy, trl_grads = trl_step(model_dir, tmp_path, tokenizer, completion_ids)
    batch, metrics, grads, _ = relax_step(model_dir, tokenizer, completion_ids)
    mask = out["completion_mask"].float()
    # the masks: each completion up to and including its EOS, the truncated one in full, padding out
    assert torch.equal(batch["response_mask"], mask)
    assert mask.sum(-1).tolist() == [2, 2, 3, 4, 2, 2, 2, 2, 3, 1, 3, 3]
    # advantages: group-std scaled, 0 for the all-equal group, broadcast over each row's tokens
    torch.testing.assert_close(batch["advantages"], out["advantages"][:, None] * mask, atol=1e-6, rtol=0)
    assert out["advantages"][4:8].abs().max() == 0 and out["advantages"].abs().max() > 0.5
    assert metrics["loss"] == pytest.approx(trl_loss, abs=1e-6)
    assert metrics["entropy"] == pytest.approx(trl_entropy, abs=1e-5)
    assert metrics["entropy"] > 0.5  # the bonus is a real term of the loss and gradient here
    assert_same_grads(grads, trl_grads)


def test_clipped_step_matches_trl(model_dir, tokenizer, completion_ids, tmp_path):
    """Old logprobs of an earlier policy (ratios 0.55-1.8): the clipped surrogate binds on both sides."""
    batch, metrics, _, trainer = relax_step(model_dir, tokenizer, completion_ids)
    shift = torch.linspace(-0.6, 0.6, batch["response_mask"].numel()).view_as(batch["response_mask"])
    old = (trainer.forward_logprobs(batch) + shift) * batch["response_mask"]
    out, trl_loss, _, trl_grads = trl_step(model_dir, tmp_path, tokenizer, completion_ids, old_logprobs=old)
    batch, metrics, grads, _ = relax_step(
        model_dir, tokenizer, completion_ids, old_logprobs=old, micro_batch_size=12
    )
    assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0
    assert metrics["dual_clip_frac"] == 0  # Relax's dual clip (TRL has none) is inactive at these ratios
    assert metrics["loss"] == pytest.approx(trl_loss, abs=1e-6)
    assert_same_grads(grads, trl_grads)


def test_three_updates_match_trl_train_loop(model_dir, tokenizer, tmp_path):
    """TRL's own ``train()`` (its AdamW, clipping and constant LR) for 3 steps on completions drawn by a seeded
    stand-in sampler, replayed into Relax's trainer: the same loss and gradient norm every step and the same
    weights after (Adam's first steps are sign-like, so a parameter whose gradient is float noise may move a
    little differently: at most 1 in 1,000 weights differ by more than 1e-5 after moving up to 1.5e-2)."""
    rng, alphabet, eos = (
        random.Random(0),
        tokenizer.encode("0123456789+=", add_special_tokens=False),
        tokenizer.eos_token_id,
    )
    steps: list[tuple[list, list]] = []  # per step: (prompt ids, completion ids) as TRL batched them

    def generate(prompt_ids):
        n = rng.randint(1, MAX_NEW)
        ids = [rng.choice(alphabet) for _ in range(n)]
        ids = ids if n == MAX_NEW and rng.random() < 0.5 else ids[:-1] + [eos]  # some truncated, most stop
        if not steps or len(steps[-1][0]) == len(COMPLETIONS):
            steps.append(([], []))
        steps[-1][0].append(list(prompt_ids))
        steps[-1][1].append(ids)
        return ids

    def reward(text):
        return float(len(text) % 2)

    lr, settings = (
        5e-3,
        dict(learning_rate=5e-3, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0),
    )
    trl = trl_trainer(model_dir, tmp_path, generate, reward, max_steps=3, seed=0, logging_steps=1, **settings)
    trl.train()
    logged = [(h["loss"], h["grad_norm"]) for h in trl.state.log_history if "grad_norm" in h]
    assert len(steps) == len(logged) == 3

    relax = TorchTrainer(
        model_dir, objective=build_policy_objective(MATCHED), lr=lr, grad_clip=1.0, micro_batch_size=5
    )
    for (prompt_ids, completion_ids), (loss, grad_norm) in zip(steps, logged, strict=True):
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in completion_ids]
        batch = relax_batch(prompt_ids, completion_ids, [reward(t) for t in texts], tokenizer.pad_token_id)
        metrics = relax.train_step(batch)
        assert metrics["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-6)
        assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    assert logged[0][1] > 1.0  # clipping binds: the clipped step is compared too

    trl_weights = dict(trl.model.named_parameters())
    initial = TorchTrainer(model_dir, trainable=False).model
    moved = differ = total = 0.0
    for (name, p), p0 in zip(relax.model.named_parameters(), initial.parameters(), strict=True):
        gap = (p.detach() - trl_weights[name].detach()).abs()
        differ, total = differ + float((gap > 1e-5).sum()), total + gap.numel()
        moved = max(moved, float((p.detach() - p0).abs().max()))
    assert moved > 0.5 * lr and differ / total < 1e-3
