"""Which token ids end a response, derived from the tokenizer itself (never from a hard-coded name).

Looking up a fixed token such as Qwen's ``<|im_end|>`` is wrong on any other tokenizer: the lookup
quietly returns the ``<unk>`` id, and then every sampled ``<unk>`` ends a response. Instead the
stop ids are the tokenizer's EOS plus the special tokens its chat template writes right after an
assistant message (``<|im_end|>`` for ChatML, ``<|eot_id|>`` for Llama 3, ``<end_of_turn>`` for
Gemma, ...). Ids from the config (``rollout.stop_token_ids``) are added by the caller.
"""

from __future__ import annotations

from typing import Any

_PROBE = "Relax stop-token probe 7"  # assistant content to find in the rendered template


def stop_token_ids(tokenizer: Any) -> list[int]:
    """EOS and chat-template end-of-turn ids of ``tokenizer``, in that order, without duplicates.

    The unknown-token id is never included: it marks text the vocabulary lacks, not an end.
    """
    ids = [tokenizer.eos_token_id, *chat_end_token_ids(tokenizer)]
    unk = tokenizer.unk_token_id
    return list(dict.fromkeys(t for t in ids if isinstance(t, int) and t >= 0 and t != unk))


def chat_end_token_ids(tokenizer: Any) -> list[int]:
    """The special tokens the chat template writes directly after an assistant message's content.

    Renders a short user/assistant exchange as text, takes what follows the assistant content and
    keeps its leading special tokens. A tokenizer without a template, or whose template rejects
    the probe conversation, contributes nothing.
    """
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - any template error (jinja, role checks) means: no template ids
        return []
    if not isinstance(text, str) or _PROBE not in text:
        return []
    suffix = text[text.rindex(_PROBE) + len(_PROBE) :]
    special = _special_ids(tokenizer)
    out = []
    for tok in tokenizer.encode(suffix, add_special_tokens=False):
        if tok not in special:
            break
        out.append(tok)
    return out


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the named special tokens and of added tokens flagged special, less the unknown token."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tok_id, added in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).items():
        if getattr(added, "special", False):
            ids.add(tok_id)
    ids.discard(tokenizer.unk_token_id)
    return ids
