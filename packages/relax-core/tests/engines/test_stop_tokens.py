import pytest

from relax.core.engines.stop_tokens import chat_end_token_ids, stop_token_ids
from relax.core.quickstart_model import build_tokenizer

CHATML = (
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{%- endfor %}"
)
LLAMA2 = (
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{{- '<s>[INST] ' + m['content'] + ' [/INST]' }}"
    "{%- else %}{{- ' ' + m['content'] + ' </s>' }}{%- endif %}{%- endfor %}"
)
LLAMA3 = (
    "{%- for m in messages %}{{- '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content']"
    " + '<|eot_id|>' }}{%- endfor %}"
)
STRICT = (
    "{{- raise_exception('only user messages') if messages[-1]['role'] != 'user'"
    " else messages[-1]['content'] }}"
)


def word_tokenizer(specials, template=None, eos=None, **named):
    """A character-level fast tokenizer whose specials are whole tokens (like the quick-start's)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {tok: i for i, tok in enumerate([*specials, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    alternatives = "|".join(s.replace("|", r"\|").replace("[", r"\[") for s in specials)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(rf"{alternatives}|[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    extra = [s for s in specials if s not in {eos, "<unk>", *named.values()}]
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", eos_token=eos, additional_special_tokens=extra, **named
    )
    wrapped.chat_template = template
    return wrapped


def ids(tok, *names):
    return [tok.convert_tokens_to_ids(n) for n in names]


def test_quickstart_tokenizer_stops_at_im_end_only():
    tok = build_tokenizer()
    assert stop_token_ids(tok) == ids(tok, "<|im_end|>")


def test_tokenizer_without_im_end_never_stops_at_unk():
    tok = word_tokenizer(["<unk>", "<s>", "</s>"], LLAMA2, eos="</s>", bos_token="<s>")
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.unk_token_id  # the old lookup's bug
    got = stop_token_ids(tok)
    assert got == ids(tok, "</s>")
    assert tok.unk_token_id not in got


def test_template_end_token_added_beside_a_different_eos():
    specials = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    qwen_base = word_tokenizer(specials, CHATML, eos="<|endoftext|>")
    assert stop_token_ids(qwen_base) == ids(qwen_base, "<|endoftext|>", "<|im_end|>")
    llama3 = word_tokenizer(
        ["<unk>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        LLAMA3,
        eos="<|end_of_text|>",
    )
    assert chat_end_token_ids(llama3) == ids(llama3, "<|eot_id|>")
    assert stop_token_ids(llama3) == ids(llama3, "<|end_of_text|>", "<|eot_id|>")


@pytest.mark.parametrize("template", [None, STRICT])
def test_no_usable_template_leaves_eos(template):
    tok = word_tokenizer(["<unk>", "</s>"], template, eos="</s>")
    assert stop_token_ids(tok) == ids(tok, "</s>")


def test_no_eos_and_no_template_gives_nothing():
    tok = word_tokenizer(["<unk>"])
    assert tok.eos_token_id is None
    assert stop_token_ids(tok) == []


def test_unk_written_by_a_template_is_not_a_stop():
    template = "{%- for m in messages %}{{- m['content'] + '<unk></s>' }}{%- endfor %}"
    tok = word_tokenizer(["<unk>", "</s>"], template, eos="</s>")
    assert stop_token_ids(tok) == ids(tok, "</s>")
