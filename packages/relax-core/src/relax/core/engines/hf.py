"""HF rollout engine: continuous batching over any HF causal LM with a KV cache, on CPU or one GPU.

Our own decode loop (not ``model.generate``) so that the returned logprobs are exactly those of the
distribution sampled from, computed the same way as the trainer's forward pass: at temperature 1
with no top-k/top-p they match ``TorchTrainer.forward_logprobs`` to float noise.

Throughput (see ``bench/engine.py``): requests wait in a queue and join the running batch as soon
as a slot is free; each distinct context is prefilled once, its KV cache shared by the G samples
of a group and its last logits giving each of them its first token (no decode step for it); a finished row leaves the batch and the cache at once, so a long tail neither holds
idle slots nor costs work for rows that are done. Sampling uses per-request uniforms drawn from the
request's seed, so a request's tokens do not depend on which others share its batch.

Multi-turn rollouts send each turn as a new request whose prompt is the previous turn's prompt,
response and observation. With ``prefix_cache_mb`` the engine keeps finished requests' KV
(``engines.prefix_cache``) and prefills only what follows the longest kept sequence a prompt starts
with (same tokens and logprobs as a full prefill, within float noise).

A model whose KV cache cannot be cut row by row (sliding-window or linear-attention layers) decodes
each call's requests in static batches instead (``engines.static``), said once in the log; requests
with media decode group by group through the model's adapter (``engines.multimodal``).

Concurrency model: ``generate`` is ``async`` but computes synchronously, one decode step at a time,
yielding to the event loop between steps. Other calls on the same loop (``pause``, ``health``,
``update_weights``, another ``generate``) therefore run at token boundaries. A lock around each step
makes the same true for calls from other threads.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import Counter, deque
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from relax.core.engines import kv_batch, weight_names
from relax.core.engines.batcher import DecodeBatch, Row, row_sampling_params
from relax.core.engines.lora_merge import AdapterMerger
from relax.core.engines.prefill import Prefilled, forward_prefixes, forward_suffixes
from relax.core.engines.prefix_cache import PrefixCache
from relax.core.engines.routing import EngineRouting
from relax.core.engines.sampling import sample_tokens, sampling_logprobs
from relax.core.protocols import GenerationRequest, GenerationResult

_PAUSE_POLL_S = 0.005
log = logging.getLogger(__name__)


class HFRolloutEngine:
    """``RolloutEngine`` over ``AutoModelForCausalLM`` (or a media model's registered adapter,
    ``relax.core.multimodal_model``).

    ``max_batch_size`` caps how many requests decode together (the others wait for a free slot).
    Requests without a seed draw one from the engine's generator (seeded by ``seed``).
    Generation stops at the model's EOS ids (generation config and tokenizer; unless ``ignore_eos``) in
    addition to each request's ``stop_token_ids``; the stop token is kept in ``response_ids``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
        model: Any = None,
        tokenizer: Any = None,
        prefix_cache_mb: float = 0.0,
        record_routing: bool = False,
    ) -> None:
        """``model`` / ``tokenizer``: serve these (already placed) objects instead of loading
        ``model_path`` -- a trainer-hosted engine serves the trainer's own module (``engines.hosted``).
        ``prefix_cache_mb``: memory for finished requests' KV caches (0: none kept), see ``engines.prefix_cache``.
        ``record_routing``: return each request's MoE routing (``engines.routing``; keeps no prefix cache)."""
        from transformers import AutoTokenizer

        from relax.core.multimodal_model import load_model

        self.model_path = model_path
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.media_kv_cache = True  # False: media requests take a full forward per token (the reference path)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(model_path)
        self._owns_model = model is None  # a hosted engine's module is the trainer's: never moved from here
        if model is None:
            model = load_model(model_path, dtype)  # a media model loads through its registered adapter
            model.to(self.device).eval().requires_grad_(False)
        self.model = model
        # sliding-window / linear-attention caches cannot be cut row by row: such a model decodes in static batches
        self.continuous_batching = kv_batch.movable(self.model.config)
        if not self.continuous_batching:
            log.info(
                "HF engine: %s (%s) keeps a sliding-window or linear-attention KV cache; decoding in static "
                "batches instead of continuous batching",
                model_path,
                getattr(self.model.config, "model_type", "?"),
            )
        self._params = dict(self.model.state_dict())  # views sharing storage with the live model
        self._expert_rules: list[weight_names.ExpertRule] | None = None  # read on a first unknown name
        self._adapters = AdapterMerger()  # LoRA syncs: adapters merged into the served weights
        eos = self.model.generation_config.eos_token_id
        eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            eos_ids.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos_ids)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = pad if pad is not None else min(self.eos_token_ids, default=0)
        self._seeds = torch.Generator().manual_seed(seed)
        self._version = 0
        self._running = threading.Event()
        self._running.set()
        self._step_lock = threading.Lock()
        self._count_lock = threading.Lock()
        self._in_flight = 0
        self._abort_epoch = 0
        self._batch = DecodeBatch(self.device)
        self._waiting: deque[Row] = deque()
        self._waiting_contexts: Counter[tuple[int, ...]] = Counter()  # context[:-1] of waiting rows
        self._prefixes: dict[tuple[int, ...], kv_batch.Layers] = {}  # their prefills, once computed
        self._prefix_cache = PrefixCache(
            0 if record_routing else int(prefix_cache_mb * 2**20)
        )  # finished requests' KV
        self._routing = EngineRouting(self.model) if record_routing else None  # MoE routing replay
        # work done, for tests and benchmarks: a decode row yields exactly one token
        self.stats = {"prefill_rows": 0, "prefill_tokens": 0, "decode_steps": 0, "decode_rows": 0}

    # ------------------------------------------------------------------ control
    def weight_version(self) -> int:
        return self._version

    def pause(self) -> None:
        """Stop decoding at the next token boundary; in-flight ``generate`` calls wait (they keep
        their KV cache and continue on ``resume``). When this returns no decode step is running,
        so weights can be swapped safely."""
        self._running.clear()
        with self._step_lock:  # wait out a step running in another thread
            pass

    def resume(self) -> None:
        self._running.set()

    def abort(self) -> None:
        """End every in-flight ``generate`` at its next token boundary with finish reason ``"abort"``
        (tokens so far are returned, so a caller may resubmit from scratch or continue the prefix)."""
        self._abort_epoch += 1

    def release_memory(self) -> None:
        """``rollout.release_memory``: drop cached prefills and, on an accelerator, move the weights to host
        memory until :meth:`resume_memory` (a hosted engine's module is the trainer's and stays)."""
        with self._step_lock:
            self._prefixes.clear()
            self._prefix_cache.clear()
            if self._owns_model and self.device.type != "cpu":
                self.model.to("cpu")
                self._params = dict(self.model.state_dict())
                self._adapters.to("cpu")
                getattr(torch, self.device.type).empty_cache()

    def resume_memory(self) -> None:
        with self._step_lock:
            if self._owns_model and next(self.model.parameters()).device != self.device:
                self.model.to(self.device)
                self._params = dict(self.model.state_dict())
                self._adapters.to(self.device)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the served weights, by HF name (to verify a weight sync)."""
        with self._step_lock:
            return {name: tensor.detach().clone() for name, tensor in self._params.items()}

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "weight_version": self._version,
            "paused": not self._running.is_set(),
            "in_flight": self._in_flight,
            "running": len(self._batch),
            "waiting": len(self._waiting),
            "model_path": self.model_path,
            **self._prefix_cache.stats(),
        }

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy (a subset of) HF-named weights into the model and set the weight version.

        Per-expert MoE names (``mlp.experts.3.gate_proj.weight``, as checkpoints, SGLang and the megatron
        trainer name them) fill their slice of the fused expert tensors transformers keeps in memory
        (``engines.weight_names``). Names and shapes are all checked before anything is written, so a
        bad update changes nothing. Called once per bucket, the version is simply set again.
        LoRA adapter tensors (``<module>.lora_A.weight`` / ``.lora_B.weight``) are merged into their
        module's weight (``engines.lora_merge``).
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        items, adapters, bad_adapters = self._adapters.split(items, self._params)
        if self._expert_rules is None and any(name not in self._params for name, _ in items):
            self._expert_rules = weight_names.expert_rules(self.model)
        pairs, unknown, bad = weight_names.resolve(items, self._params, self._expert_rules or [])
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown} (model {self.model_path})")
        if bad or bad_adapters:
            raise ValueError(f"update_weights: shape mismatch {bad + bad_adapters}")
        with self._step_lock, torch.no_grad():
            for dest, tensor in pairs:
                dest.copy_(tensor)
            self._adapters.apply(adapters, self._params)
            self._version = version
            self._prefixes.clear()  # kept prefills are of the old weights
            self._prefix_cache.clear()

    # --------------------------------------------------------------- generation
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Queue ``requests`` and drive decode steps until they have all finished.

        Every concurrent caller (coroutine or thread) drives the same shared batch: a step advances
        every live row, whoever runs it, so requests of different calls decode together.
        """
        epoch = self._abort_epoch  # an abort ends this whole call, queued requests included
        rows = [self._row(r, epoch) for r in requests]
        if any(r.media is not None for r in requests):
            from relax.core.engines.multimodal import media_groups

            return await self._generate_apart(
                rows, epoch, media_groups(rows, self.device, self.media_kv_cache)
            )
        if not self.continuous_batching:
            from relax.core.engines.static import static_batches

            batches = static_batches(rows, self.max_batch_size, self.pad_token_id, self.device)
            return await self._generate_apart(rows, epoch, batches)
        with self._count_lock:
            self._in_flight += 1
        try:
            with self._step_lock:
                for r in rows:
                    if not r.finish:
                        self._waiting.append(r)
                        self._waiting_contexts[tuple(r.context)] += 1
            while not all(r.finish for r in rows):
                # a bounded wait: while another caller steps (for these rows too), notice they are done
                if not self._step_lock.acquire(timeout=_PAUSE_POLL_S):
                    await asyncio.sleep(0)
                    continue
                stepped = False
                try:
                    if self._abort_epoch != epoch:
                        for r in rows:
                            r.finish = r.finish or "abort"
                        self._forget_finished()
                    elif self._running.is_set() and not all(r.finish for r in rows):
                        self._step()
                        stepped = True
                finally:
                    self._step_lock.release()
                await asyncio.sleep(0 if stepped else _PAUSE_POLL_S)  # token boundary: let other calls in
        finally:
            if not all(r.finish for r in rows):  # cancelled or failed: its rows leave the queue and batch
                for r in rows:
                    r.finish = r.finish or "abort"
                with self._step_lock:
                    self._forget_finished()
            with self._count_lock:
                self._in_flight -= 1
        failed = next((r.error for r in rows if r.error is not None), None)
        if failed is not None:
            message = f"generate: a decode step shared with other calls failed: {failed!r}"
            raise RuntimeError(message) from failed
        return [self._result(r) for r in rows]

    async def _generate_apart(self, rows: list[Row], epoch: int, groups: list[Any]) -> list[GenerationResult]:
        """Decode ``rows`` outside the shared batch, group by group: requests carrying processed media
        (``engines.multimodal``) and every request of a model whose cache cannot be cut row by row
        (``engines.static``). Each group's ``step(model, version, sample)`` runs under the step lock, at
        token boundaries like the shared batch's, honouring pause and abort."""
        with self._count_lock:
            self._in_flight += 1
        try:
            for group in groups:
                while not group.done() and self._abort_epoch == epoch:  # an abort: finally marks the rest
                    if not self._running.is_set():
                        await asyncio.sleep(_PAUSE_POLL_S)
                        continue
                    with self._step_lock:
                        group.step(self.model, self._version, self._sample)
                    await asyncio.sleep(0)
        finally:
            for r in rows:
                r.finish = r.finish or "abort"
            with self._count_lock:
                self._in_flight -= 1
        return [self._result(r) for r in rows]

    def _forget_finished(self) -> None:
        """Drop finished (aborted) rows from the batch and the queue, with their kept prefills."""
        self._drop_finished()
        self._waiting = deque(r for r in self._waiting if not r.finish)
        self._waiting_contexts = Counter(tuple(r.context) for r in self._waiting)
        for key in [k for k in self._prefixes if k not in self._waiting_contexts]:
            del self._prefixes[key]

    def _row(self, request: GenerationRequest, epoch: int) -> Row:
        if not request.prompt_ids and not request.prefix_response_ids:
            raise ValueError(f"generate: request {request.request_id!r} has no prompt_ids (and no prefix)")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = [t for t in (*request.prompt_ids, *request.prefix_response_ids) if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"generate: request {request.request_id!r} has token ids outside [0, {vocab}): {bad[:5]}"
            )
        p = request.params
        stop_ids = (frozenset() if p.ignore_eos else self.eos_token_ids) | frozenset(p.stop_token_ids)
        row = Row(request, self._uniforms(request), stop_ids, epoch)
        if row.budget == 0:
            row.finish = "length"
        return row

    def _uniforms(self, request: GenerationRequest) -> list[float]:
        """Per-request uniforms, one per token left to sample; a resumed request skips those its
        prefix already used. Drawn from the request alone (not the batch), so its tokens do not
        depend on its neighbours."""
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        gen = torch.Generator().manual_seed(seed)
        drawn = torch.rand(request.params.max_new_tokens, generator=gen, dtype=torch.float64)
        return drawn[len(request.prefix_response_ids) :].tolist()

    def _step(self) -> None:
        """One token for every live row; rows joining now also take their first from their
        context's prefill (the caller holds the step lock and checked for pause).

        If the step fails, every row in it ends with the error (their callers raise it) and the
        batch starts afresh; requests still queued are unaffected.
        """
        joining: list[Row] = []
        done_with: list[tuple[int, ...]] = []
        try:
            self._drop_finished()  # aborted or cancelled rows
            joining, done_with = self._take_waiting(self.max_batch_size - len(self._batch))
            self._decode(joining)
        except Exception as exc:
            for row in [*self._batch.rows, *joining]:
                row.error, row.finish = exc, row.finish or "abort"
            self._batch = DecodeBatch(self.device)
            raise
        finally:
            for key in done_with:  # prefilled in this step if needed; no queued row needs them now
                self._prefixes.pop(key, None)

    def _take_waiting(self, free: int) -> tuple[list[Row], list[tuple[int, ...]]]:
        """Up to ``free`` queued rows, oldest first, and the contexts no queued row has any more."""
        joining, done_with = [], []
        while free > len(joining) and self._waiting:
            row = self._waiting.popleft()
            key = tuple(row.context)
            self._waiting_contexts[key] -= 1
            if not self._waiting_contexts[key]:
                del self._waiting_contexts[key]
                done_with.append(key)
            if not row.finish:
                joining.append(row)
        return joining, done_with

    def _decode(self, joining: list[Row]) -> None:
        batch = self._batch
        if joining:
            cache, logits = self._prefill(joining)
            if self._routing is not None:
                self._routing.joined(joining, self._waiting_contexts)
            self._sample(joining, logits)
            batch.join(joining, cache)
            self._drop_finished()  # done after their first token
        if not len(batch):
            return
        with torch.no_grad():
            out = self.model(**batch.decode_inputs())
        if self._routing is not None:
            self._routing.stepped(batch.rows)
        tokens = self._sample(batch.rows, out.logits[:, -1], batch.sampling_params())
        batch.advance(out.cache, tokens)
        self._drop_finished()

    def _drop_finished(self) -> None:
        """Drop finished rows from the batch; with a prefix cache, first keep the KV of those that
        completed (stop or length) with the current weights throughout and that a later request will
        continue (``GenerationRequest.continues``): their context and all but the last sampled token,
        whose KV no step has computed."""
        batch = self._batch
        if self._prefix_cache.enabled and batch.cache is not None:
            for i, row in enumerate(batch.rows):
                if (
                    row.request.continues
                    and row.finish in ("stop", "length")
                    and row.versions
                    and row.versions[0] == self._version
                ):
                    tokens = row.context + row.ids[:-1]
                    layers = kv_batch.own_row_layers(batch.cache, i, len(tokens))
                    self._prefix_cache.put(tokens, layers, self._version)
        batch.drop_finished()

    def _sample(
        self,
        rows: list[Row],
        logits: torch.Tensor,
        params: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One token per row from its next-token ``logits`` (row order), with its logprob, version
        and finish reason; ``params``: the rows' (temperature, top_k, top_p) if already built."""
        temperature, top_k, top_p = params or row_sampling_params(rows, logits.device)
        lps = sampling_logprobs(logits, temperature, top_k, top_p)
        uniforms = torch.tensor([r.uniforms[len(r.ids)] for r in rows], dtype=torch.float64)
        tokens = sample_tokens(lps, uniforms.to(logits.device), temperature <= 0, logits)
        token_lps = lps.gather(-1, tokens[:, None]).squeeze(-1).tolist()
        for row, tok, lp in zip(rows, tokens.tolist(), token_lps, strict=True):
            row.ids.append(tok)
            row.logprobs.append(lp)
            row.versions.append(self._version)
            row.finish = self._finish_reason(row, tok)
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(rows)
        return tokens

    def _prefill(self, rows: list[Row]) -> tuple[Any, torch.Tensor]:
        """KV cache of each row's context (row order) and the logits after it: computed once per
        distinct context and kept while requests with that context still wait, so the G samples of
        a group share one prefill even when they join at different steps."""
        keys = [tuple(r.context) for r in rows]
        fresh = {k: self._prefixes.get(k) for k in keys}
        missing = [k for k, kv in fresh.items() if kv is None]
        if missing:
            fresh.update(self._forward_contexts(missing))
        for k in missing:
            if self._waiting_contexts[k] > 0:
                self._prefixes[k] = fresh[k]
        return kv_batch.stack_rows([fresh[k][0] for k in keys]), torch.stack([fresh[k][1] for k in keys])

    def _forward_contexts(self, contexts: list[tuple[int, ...]]) -> Prefilled:
        """Prefill ``contexts``: those starting with a sequence in the prefix cache only from there."""
        cache = self._prefix_cache
        hits = {c: cache.longest_prefix(c, self._version) for c in contexts} if cache.enabled else {}
        cold = [c for c in contexts if hits.get(c) is None]
        warm = [(c, hit) for c, hit in hits.items() if hit is not None]
        out: Prefilled = {}
        if cold:
            out, input_ids = forward_prefixes(self.model, self.device, self.pad_token_id, cold)
            if self._routing is not None:
                self._routing.prefilled(cold, input_ids)
        if warm:
            out.update(forward_suffixes(self.model, self.device, self.pad_token_id, warm))
        self.stats["prefill_rows"] += len(contexts)
        self.stats["prefill_tokens"] += sum(len(c) for c in cold) + sum(len(c) - h.length for c, h in warm)
        return out

    def _finish_reason(self, row: Row, tok: int) -> str:
        if tok in row.stop_ids:
            return "stop"
        if row.request.params.stop:
            response = list(row.request.prefix_response_ids) + row.ids
            text = self.tokenizer.decode(response, skip_special_tokens=True)
            if any(s in text for s in row.request.params.stop):
                return "stop"
        return "length" if len(row.ids) >= row.budget else ""

    def _result(self, row: Row) -> GenerationResult:
        req = row.request
        response = list(req.prefix_response_ids) + row.ids
        return GenerationResult(
            request_id=req.request_id,
            response_ids=response,
            logprobs=list(req.prefix_logprobs) + row.logprobs,
            versions=list(req.prefix_versions) + row.versions,
            finish_reason=row.finish,
            text=self.tokenizer.decode(response, skip_special_tokens=True),
            routed_experts=EngineRouting.result(row, len(row.context) + len(row.ids)),  # None unless recorded
        )
