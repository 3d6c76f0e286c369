"""End to end through core: a real tiny HF model calls the calculator with the ``hermes`` parser,
the ``tools`` environment answers, and core appends the tool observation at loss mask 0."""

from __future__ import annotations

import asyncio
import string

import pytest
import torch

from relax.agents.config import ToolsEnvParams
from relax.agents.parsers import HermesParser
from relax.agents.tools_env import ToolsEnvironment
from relax.core.agentic import EpisodeLimits, Turns
from relax.core.controller.local import LocalHandle
from relax.core.controller.router import EngineRouter, stream_groups
from relax.core.data import Sample
from relax.core.engines.hf import HFRolloutEngine
from relax.core.engines.stop_tokens import stop_token_ids
from relax.core.protocols import SamplingParams
from relax.core.rewards.environment import EnvironmentReward

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>")
WORDS = ("<tool_call>", "</tool_call>", "user", "assistant", "tool")
TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
PROMPT = "<|im_start|>user\n123*456=<|im_end|>\n<|im_start|>assistant\n"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "123*456"}}</tool_call><|im_end|>'
OBSERVATION = "\n<|im_start|>tool\n56088<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "56088<|im_end|>"


def _tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(dict.fromkeys(SPECIALS + WORDS + tuple(string.printable)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("|".join(map(lambda w: w.replace("/", "\\/"), WORDS)) + r"|[\s\S]"), "isolated"
    )
    tok.decoder = decoders.Fuse()
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    wrapped.chat_template = TEMPLATE
    return wrapped


class Blocking:
    """The engine as core's rollout role serves it: ``generate`` runs the async call to completion."""

    def __init__(self, engine):
        self.engine = engine

    def generate(self, requests):
        return asyncio.run(self.engine.generate(requests))


def _text(tokenizer, ids) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return train_tool_model(tmp_path_factory.mktemp("tool-model"))


def train_tool_model(out) -> str:
    """A tiny Qwen3 trained (a few seconds) to call the calculator, then copy its result: a real
    model whose greedy turns are the transcript, so the rollout exercises the real engine."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = _tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    pieces = [(PROMPT, False), (CALL, True), (OBSERVATION, False), (ANSWER, True)]
    ids, labels = [], []
    for text, learn in pieces:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if learn else [-100] * len(piece)
    ids_t, labels_t = torch.tensor([ids]), torch.tensor([labels])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(500):
        loss = model(input_ids=ids_t, labels=labels_t).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    assert loss.item() < 1e-3, "precondition: the tiny model memorised the transcript"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def test_a_tool_observation_is_appended_with_loss_mask_zero(model_dir):
    tokenizer = _tokenizer()
    stops = stop_token_ids(tokenizer)
    env = ToolsEnvironment(ToolsEnvParams(tools=["calculator"], answer="numeric"))
    turns = Turns(
        env,
        HermesParser(),
        tokenizer,
        EpisodeLimits(max_turns=3, max_total_tokens=200, turn_timeout_s=10.0),
        stops,
    )
    router = EngineRouter([LocalHandle(Blocking(HFRolloutEngine(model_dir)))])
    prompt = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    samples = [
        [Sample(prompt_ids=list(prompt), group_id=0, index_in_group=i, label="56088") for i in range(2)]
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=100, stop_token_ids=tuple(stops))
    finished = [
        g
        for done, _ in stream_groups(router, samples, params, seed=0, step=1, timeout_s=120, turns=turns)
        for g in done
    ]
    assert len(finished) == 1
    for sample in samples[0]:
        stats = sample.metadata["episode"]
        assert (stats["turns"], stats["tool_calls"], stats["tool_calls_ok"], stats["tool_errors"]) == (
            2,
            1,
            1,
            0,
        )
        mask = sample.loss_mask
        first_hole, last_hole = mask.index(0.0), len(mask) - 1 - mask[::-1].index(0.0)
        assert set(mask[first_hole : last_hole + 1]) == {0.0}  # one interior span of observation tokens
        ids = sample.response_ids
        assert _text(tokenizer, ids[:first_hole]) == CALL  # what the policy sampled, at loss mask 1
        assert (
            _text(tokenizer, ids[first_hole : last_hole + 1]) == OBSERVATION
        )  # the calculator's answer, via the template
        assert _text(tokenizer, ids[last_hole + 1 :]) == ANSWER
        assert set(mask[:first_hole] + mask[last_hole + 1 :]) == {1.0}
        assert all(lp == 0.0 for lp in sample.rollout_logprobs[first_hole : last_hole + 1])
        assert stats["observation_tokens"] == last_hole + 1 - first_hole
        assert sample.metadata["episode_reward"] == 1.0
        assert asyncio.run(EnvironmentReward().score(sample)) == 1.0
