"""Tiny VL / Omni models and their HF processors, built locally from configs (no hub): the quick-start's
models and every package's media tests (relax-omni owns the families; core's test kit names none).

Four families: Qwen2.5-VL, Qwen3-VL, Qwen2.5-Omni thinker and Qwen3-Omni(-MoE) thinker. Each directory
holds seeded safetensors weights (``AutoModelForImageTextToText`` reloads them), a character-level
tokenizer with the family's media placeholder tokens, and a saved processor (image + video processors,
Whisper features for Omni) with a chat template that renders OpenAI-style content lists. Images are
tiny (pixel budget 56x56..112x112) so one forward takes milliseconds on CPU.

    from relax.omni.tiny_models import FAMILIES, tiny_multimodal_dir
    model_dir = tiny_multimodal_dir(tmp_path, "qwen2_5_vl")
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path
from typing import Any

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_5_omni", "qwen3_omni")
VL_FAMILIES, OMNI_FAMILIES = FAMILIES[:2], FAMILIES[2:]

# family -> placeholder tokens: (start, pad, end) per media kind
_QWEN_VISION = {
    "image": ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"),
    "video": ("<|vision_start|>", "<|video_pad|>", "<|vision_end|>"),
}
PLACEHOLDERS: dict[str, dict[str, tuple[str, str, str]]] = {
    "qwen2_5_vl": _QWEN_VISION,
    "qwen3_vl": _QWEN_VISION,
    "qwen2_5_omni": {
        "image": ("<|vision_bos|>", "<|IMAGE|>", "<|vision_eos|>"),
        "video": ("<|vision_bos|>", "<|VIDEO|>", "<|vision_eos|>"),
        "audio": ("<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"),
    },
    "qwen3_omni": {**_QWEN_VISION, "audio": ("<|audio_start|>", "<|audio_pad|>", "<|audio_end|>")},
}
_BASE_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
_WORDS = ("user", "assistant", "system")
_CHARS = tuple("0123456789abcdefghijklmnopqrstuvwxyz") + tuple("+-*=?.,:<>!' \n")
MODEL_SEED, OTHER_MODEL_SEED = 1, 2
BUILD_FORMAT = 1  # bump when the recipe changes (names the directory, so stale builds are not reused)

TEXT = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.3,
}
MROPE = [2, 3, 3]  # sums to head_dim / 2
PIXELS = {"min_pixels": 56 * 56, "max_pixels": 112 * 112}


def _chat_template(family: str) -> str:
    """Qwen chat template for string or list content; media items become start+pad+end placeholders."""
    media = "".join(
        f"{{%- elif item['type'] == '{kind}' %}}{{{{- '{''.join(toks)}' }}}}"
        for kind, toks in PLACEHOLDERS[family].items()
    )
    return (
        "{%- for message in messages %}"
        "{{- '<|im_start|>' + message['role'] + '\n' }}"
        "{%- if message['content'] is string %}{{- message['content'] }}"
        "{%- else %}{%- for item in message['content'] %}"
        "{%- if item['type'] == 'text' %}{{- item['text'] }}"
        f"{media}"
        "{%- endif %}{%- endfor %}{%- endif %}"
        "{{- '<|im_end|>\n' }}"
        "{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
    )


def build_tokenizer(family: str) -> Any:
    """Character-level ``PreTrainedTokenizerFast`` holding every family's placeholder tokens (one vocabulary,
    so token ids are comparable across families) and naming this family's ones as attributes."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    media_tokens = sorted({t for fam in PLACEHOLDERS.values() for toks in fam.values() for t in toks})
    specials = list(_BASE_SPECIAL) + media_tokens
    vocab = {tok: i for i, tok in enumerate(specials + list(_WORDS) + list(_CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    alts = "|".join(re.escape(t) for t in specials[1:] + list(_WORDS))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf"{alts}|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    names = {}
    for kind, (_start, pad, _end) in PLACEHOLDERS[family].items():
        names[f"{kind}_token"] = pad
    if family in OMNI_FAMILIES:
        img, aud = PLACEHOLDERS[family]["image"], PLACEHOLDERS[family]["audio"]
        names.update(
            vision_bos_token=img[0], vision_eos_token=img[2], audio_bos_token=aud[0], audio_eos_token=aud[2]
        )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=specials[1:],
        extra_special_tokens=names,
        clean_up_tokenization_spaces=False,
        model_max_length=TEXT["max_position_embeddings"],
    )
    wrapped.chat_template = _chat_template(family)
    return wrapped


def build_processor(family: str, tokenizer: Any) -> Any:
    """The family's HF processor over ``tokenizer`` with a tiny pixel budget and, for Omni, 128-bin Whisper
    features at 16 kHz."""
    from transformers import (
        Qwen2_5_VLProcessor,
        Qwen2_5OmniProcessor,
        Qwen2VLImageProcessor,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
        WhisperFeatureExtractor,
    )

    patch = 16 if family in ("qwen3_vl", "qwen3_omni") else 14
    budget = {"shortest_edge": PIXELS["min_pixels"], "longest_edge": PIXELS["max_pixels"]}
    image = Qwen2VLImageProcessor(patch_size=patch, merge_size=2, temporal_patch_size=2, size=budget)
    video_cls = Qwen3VLVideoProcessor if family == "qwen3_vl" else Qwen2VLVideoProcessor
    video = video_cls(patch_size=patch, merge_size=2, temporal_patch_size=2, size=budget)
    template = _chat_template(family)
    if family == "qwen2_5_vl":
        return Qwen2_5_VLProcessor(image, tokenizer, video, chat_template=template)
    if family == "qwen3_vl":
        return Qwen3VLProcessor(image, tokenizer, video, chat_template=template)
    audio = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, return_attention_mask=True)
    cls = Qwen2_5OmniProcessor if family == "qwen2_5_omni" else Qwen3OmniMoeProcessor
    return cls(image, video, audio, tokenizer, chat_template=template)


def _ids(tokenizer: Any, family: str) -> dict[str, int]:
    ph = PLACEHOLDERS[family]
    conv = tokenizer.convert_tokens_to_ids
    out = {
        "image_token_id": conv(ph["image"][1]),
        "video_token_id": conv(ph["video"][1]),
        "vision_start_token_id": conv(ph["image"][0]),
        "vision_end_token_id": conv(ph["image"][2]),
    }
    if "audio" in ph:
        out.update(
            audio_token_id=conv(ph["audio"][1]),
            audio_start_token_id=conv(ph["audio"][0]),
            audio_end_token_id=conv(ph["audio"][2]),
        )
    return out


def build_config(family: str, tokenizer: Any) -> Any:
    """A seeded-size config for ``family``: 2 text layers (hidden 64, M-RoPE), 1-2 vision blocks, 1 audio layer."""
    import transformers as tf

    ids = _ids(tokenizer, family)
    interleaved = family in ("qwen3_vl", "qwen3_omni")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": MROPE}
    if interleaved:
        rope["mrope_interleaved"] = True
    text = {
        **TEXT,
        "vocab_size": len(tokenizer),
        "rope_parameters": rope,
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "tie_word_embeddings": False,
    }
    vision = {
        "depth": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "in_channels": 3,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": TEXT["hidden_size"],
        "initializer_range": 0.3,
    }
    if family in ("qwen2_5_vl", "qwen2_5_omni"):
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
    else:
        vision.update(
            patch_size=16,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
            hidden_act="gelu_pytorch_tanh",
        )
    audio = {
        "num_mel_bins": 128,
        "encoder_layers": 1,
        "encoder_attention_heads": 2,
        "encoder_ffn_dim": 64,
        "d_model": 32,
        "output_dim": TEXT["hidden_size"],
        "max_source_positions": 1500,
        "initializer_range": 0.3,
    }
    if family == "qwen2_5_vl":
        return tf.Qwen2_5_VLConfig(
            text_config=text,
            vision_config={**vision, "tokens_per_second": 2},
            tie_word_embeddings=False,
            **ids,
        )
    if family == "qwen3_vl":
        return tf.Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)
    omni_ids = {
        k.replace("_token_id", "_token_index")
        if family == "qwen2_5_omni" and k in ("image_token_id", "video_token_id", "audio_token_id")
        else k: v
        for k, v in ids.items()
    }
    if family == "qwen2_5_omni":
        return tf.Qwen2_5OmniThinkerConfig(
            text_config=text, vision_config=vision, audio_config=audio, tie_word_embeddings=False, **omni_ids
        )
    moe = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "decoder_sparse_step": 1,
        "norm_topk_prob": True,
    }
    audio3 = {
        **audio,
        "downsample_hidden_size": 16,
        "n_window": 50,
        "n_window_infer": 800,
        "conv_chunksize": 500,
    }
    return tf.Qwen3OmniMoeThinkerConfig(
        text_config={**text, **moe},
        vision_config=vision,
        audio_config=audio3,
        tie_word_embeddings=False,
        **omni_ids,
    )


_lock = threading.Lock()


def build_tiny_multimodal(directory: str | os.PathLike[str], family: str, seed: int = MODEL_SEED) -> str:
    """Write the seeded tiny ``family`` model (safetensors, fp32), its tokenizer and processor to ``directory``."""
    import torch
    from transformers import AutoModelForImageTextToText, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown multimodal family {family!r}; choose one of {FAMILIES}")
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    config = build_config(family, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        for p in model.parameters():  # fresh norms are all ones: noise makes two seeds differ in every tensor
            p.data.add_(0.02 * torch.randn_like(p))
    model.generation_config = GenerationConfig(
        eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id], pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    build_processor(family, tokenizer).save_pretrained(out)
    return str(out)


def tiny_multimodal_dir(root: str | os.PathLike[str], family: str, seed: int = MODEL_SEED) -> str:
    """Path of the tiny ``family`` model for ``seed`` under ``root``, built on first use."""
    target = Path(root) / f"relax-tiny-{family}-f{BUILD_FORMAT}-seed{seed}"
    with _lock:
        if not (target / "config.json").exists():
            build_tiny_multimodal(target, family, seed)
    return str(target)


#: Omni family -> (model_type, architecture) of its whole checkpoint as released (thinker, talker, vocoder)
WHOLE_OMNI = {
    "qwen2_5_omni": ("qwen2_5_omni", "Qwen2_5OmniForConditionalGeneration"),
    "qwen3_omni": ("qwen3_omni_moe", "Qwen3OmniMoeForConditionalGeneration"),
}


def wrap_whole_omni(
    thinker_dir: str | os.PathLike[str], directory: str | os.PathLike[str], family: str
) -> str:
    """Write ``thinker_dir`` (a tiny ``family`` thinker) as the whole Omni checkpoint it comes in: the config's
    ``thinker_config``, every weight under ``thinker.`` (no talker: ``enable_audio_output`` false), the same
    tokenizer and processor files."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model_type, architecture = WHOLE_OMNI[family]
    src, out = Path(thinker_dir), Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    for file in src.iterdir():
        if file.is_file() and file.suffix != ".safetensors" and file.name != "config.json":
            shutil.copy(file, out / file.name)
    thinker = json.loads((src / "config.json").read_text())
    whole = {
        "architectures": [architecture],
        "model_type": model_type,
        "thinker_config": thinker,
        "enable_audio_output": False,
    }
    (out / "config.json").write_text(json.dumps(whole, indent=1))
    save_file(
        {f"thinker.{k}": v for k, v in load_file(src / "model.safetensors").items()},
        out / "model.safetensors",
    )
    return str(out)


def tiny_whole_omni_dir(root: str | os.PathLike[str], family: str, seed: int = MODEL_SEED) -> str:
    """Path of the tiny ``family`` thinker wrapped as its whole Omni checkpoint (:func:`wrap_whole_omni`) under
    ``root``, built on first use."""
    target = Path(root) / f"relax-tiny-whole-{family}-f{BUILD_FORMAT}-seed{seed}"
    thinker = tiny_multimodal_dir(root, family, seed)  # takes the lock itself
    with _lock:
        if not (target / "config.json").exists():
            wrap_whole_omni(thinker, target, family)
    return str(target)
