"""PPO critic for the torch and fsdp trainers: an HF backbone plus a scalar value head, own optimizer.

The critic is a separate model (same architecture and initial weights as the policy unless
``model_path`` says otherwise), so policy and value gradients never mix. A trainer owns one when
``algorithm.critic.enable`` is set; its state travels in the trainer's checkpoint. Its weights, gradients
and AdamW state are fp32 (the masters) and forwards run under autocast in the compute dtype, as the
policy's. Data parallel: every rank holds a replica, trains on its own rows of each mini-batch, and the
token counts, gradients and metric sums are summed over the ranks (``data_parallel``), so the update is
the single-process one.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import torch
from torch import nn

from relax.core.algorithms import clipped_value_loss
from relax.core.policy_update.token_budget import in_row_order, micro_batches
from relax.core.trainers.recompute import recompute_blocks


class ReplicaSums(Protocol):
    """Sums over the critic's data-parallel replicas (``DataParallel``, ``DefaultGroupSums``)."""

    def sum(self, values: list[float]) -> list[float]: ...

    def all_reduce_grads(self, params: list[torch.nn.Parameter]) -> None: ...


class ValueModel(nn.Module):
    """``AutoModel`` backbone (no LM head) + ``Linear(hidden, 1)``, zero-initialised so that the
    first values are 0 and early advantages equal the plain returns."""

    def __init__(self, model_path: str, dtype: torch.dtype = torch.float32) -> None:
        from transformers import AutoModel

        super().__init__()
        self.backbone = AutoModel.from_pretrained(model_path, dtype=dtype)
        hidden = self.backbone.config.get_text_config().hidden_size
        self.head = nn.Linear(hidden, 1, dtype=torch.float32)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) fp32 value of the state before each response token (positions P-1 .. P+R-2, the
        same alignment as the policy's logits), as verl's critic."""
        resp_len = batch["responses"].shape[1]
        hidden = self.backbone(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
            use_cache=False,
        ).last_hidden_state
        with torch.autocast(
            hidden.device.type, enabled=False
        ):  # the head in fp32 under a mixed-precision forward
            return self.head(hidden[:, -resp_len - 1 : -1].float()).squeeze(-1)


class Critic:
    """Value model, AdamW and the clipped value loss; micro-batched like the policy."""

    def __init__(
        self,
        model_path: str,
        *,
        lr: float = 1e-5,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        grad_clip: float = 1.0,
        value_clip: float = 0.5,
        loss_agg_mode: str = "token-mean",
        micro_batch_size: int = 16,
        dtype: str = "float32",
        device: str | torch.device = "cpu",
        max_tokens: int = 0,
        data_parallel: ReplicaSums | None = None,
        recompute: str = "off",
    ) -> None:
        self.device = torch.device(device)
        self.compute_dtype = getattr(torch, dtype)  # the forwards' (autocast); the weights stay fp32
        self.model = ValueModel(model_path, torch.float32).to(self.device).eval()
        # trainer.recompute: the backbone's blocks run again in backward, as the policy's do (a critic keeping
        # every activation of an 8K-token micro-batch would need as much again as its fp32 state)
        recompute_blocks(self.model.backbone, recompute)
        self.dp = data_parallel
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay
        )
        self.grad_clip, self.value_clip = grad_clip, value_clip
        self.loss_agg_mode, self.micro_batch_size = loss_agg_mode, micro_batch_size
        self.max_tokens = (
            max_tokens  # trainer.max_tokens_per_micro_batch: token-budget micro-batches (padded)
        )

    def _micro_batches(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        return micro_batches(batch, self.micro_batch_size, self.max_tokens)

    def _values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mixed = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=mixed):
            return self.model(batch)

    def forward_values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """(B, R) values, 0 where ``response_mask`` is 0; CPU tensor."""
        pieces = []
        with torch.no_grad():
            for sub in self._micro_batches(batch):
                sub = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in sub.items()}
                values = self._values(sub)
                pieces.append((sub, torch.where(sub["response_mask"] > 0, values, torch.zeros_like(values))))
        return in_row_order(pieces, *batch["responses"].shape).cpu()

    def update(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on a mini-batch with ``values`` (at rollout time) and ``returns``.

        Metrics: ``vf_loss`` (summed over micro-batches: global counts make it the mini-batch
        loss), ``vf_clip_frac``, ``values_mean``, ``critic_grad_norm``.
        """
        mask = batch["response_mask"]
        tokens, seqs = float(mask.sum()), float((mask.sum(dim=-1) > 0).sum())
        if (
            self.dp is not None
        ):  # this replica's rows: the loss is normalised by the whole mini-batch's counts
            tokens, seqs = self.dp.sum([tokens, seqs])
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum, clip_sum, value_sum = 0.0, 0.0, 0.0
        for sub in self._micro_batches(batch):
            sub_mask = sub["response_mask"]
            values = self._values(sub)
            loss, metrics = clipped_value_loss(
                values,
                sub["values"],
                sub["returns"],
                sub_mask,
                self.value_clip,
                self.loss_agg_mode,
                global_token_count=tokens,
                global_seq_count=seqs,
            )
            loss.backward()
            loss_sum += float(loss.detach())
            clip_sum += metrics["vf_clip_frac"] * float(sub_mask.sum())
            value_sum += float((values.detach() * sub_mask).sum())
        if self.dp is not None:  # every replica reduces the same tensors, used or not by its rows
            params = list(self.model.parameters())
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.dp.all_reduce_grads(params)
            loss_sum, clip_sum, value_sum = self.dp.sum([loss_sum, clip_sum, value_sum])
        max_norm = self.grad_clip if self.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        denom = max(tokens, 1.0)
        return {
            "vf_loss": loss_sum,
            "vf_clip_frac": clip_sum / denom,
            "values_mean": value_sum / denom,
            "critic_grad_norm": grad_norm,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])


def critic_from_context(
    ctx: Any, dtype: str, device: str | torch.device, data_parallel: ReplicaSums | None = None
) -> Critic | None:
    """The trainable policy's critic as ``algorithm.critic`` configures it (None without one, or on a frozen
    role); ``ctx``: the trainer's plugin context."""
    spec, t = ctx.train, ctx.train.optim
    c = spec.algorithm.critic
    if not (c.enable and spec.trainable):
        return None
    return Critic(
        c.model_path or ctx.model_path,
        lr=c.lr,
        weight_decay=c.weight_decay,
        betas=tuple(t.betas),
        eps=t.eps,
        grad_clip=c.grad_clip,
        value_clip=c.value_clip,
        loss_agg_mode=c.loss_agg_mode,
        micro_batch_size=t.micro_batch_size,
        max_tokens=t.max_tokens_per_micro_batch,
        dtype=dtype,
        device=device,
        data_parallel=data_parallel,
        recompute=t.recompute,
    )
