"""Model adapters for the Qwen VL / Omni (thinker) families (``relax_register_model_adapters``).

Core's trainer and HF engine run these models only through this adapter (``relax.core.protocols.
ModelAdapter``): load (image-text-to-text, each audio encoded alone), forward kwargs for media, the
M-RoPE decode positions, the media towers' weight prefixes (by kind: vision, audio) and token ids, and the
audio-in-video flag.

Both sides pass the processor's media inputs and the token-type ids and leave ``position_ids`` to the
model, which computes the 3-D M-RoPE positions with its own rope-index function from the ids, the
attention mask (left padding) and the grids: the trainer's positions are by construction those the
rollout forward used. The prefill leaves the model's rope delta (M-RoPE position minus token index,
per row); each decode step then feeds one token per row at ``cache length + delta`` on all three axes.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from relax.core.data_multimodal import model_inputs
from relax.core.model_family import MediaTowerHooks, ServingConventions
from relax.omni.media import SAMPLE_RATE

#: media-input key of a prompt whose videos carry their soundtracks interleaved (Omni ``use_audio_in_video``):
#: one entry per video; the model's rope index must be told, or audio and video positions come out wrong
AUDIO_IN_VIDEO = "use_audio_in_video"

#: whole Qwen-Omni checkpoints as released (thinker, talker, vocoder) -> the thinker's class: Relax trains and
#: rolls out the thinker, loaded from the checkpoint's ``thinker.*`` weights (SGLang serves the whole one)
WHOLE_OMNI = {
    "qwen2_5_omni": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_omni_moe": "Qwen3OmniMoeThinkerForConditionalGeneration",
}

#: the HF ``config.model_type`` of every checkpoint this adapter runs
MODEL_TYPES = (
    "qwen2_5_vl",
    "qwen3_vl",
    "qwen3_vl_moe",
    "qwen2_5_omni_thinker",
    "qwen3_omni_moe_thinker",
    *WHOLE_OMNI,
)

#: the media models relax-megatron runs (its language model in megatron, the towers as HF modules); the other
#: media types are refused there by name
MEGATRON_MODEL_TYPES = ("qwen2_5_vl", "qwen3_vl", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
#: what SGLang needs per model type: how videos reach it (Qwen2.5-VL: one per prompt at the sampling fps as
#: metadata; Qwen3-VL: each temporal grid's time in the prompt), the audio rate the processors decode to
#: (``relax.omni.media.SAMPLE_RATE``), and Qwen3-Omni served whole: the thinker's checkpoint names under ``thinker.``
_AUDIO = ServingConventions(audio_sample_rate=SAMPLE_RATE)
SERVING = {
    "qwen2_5_vl": ServingConventions(video_layout="fps"),
    "qwen3_vl": ServingConventions(video_layout="timestamped"),
    "qwen3_vl_moe": ServingConventions(video_layout="timestamped"),
    "qwen2_5_omni_thinker": _AUDIO,
    "qwen3_omni_moe_thinker": ServingConventions(audio_sample_rate=SAMPLE_RATE, video_layout="fps"),
    "qwen2_5_omni": ServingConventions(media_config_key="thinker_config"),
    "qwen3_omni_moe": ServingConventions(
        media_config_key="thinker_config",
        served_prefix="thinker.",
        served_renames=(
            ("model.language_model.", "model."),
            ("model.visual.", "visual."),
            ("model.audio_tower.", "audio_tower."),
            ("lm_head.", "lm_head."),
        ),
    ),
}

MEDIA_TOKEN_KINDS = ("image", "video", "audio", "vision_start", "vision_end", "audio_start", "audio_end")


def _token_id(config: Any, kind: str) -> int | None:
    for key in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, key, None)
        if value is not None:
            return int(value)
    return None


@dataclass(frozen=True)
class QwenMediaAdapter:
    """``ModelAdapter`` of the Qwen2.5-VL / Qwen3-VL / Qwen2.5-Omni / Qwen3-Omni thinkers."""

    #: the towers' weight-name prefixes (in memory: ``model.*``; older layouts: bare or under ``thinker.``)
    tower_kinds: ClassVar[dict[str, tuple[str, ...]]] = {
        "vision": ("visual.", "model.visual.", "thinker.visual."),
        "audio": ("audio_tower.", "model.audio_tower.", "thinker.audio_tower."),
    }
    media_flags: tuple[str, ...] = (AUDIO_IN_VIDEO,)

    def load(self, model_path: str, dtype: torch.dtype) -> Any:
        """``AutoModelForImageTextToText`` (a whole Omni checkpoint's thinker), each audio encoded alone
        (``encode_audio_per_item``)."""
        import transformers

        from relax.omni.audio_per_item import encode_audio_per_item

        config = transformers.AutoConfig.from_pretrained(model_path)
        if config.model_type in WHOLE_OMNI:  # talker and vocoder weights are left unloaded
            thinker = getattr(transformers, WHOLE_OMNI[config.model_type])
            model = thinker.from_pretrained(
                model_path, config=config.thinker_config, key_mapping={r"^thinker\.": ""}, dtype=dtype
            )
        else:
            model = transformers.AutoModelForImageTextToText.from_pretrained(model_path, dtype=dtype)
        encode_audio_per_item(model)
        return model

    def load_empty(self, model_path: str, dtype: torch.dtype) -> tuple[Any, dict[str, str] | None]:
        """:meth:`load`'s model built from its config, unloaded (core builds it with its parameters on the
        meta device and each trainer rank reads only its shards, ``relax.core.trainers.sharded_load``), and
        the checkpoint-name mapping :meth:`load` applies (a whole Omni checkpoint's ``thinker.`` prefix)."""
        import transformers

        from relax.omni.audio_per_item import encode_audio_per_item

        config = transformers.AutoConfig.from_pretrained(model_path)
        if config.model_type in WHOLE_OMNI:
            thinker = getattr(transformers, WHOLE_OMNI[config.model_type])
            model, key_mapping = thinker._from_config(config.thinker_config, dtype=dtype), {r"^thinker\.": ""}
        else:
            model, key_mapping = (
                transformers.AutoModelForImageTextToText.from_config(config, dtype=dtype),
                None,
            )
        encode_audio_per_item(model)
        return model, key_mapping

    def loaded_config(self, config: Any) -> Any:
        """The config of the model :meth:`load` returns: a whole Omni checkpoint's thinker's."""
        return config.thinker_config if config.model_type in WHOLE_OMNI else config

    def restore_layout(self, directory: str, model_path: str) -> bool:
        """A thinker saved from a whole Omni checkpoint becomes that checkpoint again (``relax.omni.whole``)."""
        from relax.omni.whole import rewrap_whole

        return rewrap_whole(directory, model_path)

    def media_token_ids(self, config: Any) -> list[int]:
        return [i for i in (_token_id(config, k) for k in MEDIA_TOKEN_KINDS) if i is not None]

    def forward_kwargs(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        media: dict[str, torch.Tensor],
        prompt_width: int,
        observed: torch.Tensor | None = None,
    ) -> dict[str, Any]:
        """The media tensors; token types (text 0, image 1, video 2) where the model's rope index needs them;
        ``position_ids=None``, so the model's own rope-index function computes the 3-D positions; the mask as
        bool (the Omni rope index selects tokens with ``ids[mask]``). Media ids a response sampled (columns
        from ``prompt_width`` on) are fed back as token 0: a response never adds media, and the model's
        placeholder counting and rope index must see only the prompt's. Engine and trainer both do this, so
        their logprobs still agree; the sampled ids themselves are kept as they are. The ``AUDIO_IN_VIDEO``
        flags (one per video) become the model's ``use_audio_in_video``. ``source.*`` entries (original media
        kept for other engines, ``relax.core.data_multimodal.SOURCE``) are dropped. ``observed`` (multi-turn):
        response positions that are observations keep their media ids (a tool's image appended to ``media``).
        """
        response = input_ids[:, prompt_width:]
        media_ids = torch.tensor(
            self.media_token_ids(model.config), dtype=input_ids.dtype, device=input_ids.device
        )
        sampled = torch.isin(response, media_ids)
        if observed is not None:
            sampled &= ~observed.to(sampled.device)
        if response.numel() and sampled.any():
            input_ids = torch.cat([input_ids[:, :prompt_width], response.masked_fill(sampled, 0)], 1)
        media = model_inputs(media)
        flags = media.pop(AUDIO_IN_VIDEO, None)
        kwargs: dict[str, Any] = {
            **media,
            "input_ids": input_ids,
            "position_ids": None,
            "attention_mask": attention_mask.bool(),
        }
        if flags is not None:  # one bool for the whole batch in HF's rope index: every video must agree
            videos = media.get("video_grid_thw")
            if videos is None or flags.numel() != videos.shape[0]:
                raise ValueError(
                    f"a batch mixes videos with and without their soundtrack ({flags.numel()} of "
                    f"{0 if videos is None else videos.shape[0]} videos use_audio_in_video): the model's rope index "
                    "takes one flag per forward; process every video of a run with the same use_audio_in_video"
                )
            kwargs["use_audio_in_video"] = True
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            types = torch.zeros_like(input_ids, dtype=torch.int32)
            for code, kind in ((1, "image"), (2, "video")):
                tok = _token_id(model.config, kind)
                if tok is not None:
                    types[input_ids == tok] = code
            kwargs["mm_token_type_ids"] = types
        return kwargs

    def rope_positions(self, model: Any, kwargs: dict[str, Any]) -> torch.Tensor | None:
        """(3, B, L) M-RoPE positions of ``forward_kwargs``'s rows, from the model's rope index alone (no tower
        runs): what its forward would compute, for a caller that lays the rows out itself (packed rows, a later
        megatron stage). The Omni thinkers' forward derives two inputs first: audio lengths from the feature
        mask and the video's seconds per grid under the rope index's name."""
        rope_index = model.model.get_rope_index
        wanted = inspect.signature(rope_index).parameters
        kwargs = dict(kwargs)
        if "audio_seqlens" in wanted and kwargs.get("feature_attention_mask") is not None:
            kwargs["audio_seqlens"] = kwargs["feature_attention_mask"].sum(1)
        if "second_per_grids" in wanted and "video_second_per_grid" in kwargs:
            kwargs["second_per_grids"] = kwargs["video_second_per_grid"]
        positions, _ = rope_index(**{k: v for k, v in kwargs.items() if k in wanted})
        return positions

    def before_prefill(self, model: Any) -> None:
        """Clear the rope deltas an earlier forward kept, so the ones read after the prefill are its own."""
        for module in _rope_holders(model):
            module.rope_deltas = None

    def decode_positions(self, model: Any, rows: int) -> Callable[[int], torch.Tensor]:
        """``cache length + delta`` on all three M-RoPE axes; delta 0 when the prefill computed none."""
        delta = torch.zeros((rows, 1), dtype=torch.long)
        for module in _rope_holders(model):
            if isinstance(module.rope_deltas, torch.Tensor):
                delta = module.rope_deltas.reshape(-1, 1).expand(rows, 1).to(torch.long)
                break
        return lambda length: (delta + length).view(1, rows, 1).expand(3, -1, -1)

    # ---- what the backends read (relax.core.model_family)
    def megatron_media(self, hf_config: Any) -> MediaTowerHooks | None:
        """The media front's parts (relax-megatron): the language model under ``model.language_model``, the
        towers ``visual`` / ``audio_tower`` (the positions: ``rope_positions``); Qwen3-VL's DeepStack adds
        visual embeddings after its first ``len(deepstack_visual_indexes)`` layers."""
        if hf_config.model_type not in MEGATRON_MODEL_TYPES:
            return None
        deepstack = getattr(getattr(hf_config, "vision_config", None), "deepstack_visual_indexes", None) or ()
        return MediaTowerHooks(
            lm_prefix="model.language_model.",
            towers=("visual", "audio_tower"),
            deepstack_layers=len(deepstack),
        )

    def megatron_lm_config(self, hf_config: Any) -> Any:
        """The language model's HF config (``text_config``), with the checkpoint's embedding tying."""
        import copy

        text = copy.deepcopy(hf_config.text_config)
        text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", text.tie_word_embeddings))
        return text

    def serving(self, model_type: str) -> ServingConventions:
        return SERVING.get(model_type, ServingConventions())


def _rope_holders(model: Any) -> list[Any]:
    """The modules that keep M-RoPE deltas between forwards."""
    return [m for m in model.modules() if hasattr(m, "rope_deltas")]


@dataclass(frozen=True)
class QwenMediaLMAdapter:
    """The language models of the VL / Omni thinkers (``text_config.model_type``) as megatron builds them:
    Qwen2 (q/k/v biases, Qwen2.5) or Qwen3 layers with 3-D rotary, its (T, H, W) frequencies chunked
    (Qwen2.5) or interleaved (Qwen3-VL / Qwen3-Omni, whatever the config's flag says: HF's code does so)."""

    takes_media: ClassVar[bool] = False

    def megatron_layout(self, hf_config: Any) -> Any:
        from relax.models.qwen import qwen_layout

        params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
        kind = "multi_axis_interleaved" if hf_config.model_type in INTERLEAVED_LM_TYPES else "multi_axis"
        return qwen_layout(
            hf_config,
            qwen2=hf_config.model_type in QWEN2_LM_TYPES,
            rotary=kind,
            rotary_sections=tuple(params.get("mrope_section") or ()),
        )


QWEN2_LM_TYPES = ("qwen2_5_vl_text", "qwen2_5_omni_text")  # Qwen2 layers: q/k/v biases, no q/k norms
INTERLEAVED_LM_TYPES = ("qwen3_vl_text", "qwen3_omni_moe_text")
LM_TYPES = (*QWEN2_LM_TYPES, *INTERLEAVED_LM_TYPES)


def register_adapters(register: Callable[..., None]) -> None:
    for model_type in MODEL_TYPES:
        register(model_type, QwenMediaAdapter)
    for model_type in LM_TYPES:
        register(model_type, QwenMediaLMAdapter)
