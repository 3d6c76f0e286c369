"""``ProcessorConformance``: a processor turns a chat message list into the prompt the dataset uses,
``{"prompt_text": str, "prompt_ids": list[int], ...}``, consistent with the tokenizer's chat
template (multimodal processors add model inputs under further keys)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from relax.core.protocols import Processor
from relax.core.testing.models import TinyModelFixtures

DEFAULT_CONVERSATIONS = (
    [{"role": "user", "content": "3+4=?"}],  # the tiny vocabulary: digits, + - * = ? space newline
    [{"role": "system", "content": "0 = 0"}, {"role": "user", "content": "12 - 5 = ?"}],
    [
        {"role": "user", "content": "1+1=?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2*3=?"},
    ],
)


class ProcessorConformance(TinyModelFixtures):
    """Subclass as ``class TestMyProcessor(ProcessorConformance)`` and implement ``make_processor``.

    ``expected_prompt`` says what a text-only conversation must become; the default is the chat
    template with the generation prompt, encoded without extra special tokens (core's dataset
    contract). Override ``conversations`` to add content your processor handles.
    """

    def make_processor(self, model_dir: str) -> Processor:
        raise NotImplementedError(f"{type(self).__name__} must implement make_processor(self, model_dir)")

    def conversations(self) -> list[list[dict[str, Any]]]:
        return [copy.deepcopy(c) for c in DEFAULT_CONVERSATIONS]

    def expected_prompt(self, tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, list(tokenizer.encode(text, add_special_tokens=False))

    @pytest.fixture(scope="class")
    @classmethod
    def processor(cls, model_dir: str) -> Any:
        return cls().make_processor(model_dir)

    def test_is_a_processor(self, processor):
        assert isinstance(processor, Processor), f"{type(processor).__name__} is not callable"

    def test_prompt_matches_the_chat_template(self, processor, tokenizer):
        for messages in self.conversations():
            out = processor(copy.deepcopy(messages))
            assert isinstance(out, dict), f"a processor returns a dict, got {type(out).__name__}"
            ids, text = out.get("prompt_ids"), out.get("prompt_text")
            assert isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids), (
                f"prompt_ids must be a non-empty list of int, got {ids!r}"
            )
            assert isinstance(text, str), f"prompt_text must be a str, got {type(text).__name__}"
            want_text, want_ids = self.expected_prompt(tokenizer, messages)
            assert text == want_text, f"prompt_text {text!r} != chat template {want_text!r}"
            assert ids == want_ids, f"prompt_ids {ids} != template encoding {want_ids}"
            assert tokenizer.decode(ids) == text, "prompt_ids must decode to prompt_text"

    def test_deterministic_and_leaves_messages_alone(self, processor):
        for messages in self.conversations():
            pristine = copy.deepcopy(messages)
            first, second = processor(messages), processor(messages)
            assert messages == pristine, "the processor modified its input messages"
            assert (
                first["prompt_ids"] == second["prompt_ids"] and first["prompt_text"] == second["prompt_text"]
            )

    def test_conversations_do_not_collide(self, processor):
        outs = [tuple(processor(m)["prompt_ids"]) for m in self.conversations()]
        assert len(set(outs)) == len(outs), "different conversations gave the same prompt_ids"
