"""The ``hermes`` tool-call parser: good calls, several per turn, malformed calls, none."""

from __future__ import annotations

import pytest

from relax.agents.config import HermesParams
from relax.agents.parsers import HermesParser
from relax.core.plugins import get_plugin_manager


@pytest.fixture
def parser():
    return HermesParser()


def test_one_call_and_the_text_around_it(parser):
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Let me compute."
    assert [(c.name, c.arguments, c.error) for c in calls] == [("calculator", {"expression": "123*456"}, "")]
    assert calls[0].raw.startswith("<tool_call>") and calls[0].raw.endswith("</tool_call>")


def test_several_calls_keep_their_order_and_ids(parser):
    text = (
        '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> then '
        '<tool_call>{"name": "mul", "arguments": "{\\"a\\": 3}"}</tool_call>'
    )
    content, calls = parser.parse(text)
    assert content == "then"
    assert [(c.name, c.arguments, c.id) for c in calls] == [
        ("add", {"a": 1, "b": 2}, "call_0"),
        ("mul", {"a": 3}, "call_1"),
    ]
    assert not any(c.error for c in calls)


def test_no_call_is_plain_text(parser):
    assert parser.parse("The answer is 56088.") == ("The answer is 56088.", [])


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
        ('{"arguments": {"a": 1}}', 'no "name"'),
        ('["add"]', "must be a JSON object"),
        ('{"name": "add", "arguments": [1, 2]}', '"arguments" must be a JSON object'),
        ('{"name": "add", "arguments": "not json"}', "not a JSON object"),
    ],
)
def test_malformed_calls_are_errors_not_exceptions(parser, body, error):
    content, calls = parser.parse(f"x <tool_call>{body}</tool_call> y")
    assert content == "x  y"
    assert len(calls) == 1 and error in calls[0].error
    assert calls[0].raw == f"<tool_call>{body}</tool_call>"


def test_a_call_cut_by_the_length_limit_is_malformed(parser):
    content, calls = parser.parse('ok <tool_call>{"name": "add", "argum')
    assert content == "ok"
    assert len(calls) == 1 and "without a closing </tool_call>" in calls[0].error
    # a good call before the cut one is still parsed
    _, calls = parser.parse('<tool_call>{"name": "a"}</tool_call><tool_call>{"na')
    assert [c.name for c in calls] == ["a", ""] and calls[0].arguments == {} and calls[1].error


def test_custom_tags_and_registration():
    parser = HermesParser("<call>", "</call>")
    assert parser.parse('<call>{"name": "f"}</call>')[1][0].name == "f"
    registration = get_plugin_manager().registration("tool_parser", "hermes")
    assert registration.config is HermesParams
    built = registration.factory(HermesParams(start="[[", end="]]"), None)
    assert built.parse('a [[{"name": "g", "arguments": {"x": 1}}]]')[1][0].arguments == {"x": 1}
    assert HermesParams(start="").validate() == ["start: must not be empty"]
