"""MoE routing replay on SGLang: the routed experts SGLang returns, as Relax's per-sample array.

SGLang (0.5.23, since its R3 support) records each token's top-k expert ids when the server runs with
``--enable-return-routed-experts`` and a ``/generate`` request asks ``return_routed_experts``: ``meta_info``
then holds them base64-encoded, int32, ``(prompt + output tokens - 1, num_hidden_layers, top_k)`` -- every
token a forward fed. Relax keeps only the MoE layers (a model's ``mlp_only_layers`` / ``decoder_sparse_step``
leave some dense; a family whose adapter declares its routing, ``model_family.MoeRouting``, says which layers
route: e.g. dense first layers), in the compact dtype, and marks the last sampled token unrecorded, as the HF engine does
(``relax.core.routing_replay``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from relax.core.routing_replay import UNRECORDED, routing_dtype

SERVER_FLAG = "--enable-return-routed-experts"


@dataclass(frozen=True)
class RoutingLayout:
    """Where the MoE layers sit among the model's hidden layers, and their top-k."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def from_config(cls, config: Any) -> RoutingLayout:
        """From the family's declared routing, else an HF text config's Qwen-style fields (``num_experts`` /
        ``num_experts_per_tok``); refuses a dense model."""
        from relax.core.model_family import moe_routing

        text = getattr(config, "get_text_config", lambda: config)()
        declared = moe_routing(text)
        if declared is not None:
            return cls(text.num_hidden_layers, declared.moe_layers, declared.topk, declared.experts)
        experts, top_k = getattr(text, "num_experts", 0) or 0, getattr(text, "num_experts_per_tok", 0) or 0
        if not experts or not top_k:
            raise ValueError(
                f"routing replay: {getattr(text, 'model_type', '?')} has no MoE layers (num_experts, "
                "num_experts_per_tok); set algorithm.routing_replay: off for a dense model"
            )
        dense, step = (
            set(getattr(text, "mlp_only_layers", None) or []),
            getattr(text, "decoder_sparse_step", 1) or 1,
        )
        layers = text.num_hidden_layers
        moe = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
        return cls(layers, moe, top_k, experts)

    def decode(self, meta: dict[str, Any], tokens: int) -> np.ndarray:
        """``(tokens, MoE layers, top_k)`` from one answer's ``meta_info`` for a ``tokens``-long sequence."""
        encoded = meta.get("routed_experts")
        if not encoded:
            raise ValueError(
                f"routing replay: SGLang returned no routed_experts (rid {meta.get('id')}); launch "
                f"the server with {SERVER_FLAG} (attached servers too)"
            )
        flat = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
        # tokens past ``tokens``: a response Relax cut at a stop id (``payload.cut_at_stop_ids``)
        routed = flat.reshape(-1, self.num_layers, self.top_k)[:tokens, list(self.moe_layers)]
        out = np.full(
            (tokens, len(self.moe_layers), self.top_k), UNRECORDED, dtype=routing_dtype(self.num_experts)
        )
        out[: routed.shape[0]] = routed
        return out
