"""``UpdateSettings``: the optimisation, schedule and loss settings every trainer backend shares.

One typed object instead of a keyword argument per setting in every backend's constructor: a
backend's factory builds it from core's ``TrainSpec`` (``UpdateSettings.from_context(ctx)``), so
``trainer.*`` and ``algorithm.loss_agg_mode`` map to a backend the same way everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from relax.core.policy_update.schedule import check_schedule
from relax.core.routing_replay import replays


@dataclass(frozen=True)
class UpdateSettings:
    """What the policy-update loop and a backend's optimizer need. ``warmup_steps`` / ``total_steps``
    count ``train_step`` calls (all mini-batches of one call use one LR, as verl steps its scheduler
    once per update); ``temperature`` divides the logits (the rollout temperature);
    ``critic_warmup_steps``: the first calls train only the critic; ``skip_nonfinite``: drop an
    update whose loss or gradient is NaN/inf instead of raising ``NonFiniteError``."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_steps: int = 0
    total_steps: int = 0
    lr_schedule: str = "constant"
    min_lr_ratio: float = 0.0
    micro_batch_size: int = 16
    num_minibatches: int = 1
    loss_agg_mode: str = "token-mean"
    temperature: float = 1.0
    seed: int = 0
    skip_nonfinite: bool = False
    critic_warmup_steps: int = 0
    routing_replay: bool = False  # forwards use the rollout's MoE routing (relax.core.routing_replay)
    # real lengths (docs/long-sequences.md): micro-batches of at most this many tokens (0: micro_batch_size
    # rows); rows packed into one sequence without padding; logits of this many tokens at a time (0: all)
    max_tokens_per_micro_batch: int = 0
    pack_sequences: bool = False
    logits_chunk_tokens: int = 1024
    recompute: str = "off"  # activation recompute: off | full | selective (a backend names what it offers)

    def __post_init__(self) -> None:
        check_schedule(self.lr_schedule)
        object.__setattr__(self, "betas", tuple(self.betas))

    @classmethod
    def from_context(cls, ctx: Any) -> UpdateSettings:
        """From a plugin factory's ``PluginContext``: ``ctx.train`` (core's ``TrainSpec``) and ``ctx.seed``."""
        spec, t = ctx.train, ctx.train.optim
        return cls(
            lr=t.lr,
            weight_decay=t.weight_decay,
            betas=tuple(t.betas),
            eps=t.eps,
            grad_clip=t.grad_clip,
            warmup_steps=t.warmup_steps,
            total_steps=spec.total_steps,
            lr_schedule=t.lr_schedule,
            min_lr_ratio=t.min_lr_ratio,
            micro_batch_size=t.micro_batch_size,
            num_minibatches=t.num_minibatches,
            loss_agg_mode=spec.algorithm.loss_agg_mode,
            temperature=spec.temperature,
            seed=ctx.seed,
            skip_nonfinite=t.skip_nonfinite,
            critic_warmup_steps=spec.algorithm.critic.warmup_steps,
            # the rollout's routing is the policy's: a distillation teacher (another model) never replays it
            routing_replay=ctx.role != "teacher"
            and replays(getattr(spec.algorithm, "routing_replay", "off"), spec.trainable),
            max_tokens_per_micro_batch=t.max_tokens_per_micro_batch,
            pack_sequences=t.pack_sequences,
            logits_chunk_tokens=t.logits_chunk_tokens,
            recompute=t.recompute,
        )

    def with_overrides(self, **overrides: Any) -> UpdateSettings:
        """A copy with some fields replaced (scripts and tests: ``TorchTrainer(path, lr=1e-2)``); an
        unknown name is an error that lists the known ones."""
        unknown = sorted(set(overrides) - {f.name for f in fields(self)})
        if unknown:
            raise TypeError(
                f"unknown trainer settings {unknown}; UpdateSettings has {[f.name for f in fields(self)]}"
            )
        return replace(self, **overrides) if overrides else self
