"""HF rollout engine: batched sampling over any HF causal LM with a KV cache, on CPU or one GPU.

Our own decode loop (not ``model.generate``) so that the returned logprobs are exactly those of the
distribution sampled from, computed the same way as the trainer's forward pass: at temperature 1
with no top-k/top-p they match ``TorchTrainer.forward_logprobs`` to float noise.

Concurrency model: ``generate`` is ``async`` but computes synchronously, one decode step at a time,
yielding to the event loop between steps. Other calls on the same loop (``pause``, ``health``,
``update_weights``, another ``generate``) therefore run at token boundaries. A lock around each step
makes the same true for calls from other threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from relax.core.engines.sampling import sample_tokens, sampling_logprobs
from relax.core.protocols import GenerationRequest, GenerationResult

_PAUSE_POLL_S = 0.005


class HFRolloutEngine:
    """``RolloutEngine`` over ``AutoModelForCausalLM``.

    ``max_batch_size`` caps how many requests decode together (larger lists run in chunks).
    Requests without a seed draw one from the engine's generator (seeded by ``seed``).
    Generation stops at the model's EOS ids (generation config and tokenizer; unless ``ignore_eos``) in addition
    to each request's ``stop_token_ids``; the stop token is kept in ``response_ids``.
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 256,
        seed: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
        self.model.to(self.device).eval().requires_grad_(False)
        self._params = dict(self.model.state_dict())  # views sharing storage with the live model
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
            "model_path": self.model_path,
        }

    def update_weights(
        self, named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Copy (a subset of) HF-named weights into the model and set the weight version.

        Names and shapes are all checked before anything is written, so a bad update changes
        nothing. Called once per bucket, the version is simply set again.
        """
        items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        unknown = sorted(name for name, _ in items if name not in self._params)
        if unknown:
            raise KeyError(f"update_weights: unknown parameter names {unknown} (model {self.model_path})")
        bad = [
            f"{n}: {tuple(t.shape)} != {tuple(self._params[n].shape)}"
            for n, t in items
            if tuple(t.shape) != tuple(self._params[n].shape)
        ]
        if bad:
            raise ValueError(f"update_weights: shape mismatch {bad}")
        with self._step_lock, torch.no_grad():
            for name, tensor in items:
                self._params[name].copy_(tensor)
            self._version = version

    # --------------------------------------------------------------- generation
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self._count_lock:
            self._in_flight += 1
        try:
            results: list[GenerationResult] = []
            abort_epoch = self._abort_epoch  # an abort ends this whole call, not just the running chunk
            for start in range(0, len(requests), self.max_batch_size):
                results += await self._generate_batch(requests[start : start + self.max_batch_size], abort_epoch)
            return results
        finally:
            with self._count_lock:
                self._in_flight -= 1

    def _uniforms(self, request: GenerationRequest, steps: int) -> torch.Tensor:
        """Per-request uniforms; a resumed request skips those its prefix already used."""
        seed = request.params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        gen = torch.Generator().manual_seed(seed)
        # drawn from the request alone (not the batch), so its tokens do not depend on its neighbours
        drawn = torch.rand(request.params.max_new_tokens, generator=gen, dtype=torch.float64)
        drawn = drawn[len(request.prefix_response_ids) :]
        padded = torch.zeros(steps, dtype=torch.float64)
        padded[: len(drawn)] = drawn
        return padded

    async def _forward(self, **inputs: Any) -> tuple[Any, int]:
        """One model call at a token boundary, and the weight version it used. Waits while paused;
        the pause check and the call hold the step lock together, so nothing runs after ``pause``."""
        while True:
            while not self._running.is_set():
                await asyncio.sleep(_PAUSE_POLL_S)
            with self._step_lock:
                if self._running.is_set():
                    with torch.no_grad():
                        return self.model(**inputs), self._version

    async def _generate_batch(self, reqs: list[GenerationRequest], abort_epoch: int) -> list[GenerationResult]:
        bsz = len(reqs)
        budgets = [max(0, r.params.max_new_tokens - len(r.prefix_response_ids)) for r in reqs]
        steps = max(budgets, default=0)
        new_ids: list[list[int]] = [[] for _ in reqs]
        new_lps: list[list[float]] = [[] for _ in reqs]
        new_vers: list[list[int]] = [[] for _ in reqs]
        finish = ["length" if b == 0 else "" for b in budgets]
        if steps == 0:
            return [self._result(r, [], [], [], f) for r, f in zip(reqs, finish, strict=True)]

        dev = self.device
        temperature = torch.tensor([r.params.temperature for r in reqs], device=dev)
        top_k = torch.tensor([r.params.top_k for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        uniforms = torch.stack([self._uniforms(r, steps) for r in reqs]).to(dev)
        stop_ids = [(frozenset() if r.params.ignore_eos else self.eos_token_ids) | set(r.params.stop_token_ids) for r in reqs]

        prompts = [list(r.prompt_ids) + list(r.prefix_response_ids) for r in reqs]
        width = max(len(p) for p in prompts)
        input_ids = torch.full((bsz, width), self.pad_token_id, dtype=torch.long)
        attention = torch.zeros((bsz, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention[i, width - len(p) :] = 1
        input_ids, attention = input_ids.to(dev), attention.to(dev)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)

        out, logits_version = await self._forward(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        cache, logits = out.cache, out.logits[:, -1]
        next_pos = positions[:, -1] + 1

        for t in range(steps):
            lps = sampling_logprobs(logits, temperature, top_k, top_p)
            tokens = sample_tokens(lps, uniforms[:, t], temperature <= 0, logits)
            token_lps = lps.gather(-1, tokens[:, None]).squeeze(-1).tolist()
            for i, tok in enumerate(tokens.tolist()):
                if finish[i]:
                    continue
                new_ids[i].append(tok)
                new_lps[i].append(token_lps[i])
                new_vers[i].append(logits_version)
                finish[i] = self._finish_reason(reqs[i], new_ids[i], tok, stop_ids[i], budgets[i])
            if all(finish):
                break
            fed = torch.tensor(
                [self.pad_token_id if f else tok for f, tok in zip(finish, tokens.tolist(), strict=True)],
                device=dev,
            )
            attention = torch.cat([attention, attention.new_ones((bsz, 1))], dim=1)
            await asyncio.sleep(0)  # token boundary: let pause/update/health calls in
            if self._abort_epoch != abort_epoch:
                finish = [f or "abort" for f in finish]
                break
            out, logits_version = await self._forward(
                input_ids=fed[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                cache=cache,
                use_cache=True,
            )
            cache, logits = out.cache, out.logits[:, -1]
            next_pos = next_pos + 1
        return [self._result(*args) for args in zip(reqs, new_ids, new_lps, new_vers, finish, strict=True)]

    def _finish_reason(
        self, req: GenerationRequest, ids: list[int], tok: int, stop_ids: set[int], budget: int
    ) -> str:
        if tok in stop_ids:
            return "stop"
        if req.params.stop:
            text = self.tokenizer.decode(list(req.prefix_response_ids) + ids, skip_special_tokens=True)
            if any(s in text for s in req.params.stop):
                return "stop"
        return "length" if len(ids) >= budget else ""

    def _result(
        self, req: GenerationRequest, ids: list[int], lps: list[float], vers: list[int], reason: str
    ) -> GenerationResult:
        response = list(req.prefix_response_ids) + ids
        return GenerationResult(
            request_id=req.request_id,
            response_ids=response,
            logprobs=list(req.prefix_logprobs) + lps,
            versions=list(req.prefix_versions) + vers,
            finish_reason=reason,
            text=self.tokenizer.decode(response, skip_special_tokens=True),
        )
