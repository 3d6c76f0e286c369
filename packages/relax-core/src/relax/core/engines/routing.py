"""The HF engine's side of MoE routing replay: each request's top-k experts per token (``relax.core.routing_replay``).

A context's routing comes from its prefill (kept, like the prefill itself, while requests with that context
still wait to join), then each decode step adds one row per live request: the routing of the token it fed.
The last sampled token is fed by no forward, so a result's array ends with one unrecorded row. Requests
decoded outside the shared batch (media, static batches) carry no routing.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Any

import numpy as np
import torch

from relax.core.engines.batcher import Row
from relax.core.routing_replay import RoutingRecorder, sequence_routing


class EngineRouting:
    """Routing bookkeeping of one engine: call :meth:`prefilled` after a left-padded prefill forward,
    :meth:`joined` when rows join the batch, :meth:`stepped` after a decode forward, :meth:`result` at the end."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.recorder = RoutingRecorder(model)
        self._contexts: dict[tuple[int, ...], np.ndarray] = {}

    def prefilled(self, contexts: list[tuple[int, ...]], input_ids: torch.Tensor) -> None:
        """After one forward over ``input_ids`` (``contexts`` left-padded to its width)."""
        batch, width = input_ids.shape
        routed = self.recorder.take(batch, width)
        for i, context in enumerate(contexts):
            self._contexts[context] = routed[i, width - len(context) :]

    def joined(self, rows: list[Row], waiting: Container[tuple[int, ...]]) -> None:
        """Rows joining the batch take their context's routing; contexts no waiting row shares are dropped."""
        for row in rows:
            row.routing = [self._contexts[tuple(row.context)]]
        for key in [k for k in self._contexts if k not in waiting]:
            del self._contexts[key]

    def stepped(self, rows: list[Row]) -> None:
        """After a decode forward over ``rows`` (one token each, batch order)."""
        routed = self.recorder.take(len(rows), 1)
        for i, row in enumerate(rows):
            row.routing.append(routed[i, 0])

    @staticmethod
    def result(row: Row, tokens: int) -> Any:
        """The request's ``(tokens, layers, k)`` routing over context + sampled tokens, or None if not recorded."""
        if not row.routing:
            return None
        return sequence_routing(row.routing[0], row.routing[1:], tokens)

    def close(self) -> None:
        self.recorder.close()
