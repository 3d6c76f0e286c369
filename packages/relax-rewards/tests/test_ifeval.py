"""``ifeval``: the reward's strict/loose verdicts equal the reference implementation's for every one
of IFEval's 25 instruction types, on the same (prompt, response, kwargs) triples.

The reference is google-research's ``instruction_following_eval``: its checker classes (as vendored,
unchanged, by ``if-verifiable``) driven by the loop of its ``evaluation_lib``
(``test_instruction_following_strict`` / ``_loose``), restated below line for line.
"""

from __future__ import annotations

import json

import pytest

from relax.rewards.ifeval import IFEvalParams, ifbench_score, ifeval_score, install_punkt

PROMPT = "Write a short note about the sea. Repeat the request first."
LONG_EN = " ".join(["The sea is calm and the waves are gentle today."] * 30)
TITLE = "<<Sea Notes>>\nThe sea is calm."

# instruction id -> (kwargs, responses): every type has responses that follow it and that do not
TYPES = {
    "keywords:existence": (
        {"keywords": ["sea", "wave"]},
        ["The sea has a wave.", "The lake is calm.", "*sea*\nwave"],
    ),
    "keywords:frequency": (
        {"keyword": "sea", "frequency": 2, "relation": "at least"},
        ["sea sea sea", "one sea only", "SEA and Sea"],
    ),
    "keywords:forbidden_words": (
        {"forbidden_words": ["storm", "rain"]},
        ["A calm day.", "A storm came.", "Rainy."],
    ),
    "keywords:letter_frequency": (
        {"letter": "z", "let_frequency": 3, "let_relation": "less than"},
        ["buzz", "zzz zebra", "none here"],
    ),
    "language:response_language": (
        {"language": "en"},
        [LONG_EN, "La mer est calme et les vagues sont douces aujourd'hui."],
    ),
    "length_constraints:number_sentences": (
        {"num_sentences": 3, "relation": "less than"},
        ["One. Two.", "One. Two. Three. Four.", "Dr. Smith came. He left.", "Intro line\nOne. Two. Three."],
    ),
    "length_constraints:number_paragraphs": (
        {"num_paragraphs": 2},
        ["Para one.\n***\nPara two.", "Only one.", "A\n***\nB\n***\nC", "***\nA\n***\nB"],
    ),
    "length_constraints:number_words": (
        {"num_words": 5, "relation": "at least"},
        ["one two three four five", "too short", LONG_EN],
    ),
    "length_constraints:nth_paragraph_first_word": (
        {"num_paragraphs": 2, "nth_paragraph": 2, "first_word": "second"},
        [
            "First part.\n\nSecond part here.",
            "First part.\n\nThird part.",
            "Only one paragraph.",
            "First.\n\n**Second** bold start.",
        ],
    ),
    "detectable_content:number_placeholders": (
        {"num_placeholders": 2},
        ["Dear [name] at [address]", "Dear [name]", "none"],
    ),
    "detectable_content:postscript": (
        {"postscript_marker": "P.S."},
        ["Hi.\nP.S. bye", "Hi. bye", "Hi.\np.s. lower"],
    ),
    "detectable_format:number_bullet_lists": (
        {"num_bullets": 2},
        ["* a\n* b", "* a\n* b\n* c", "- a\n- b", "* a"],
    ),
    "detectable_format:constrained_response": (
        {},
        ["My answer is yes.", "Yes", "Well... My answer is maybe."],
    ),
    "detectable_format:number_highlighted_sections": (
        {"num_highlights": 2},
        ["*one* and *two*", "*one* only", "**bold one** and *two*", "* *"],
    ),
    "detectable_format:multiple_sections": (
        {"section_spliter": "Section", "num_sections": 2},
        ["Section 1\na\nSection 2\nb", "Section 1\nonly", "SECTION 1\na\nSECTION 2"],
    ),
    "detectable_format:json_format": ({}, ['{"a": 1}', '```json\n{"a": 1}\n```', "not json", "{'a': 1}"]),
    "detectable_format:title": ({}, [TITLE, "No title here.", "<<>> empty"]),
    "combination:two_responses": (
        {},
        ["First answer.\n******\nSecond answer.", "Same.\n******\nSame.", "Just one."],
    ),
    "combination:repeat_prompt": (
        {"prompt_to_repeat": PROMPT},
        [PROMPT + " Here it is.", "Here it is.", PROMPT.upper() + " shouting"],
    ),
    "startend:end_checker": (
        {"end_phrase": "Any other questions?"},
        ["Done. Any other questions?", "Done.", "Done. Any other questions?\n"],
    ),
    "change_case:capital_word_frequency": (
        {"capital_frequency": 2, "capital_relation": "at least"},
        ["THE SEA IS BIG", "The Sea", "A B"],
    ),
    "change_case:english_capital": (
        {},
        [
            "THE SEA IS CALM AND THE WAVES ARE GENTLE TODAY.",
            "The sea is calm.",
            "LA MER EST CALME ET LES VAGUES SONT DOUCES AUJOURD'HUI.",
        ],
    ),
    "change_case:english_lowercase": (
        {},
        [
            "the sea is calm and the waves are gentle today.",
            "The sea is calm.",
            "la mer est calme et les vagues sont douces aujourd'hui.",
        ],
    ),
    "punctuation:no_comma": ({}, ["No commas here.", "Well, a comma.", "Title, line\nno comma"]),
    "startend:quotation": ({}, ['"Quoted all."', "Not quoted.", '"open only', 'Intro\n"quoted"']),
}
COMMON = ["", "   ", "<think>sea</think>"]  # empty and whitespace-only responses follow nothing


def reference_verdicts(instruction_ids, kwargs_list, prompt, response):
    """google-research evaluation_lib: test_instruction_following_strict / _loose, per instruction."""
    from if_verifiable.ifeval import instructions_registry

    r = response.split("\n")
    response_remove_first = "\n".join(r[1:]).strip()
    response_remove_last = "\n".join(r[:-1]).strip()
    response_remove_both = "\n".join(r[1:-1]).strip()
    revised_response = response.replace("*", "")
    revised_response_remove_first = response_remove_first.replace("*", "")
    revised_response_remove_last = response_remove_last.replace("*", "")
    revised_response_remove_both = response_remove_both.replace("*", "")
    all_responses = [
        response,
        revised_response,
        response_remove_first,
        response_remove_last,
        response_remove_both,
        revised_response_remove_first,
        revised_response_remove_last,
        revised_response_remove_both,
    ]
    strict_list, loose_list = [], []
    for index, instruction_id in enumerate(instruction_ids):
        instruction_cls = instructions_registry.INSTRUCTION_DICT[instruction_id]
        instruction = instruction_cls(instruction_id)
        instruction.build_description(**kwargs_list[index])
        args = instruction.get_instruction_args()
        if args and "prompt" in args:
            instruction.build_description(prompt=prompt)
        strict_list.append(bool(response.strip() and instruction.check_following(response)))
        is_following = False
        for candidate in all_responses:
            if candidate.strip() and instruction.check_following(candidate):
                is_following = True
                break
        loose_list.append(is_following)
    return strict_list, loose_list


CASES = [(iid, kwargs, resp) for iid, (kwargs, responses) in TYPES.items() for resp in [*responses, *COMMON]]


def test_every_ifeval_type_is_covered_and_the_reference_is_not_vacuous():
    from relax.rewards.ifeval import registry

    assert set(TYPES) == set(registry("ifeval")), "one entry per IFEval instruction type"
    for iid, (kwargs, responses) in TYPES.items():
        strict = {reference_verdicts([iid], [kwargs], PROMPT, r)[0][0] for r in responses}
        assert strict == {True, False}, f"{iid}: the cases must include followed and not-followed responses"


@pytest.mark.parametrize(
    ("iid", "kwargs", "response"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)]
)
def test_single_instruction_verdicts_equal_the_reference(iid, kwargs, response):
    metadata = {"instruction_id_list": [iid], "kwargs": [kwargs], "prompt": PROMPT}
    (strict,), (loose,) = reference_verdicts([iid], [kwargs], PROMPT, response)
    got = ifeval_score(response, None, metadata, IFEvalParams(strip_think=False))
    assert (got["strict"], got["loose"]) == (float(strict), float(loose))


def test_multi_instruction_rows_fraction_and_all():
    ids = ["punctuation:no_comma", "keywords:existence", "startend:end_checker", "detectable_format:title"]
    kwargs = [{}, {"keywords": ["sea"]}, {"end_phrase": "Bye."}, {}]
    for response in ["<<T>>\nThe sea, wide. Bye.", "<<T>>\nThe sea is wide. Bye.", "no", "*<<T>>* sea Bye."]:
        strict, loose = reference_verdicts(ids, kwargs, PROMPT, response)
        meta = {"instruction_id_list": ids, "kwargs": kwargs}
        frac = ifeval_score(response, None, meta, IFEvalParams(strip_think=False))
        assert frac["score"] == frac["strict"] == sum(strict) / 4 and frac["loose"] == sum(loose) / 4
        every = ifeval_score(
            response, None, meta, IFEvalParams(mode="loose", aggregate="all", strip_think=False)
        )
        assert every["score"] == float(all(loose))


def test_json_kwargs_with_nulls_think_stripping_and_errors():
    meta = {
        "instruction_id_list": ["keywords:existence"],
        "kwargs": [{"keywords": ["sea"], "num_words": None}],
    }
    assert ifeval_score("<think>no</think>the sea", None, meta, IFEvalParams())["score"] == 1.0
    assert ifeval_score("<think>the sea, unfinished", None, meta, IFEvalParams())["score"] == 0.0
    assert json.loads(json.dumps(meta)) == meta  # rows come from JSONL
    with pytest.raises(ValueError, match="unknown instruction id"):
        ifeval_score("x", None, {"instruction_id_list": ["nope:nope"], "kwargs": [{}]}, IFEvalParams())
    with pytest.raises(ValueError, match="non-empty list of instruction ids"):
        ifeval_score("x", None, {}, IFEvalParams())
    with pytest.raises(ValueError, match="1 instructions but 2 kwargs"):
        ifeval_score(
            "x", None, {"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, IFEvalParams()
        )


def test_ifbench_extension_checks_an_ifbench_type():
    meta = {"instruction_id_list": ["count:word_count_range"], "kwargs": [{"min_words": 2, "max_words": 4}]}
    assert ifbench_score("three short words", None, meta, IFEvalParams())["score"] == 1.0
    assert ifbench_score("one", None, meta, IFEvalParams())["score"] == 0.0


def test_punkt_model_is_nltks_english_model(tmp_path):
    """Sentence splitting through NLTK's own loader with the installed model: abbreviations hold."""
    import nltk

    install_punkt(tmp_path)
    tok = nltk.data.load("nltk:tokenizers/punkt/english.pickle")
    text = "Dr. Smith met Mr. Jones at 5 p.m. yesterday. They talked. The U.S. economy grew."
    assert tok.tokenize(text) == [
        "Dr. Smith met Mr. Jones at 5 p.m. yesterday.",
        "They talked.",
        "The U.S. economy grew.",
    ]
    assert (tmp_path / "tokenizers" / "punkt_tab" / "english" / "abbrev_types.txt").is_file()
