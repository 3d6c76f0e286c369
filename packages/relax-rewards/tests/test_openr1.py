"""``openr1_mm``: accuracy on the ``<answer>`` content and the think/answer format."""

from __future__ import annotations

import pytest

from relax.rewards.openr1 import OpenR1Params, format_ok, openr1_score

P = OpenR1Params()
T = "<think>reasoning</think>"

# (response, label, acc, format)
CASES = [
    (f"{T}<answer>7</answer>", "7", 1.0, 1.0),
    (f"{T}<answer>8</answer>", "7", 0.0, 1.0),
    (f"{T}<answer>\\frac{{1}}{{2}}</answer>", "0.5", 1.0, 1.0),  # math-verify
    (f"{T}<answer>0.5</answer>", "<answer>1/2</answer>", 1.0, 1.0),  # label wrapped in <answer>
    (f"{T}<answer>\\boxed{{3}}</answer>", "3", 1.0, 1.0),
    (f"{T}<answer>B</answer>", "B", 1.0, 1.0),  # choice letter
    (f"{T}<answer>(B) a cat</answer>", "B", 1.0, 1.0),
    (f"{T}<answer>C</answer>", "B", 0.0, 1.0),
    (f"{T}<answer>a red car</answer>", "A red car.", 1.0, 1.0),  # exact-match fallback
    (f"{T}<answer>blue car</answer>", "red car", 0.0, 1.0),
    ("<answer>7</answer>", "7", 1.0, 0.0),  # no think block
    (f"{T}7", "7", 0.0, 0.0),  # no answer tags
    (f"{T}<answer>7</answer><answer>7</answer>", "7", 1.0, 0.0),  # duplicated tag
    (f"{T}{T}<answer>7</answer>", "7", 1.0, 0.0),
    (f"{T}<answer>7</answer> trailing", "7", 1.0, 0.0),  # text after the answer
    (f"  {T}\n<answer>7</answer>\n", "7", 1.0, 1.0),  # whitespace is fine
    ("", "7", 0.0, 0.0),
    (f"<think>{'x' * 100_000}</think><answer>7</answer>", "7", 1.0, 1.0),  # 100 kB
    (f"{T}<answer>七</answer>", "七", 1.0, 1.0),  # unicode
    (f"{T}<answer>50\\%</answer>", "0.5", 1.0, 1.0),
    (f"{T}<answer></answer>", "7", 0.0, 1.0),  # empty answer
]


@pytest.mark.parametrize(("response", "label", "acc", "fmt"), CASES)
def test_openr1_cases(response, label, acc, fmt):
    out = openr1_score(response, label, {}, P)
    assert (out["acc"], out["format"]) == (acc, fmt), out
    assert out["score"] == acc + fmt


def test_weights_and_format_helper():
    out = openr1_score(f"{T}<answer>7</answer>", "7", {}, OpenR1Params(acc_weight=0.9, format_weight=0.1))
    assert out["score"] == pytest.approx(1.0)
    assert not format_ok("<think></think>")
    with pytest.raises(ValueError, match="needs a label"):
        openr1_score("x", None, {}, P)
