"""Media models on megatron-core: the HF "media front" feeds megatron's language model. Which media models, and
where the front finds its parts, their family's model adapter declares (``ModelAdapter.megatron_media``:
``relax.core.model_family.MediaTowerHooks``; relax-omni's for the Qwen VL / Omni thinkers).

Only the language model runs in megatron (a GPTModel with 3-D rotary, :mod:`relax.megatron.convert`). The
towers, the placeholder scatter and the 3-D rope index stay transformers' own code, so they are exactly
what the torch trainer and the HF engine compute: the HF model is loaded through the family's model
adapter, its decoder layers and LM head are dropped, its text embedding is replaced by megatron's
(vocab-parallel) word embedding, and its language model by a stub that captures what HF would have fed
it (``inputs_embeds``, the 3-D ``position_ids`` and, with DeepStack, ``visual_pos_masks`` /
``deepstack_visual_embeds``) and stops the forward there. Megatron then runs on those, right-padded
(:mod:`relax.megatron.padding`), with:

* :class:`MultiAxisRotary` as the rotary module: HF's frequency -> (T, H, W) axis map (chunked, or
  interleaved; megatron's own ``MultimodalRotaryEmbedding`` only chunks) and HF's inverse frequencies;
* forward hooks on the first decoder layers that add DeepStack's visual embeddings after each of them.

MoE experts fused in transformers' memory are split per expert for :mod:`relax.megatron.moe` (and exported
per expert, as checkpoints hold them).

The towers are HF modules on the first pipeline stage, replicated per TP rank (each computes the same, full
gradients), trainable unless frozen; later stages keep only HF's rope index for their positions (from the
whole batch every stage receives). Weight names: the in-memory HF names the torch trainer exports.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from relax.core.model_family import MediaTowerHooks
from relax.core.trainers import sharded_load

Tensor = torch.Tensor

MEGATRON_LM_PREFIX = "model."  # the names :mod:`relax.megatron.convert` speaks
FUSED_EXPERTS = (
    "gate_up_proj"  # transformers' in-memory MoE experts: ``mlp.experts.gate_up_proj`` / ``down_proj``
)


def is_media_model(hf_config: Any) -> bool:
    """Whether the checkpoint takes media (a registered media model adapter, as core decides)."""
    from relax.core.multimodal_model import adapter_for

    return adapter_for(getattr(hf_config, "model_type", None)) is not None


def hooks(hf_config: Any) -> MediaTowerHooks | None:
    """The media front's parts in the family's HF model (None: the family does not run on megatron)."""
    from relax.core.multimodal_model import adapter_for

    declared = getattr(adapter_for(hf_config.model_type), "megatron_media", None)
    return None if declared is None else declared(hf_config)


def check_supported(hf_config: Any, distributed_optimizer: bool = False) -> None:
    """Refuse, naming the model type or field, a media model or layout the megatron trainer cannot run yet."""
    family = hf_config.model_type
    if hooks(hf_config) is None:
        raise ValueError(
            f"model_type {family!r}: its model adapter declares no megatron media front "
            "(ModelAdapter.megatron_media), so the megatron trainer cannot run it yet; use "
            "trainer.backend: torch (or fsdp) for this model"
        )
    if distributed_optimizer:  # megatron's DDP buffers hold megatron's parameters, not the HF towers
        raise ValueError(
            f"{family} on the megatron trainer: trainer.backend_params.distributed_optimizer is not "
            "supported for media models yet (bf16 trains with fp32 master weights without it)"
        )


def lm_config(hf_config: Any) -> Any:
    """The language model's HF config, as the family's adapter derives it (``megatron_lm_config``)."""
    from relax.core.multimodal_model import adapter_for

    return adapter_for(hf_config.model_type).megatron_lm_config(hf_config)


def lm_state(hf_state: dict[str, Tensor], lm_prefix: str) -> dict[str, Tensor]:
    """The LM weights (under ``lm_prefix``) of an in-memory HF state dict under the names
    :mod:`relax.megatron.convert` reads."""
    out = {
        MEGATRON_LM_PREFIX + n[len(lm_prefix) :]: t for n, t in hf_state.items() if n.startswith(lm_prefix)
    }
    for name in [n for n in out if n.endswith(FUSED_EXPERTS)]:  # MoE: per expert, as checkpoints
        layer = name[: -len(FUSED_EXPERTS)]
        gate_up, down = out.pop(name), out.pop(layer + "down_proj")
        for j, (fused, d) in enumerate(zip(gate_up, down, strict=True)):
            gate, up = fused.chunk(2, 0)
            out.update(
                {
                    f"{layer}{j}.gate_proj.weight": gate,
                    f"{layer}{j}.up_proj.weight": up,
                    f"{layer}{j}.down_proj.weight": d,
                }
            )
    if "lm_head.weight" in hf_state:
        out["lm_head.weight"] = hf_state["lm_head.weight"]
    return out


def empty_front(model_path: str) -> tuple[Any, tuple[Any, Any] | None]:
    """The media model with its parameters on meta and (checkpoint, plan) to read them from; (None, None)
    where its adapter has no ``load_empty`` or the checkpoint is not mapped tensor by tensor."""
    from relax.core.safetensors_files import Checkpoint

    hf, key_mapping = sharded_load.empty_model(model_path, "float32")
    if hf is None or not any(Path(model_path).glob("*.safetensors")):
        return None, None
    checkpoint = Checkpoint(model_path)
    plan = sharded_load.Plan(hf, checkpoint.names(), key_mapping)
    return (hf, (checkpoint, plan)) if not sharded_load.uncovered(hf, plan) else (None, None)


def lm_checkpoint(checkpoint: Any, plan: Any, lm_prefix: str) -> Any:
    """``checkpoint`` seen under the names :mod:`relax.megatron.convert` reads (:func:`lm_state`'s: the LM's
    weights only, experts per expert as on disk); nothing is read."""
    view = copy.copy(checkpoint)
    view.entries = {}
    for name, renamed in plan.renamed.items():
        if renamed.startswith(lm_prefix):
            view.entries[MEGATRON_LM_PREFIX + renamed[len(lm_prefix) :]] = checkpoint.entries[name]
        elif renamed == "lm_head.weight":
            view.entries[renamed] = checkpoint.entries[name]
    return view


def hf_name(name: str, lm_prefix: str | None) -> str:
    """A name :func:`relax.megatron.convert.megatron_to_hf` writes -> the media checkpoint's HF name (``lm_prefix``
    None: a text model's, unchanged)."""
    if lm_prefix is None or not name.startswith(MEGATRON_LM_PREFIX):
        return name
    return lm_prefix + name[len(MEGATRON_LM_PREFIX) :]


def frequency_axes(section: tuple[int, ...], interleaved: bool) -> Tensor:
    """(head_dim / 2,) M-RoPE axis (0 T, 1 H, 2 W) of each rotary frequency, as HF assigns them: chunks of
    ``section`` (Qwen2.5-VL) or, interleaved (Qwen3-VL), H at 1, 4, .. < 3 * section[1] and W at
    2, 5, .. < 3 * section[2], T elsewhere."""
    total = sum(section)
    if not interleaved:
        return torch.repeat_interleave(torch.arange(3), torch.tensor(section))
    axes = torch.zeros(total, dtype=torch.long)
    for axis in (1, 2):
        axes[axis : section[axis] * 3 : 3] = axis
    return axes


def freeze(front: MediaFront | None, hf_config: Any, **switches: bool) -> None:
    """Keep the towers the ``trainer.backend_params`` switches pick as loaded (core's ``kinds_to_freeze``:
    ``freeze_media_towers`` every kind, ``freeze_vision`` / ``freeze_audio`` one, which the checkpoint must
    have: a text model (no ``front``) has none): no gradient, and :meth:`MediaFront.tower_parameters` tells
    the trainer which to leave out of training and exports."""
    from relax.core.multimodal_model import freeze_towers, kinds_to_freeze

    kinds = kinds_to_freeze(front.tower_kinds if front is not None else (), hf_config.model_type, **switches)
    if front is not None:
        front.frozen = freeze_towers(front.hf, kinds)


class MultiAxisRotary(torch.nn.Module):
    """megatron's rotary module for a GPTModel with 3-D rotary positions: (3, B, S) positions
    -> (S, B, 1, head_dim) angles, each frequency taking its HF axis (:func:`frequency_axes`)."""

    def __init__(self, inv_freq: Tensor, section: tuple[int, ...], interleaved: bool) -> None:
        super().__init__()
        if sum(section) != inv_freq.numel():
            raise ValueError(
                f"the 3-D rotary section {list(section)} must sum to head_dim / 2 = {inv_freq.numel()}"
            )
        self.register_buffer("inv_freq", inv_freq.float().clone(), persistent=False)
        self.register_buffer("axes", frequency_axes(section, interleaved), persistent=False)

    def forward(self, position_ids: Tensor, *_section_and_group: Any, **_keywords: Any) -> Tensor:
        freqs = position_ids[..., None].float() * self.inv_freq.to(
            position_ids.device
        )  # (3, B, S, D/2), as HF
        index = self.axes.to(freqs.device).view(1, 1, 1, -1).expand(1, *freqs.shape[1:])
        picked = freqs.gather(0, index)[0]  # (B, S, D/2)
        return torch.cat([picked, picked], -1).transpose(0, 1)[:, :, None, :].contiguous()


class _Captured(Exception):  # noqa: N818 - control flow, not an error: the HF forward stops at the LM
    def __init__(self, kwargs: dict[str, Any]) -> None:
        super().__init__("captured")
        self.kwargs = kwargs


class _LanguageModelStub(torch.nn.Module):
    """Stands in for HF's language model: captures its inputs and stops the forward."""

    def forward(self, **kwargs: Any) -> Any:
        raise _Captured(kwargs)


class _WholeSequenceEmbedding:
    """megatron's vocab-parallel embedding as HF's front calls it, under sequence parallelism too: the
    lookup all-reduced over TP for the whole sequence (B, S, H), not reduce-scattered into megatron's
    (S / TP, B, H) slices (:meth:`MediaFront.lm_forward` scatters the merged embeddings itself)."""

    def __init__(self, embed: Any) -> None:
        self.embed = embed

    @property
    def weight(self) -> Tensor:
        return self.embed.weight

    def __call__(self, input_ids: Tensor) -> Tensor:
        saved, self.embed.reduce_scatter_embeddings = self.embed.reduce_scatter_embeddings, False
        try:
            return self.embed(input_ids)
        finally:
            self.embed.reduce_scatter_embeddings = saved


class MediaFront(torch.nn.Module):
    """The HF model's outer part (towers, scatter, rope index) on top of a megatron GPTModel.

    First stage: :meth:`inputs` gives megatron's ``decoder_input`` and M-RoPE positions of the right-padded
    rows (and DeepStack's embeddings, which hooks add while :meth:`deepstack` is entered); a later stage
    only computes the positions (:meth:`positions`).
    """

    def __init__(self, model_path: str, gpt_model: Any, hf_config: Any, first_stage: bool = True) -> None:
        super().__init__()
        from relax.core.multimodal_model import adapter_for, tower_kinds
        from relax.megatron.convert import Dims

        # built empty (the adapter's load_empty): the towers are read below, the LM's weights by each rank's
        # load_rank (take_lm_weights); an adapter without one loads the whole model (its LM weights kept)
        hf, plan = empty_front(model_path)
        hf = hf if hf is not None else adapter_for(hf_config.model_type).load(model_path, torch.float32)
        self.hooks = parts = hooks(hf_config)
        self.tower_kinds = tower_kinds(hf)  # the checkpoint's, on every stage (later ones drop the towers)
        self.frozen: frozenset[str] = frozenset()  # tower kinds kept as loaded (:func:`freeze`)
        inner = hf.model
        self.hf_state = (
            lm_checkpoint(*plan, parts.lm_prefix)
            if plan
            else {n: t.detach() for n, t in hf.state_dict().items()}
        )
        inv_freq = getattr(inner, parts.language_model).rotary_emb.inv_freq
        dims = Dims.from_hf(lm_config(hf_config))
        setattr(inner, parts.language_model, _LanguageModelStub())
        hf.lm_head = torch.nn.Identity()  # never reached: the stub stops the forward
        self.first_stage = first_stage
        if first_stage:
            embed = gpt_model.embedding.word_embeddings  # the LM's one embedding: megatron's, vocab-parallel
            whole = _WholeSequenceEmbedding(
                embed
            )  # sequence parallelism: not reduce-scattered for HF's scatter
            inner.get_input_embeddings = lambda: (
                whole if embed.reduce_scatter_embeddings else embed
            )  # not a child
        else:  # a later pipeline stage only needs the rope index (its positions): no towers
            for tower in parts.towers:
                if hasattr(inner, tower):
                    setattr(inner, tower, None)
        if plan:  # what is left of the HF model (the towers, none on a later stage), read whole on each rank
            sharded_load.materialize(hf, torch.device("cpu"))
            sharded_load.fill(hf, plan[0], plan[1].only(set(hf.state_dict())))
        self.hf = hf
        # sequence parallelism (TP > 1): megatron's layers see this TP rank's slice of the sequence
        self.sequence_parallel = bool(gpt_model.config.sequence_parallel)
        self.tp = gpt_model.config.tensor_model_parallel_size
        gpt_model.rotary_pos_emb = MultiAxisRotary(inv_freq, dims.rotary_sections, dims.rotary_interleaved)
        self.deepstack_layers = min(
            parts.deepstack_layers, gpt_model.config.num_layers
        )  # HF's: one per layer there is
        self._deepstack: tuple[Tensor, list[Tensor]] | None = None
        if first_stage:
            layers = gpt_model.decoder.layers
            if self.deepstack_layers > len(layers):
                raise ValueError(
                    f"pipeline_parallel: {hf_config.model_type}'s DeepStack feeds its first "
                    f"{self.deepstack_layers} decoder layers, but the first stage holds {len(layers)}; "
                    "use fewer pipeline stages"
                )
            for i in range(self.deepstack_layers):
                layers[i].register_forward_hook(self._hook(i))

    def cast_parameters(self, dtype: torch.dtype) -> None:
        """The towers' weights in ``dtype`` (bf16 training); buffers such as rotary frequencies stay as loaded,
        as ``from_pretrained(dtype=...)`` keeps them."""
        for param in self.hf.parameters():
            param.data = param.data.to(dtype)

    def tower_parameters(self, frozen: bool | None = None) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(HF name, parameter) of the towers: everything the front holds; ``frozen`` True / False: only
        those of the kinds :func:`freeze` froze / of the others."""
        from relax.core.multimodal_model import is_tower

        named = self.hf.named_parameters()
        return (
            named
            if frozen is None
            else ((n, p) for n, p in named if is_tower(n, self.hf, self.frozen) == frozen)
        )

    def take_lm_weights(self) -> Any:
        """The LM's weights, once: a checkpoint view under the LM's names (``rank_load`` reads its rank's part),
        or those of the whole loaded model (:func:`lm_state`; the front drops its copy)."""
        state = self.__dict__.pop("hf_state")
        return state if not isinstance(state, dict) else lm_state(state, self.hooks.lm_prefix)

    def _hook(self, index: int):
        def add_visual(_module: Any, _args: Any, output: Any) -> Any:
            if self._deepstack is None:
                return output
            mask, embeds = self._deepstack
            hidden = output[0] if isinstance(output, tuple) else output
            if self.sequence_parallel:  # (S / TP, B, H): this rank's slice of the visual embeddings, added
                from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

                full = hidden.new_zeros(*mask.shape, hidden.shape[-1])  # (B, S, H), the sequence padded
                full[mask] = embeds[index].to(full.dtype)
                # backward: every rank's slice gathered, so each replicated tower gets the whole gradient
                hidden = hidden + scatter_to_sequence_parallel_region(full.transpose(0, 1).contiguous())
                return (hidden, *output[1:]) if isinstance(output, tuple) else hidden
            rows = hidden.transpose(0, 1).clone()  # (B, S, H): HF's row-major order of the masked positions
            rows[mask] = rows[mask] + embeds[index].to(rows.dtype)
            hidden = rows.transpose(0, 1).contiguous()
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return add_visual

    @contextmanager
    def deepstack(self, mask: Tensor | None, embeds: list[Tensor] | None) -> Iterator[None]:
        """While entered, the hooked decoder layers add ``embeds`` at ``mask`` (right-padded (B, S))."""
        self._deepstack = None if mask is None or not embeds else (mask, embeds)
        try:
            yield
        finally:
            self._deepstack = None

    def capture(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        """What HF's own forward feeds its language model for ``batch`` (left-padded, with media)."""
        try:
            self.hf(use_cache=False, **self._kwargs(batch))
        except _Captured as done:
            return done.kwargs
        raise RuntimeError(f"{type(self.hf).__name__} never called its language model")

    def _kwargs(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        from relax.core.data_multimodal import unpack_media
        from relax.core.multimodal_model import media_forward_kwargs

        ids, mask = batch["input_ids"], batch["attention_mask"]
        width = ids.shape[1] - batch["responses"].shape[1]
        return media_forward_kwargs(
            self.hf, ids, mask, unpack_media(batch), width, observed=batch.get("observation_mask")
        )

    def positions(self, batch: dict[str, Tensor]) -> Tensor:
        """(3, B, S) M-RoPE positions of the right-padded rows from HF's rope index alone (a later stage:
        the batch's grids and audio feature lengths, no tower runs)."""
        from relax.core.multimodal_model import model_adapter
        from relax.megatron.padding import left_pads, rotate_left

        positions = model_adapter(self.hf).rope_positions(self.hf, self._kwargs(batch))
        shift = left_pads(batch["attention_mask"])
        return rotate_left(positions.permute(1, 2, 0), shift).permute(2, 0, 1).contiguous()

    def inputs(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor | None, list[Tensor] | None]:
        """(decoder_input (S, B, H), position_ids (3, B, S), DeepStack mask (B, S), DeepStack embeds) of the
        batch's rows rotated to right padding."""
        from relax.megatron.padding import left_pads, rotate_left

        got = self.capture(batch)
        embeds, positions = got["inputs_embeds"], got["position_ids"]
        if positions.shape[0] > self.hooks.position_rows:  # a model may prepend the text positions
            positions = positions[-self.hooks.position_rows :]
        shift = left_pads(batch["attention_mask"])
        embeds = rotate_left(embeds, shift)
        positions = rotate_left(positions.permute(1, 2, 0), shift).permute(2, 0, 1)
        mask, deep = got.get("visual_pos_masks"), got.get("deepstack_visual_embeds")
        if mask is not None:
            mask = rotate_left(mask, shift)
        return embeds.transpose(0, 1).contiguous(), positions.contiguous(), mask, deep

    def lm_forward(self, model: Any, batch: dict[str, Tensor]) -> Tensor:
        """This stage's megatron forward (``model``) of a media model's rows, right-padded: the front gives the
        LM's input embeddings and M-RoPE positions (a later stage, fed hidden states by the previous one, only
        the positions); a micro-batch without media takes megatron's embedding and the batch's positions on
        all three axes (what HF does for text rows given 2-D positions)."""
        from relax.core.data_multimodal import has_media
        from relax.megatron.padding import pad_to_multiple, right_padded

        input_ids, position_ids = right_padded(batch)
        width, tp = input_ids.shape[1], self.tp if self.sequence_parallel else 1
        input_ids = pad_to_multiple(input_ids, 1, tp)  # sequence parallelism: the logits cut again below
        if not has_media(batch):
            out = model(
                input_ids, pad_to_multiple(position_ids, 1, tp)[None].expand(3, -1, -1), attention_mask=None
            )
        elif not self.first_stage:
            out = model(input_ids, pad_to_multiple(self.positions(batch), 2, tp), attention_mask=None)
        else:
            decoder_input, positions, mask, deep = self.inputs(batch)
            if self.sequence_parallel:  # megatron scatters its own embedding's output, not a decoder_input
                from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

                decoder_input = scatter_to_sequence_parallel_region(pad_to_multiple(decoder_input, 0, tp))
                positions = pad_to_multiple(positions, 2, tp)
                mask = None if mask is None else pad_to_multiple(mask, 1, tp)
            with self.deepstack(mask, deep):
                out = model(input_ids, positions, attention_mask=None, decoder_input=decoder_input)
        return (
            out[:, :width] if self.sequence_parallel and model.post_process else out
        )  # not a stage's hidden states
