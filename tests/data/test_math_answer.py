"""The math_answer reward: extraction, normalisation and exact comparison, one rule per row."""

from fractions import Fraction

import pytest

from astrai.data.math_answer import final_answer, normalize_answer, parse_number, same_answer
from astrai.data.rewards import get_reward

# (completion, what final_answer extracts)
EXTRACTIONS = [
    ("so x = \\boxed{42}. Later: 7", "42"),
    ("\\boxed{1} then \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # the last box
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces balanced
    ("\\fbox{7} and 9", "7"),
    ("\\boxed{3} then \\boxed{4", "3"),  # the last box never closes: the one before it
    ("$\\boxed 5$", "5"),
    ("The answer is 12. Then 13", "12"),  # marker beats the last number
    ("the answer is: 3.5.", "3.5"),  # a decimal point is not a sentence end
    ("Answer: (B)\nbecause 4", "(B)"),  # up to the end of its line
    ("**Answer:** 42", "42"),  # markdown emphasis dropped
    ("step 1 = 3\n#### 1,234", "1,234"),  # GSM8K
    ("The answer is 5. Answer: 6", "6"),  # the last marker
    ("The answer is 18 dollars.", "18"),  # plain-word units after a number
    ("The answer is $2 \\sqrt{3}$.", "$2 \\sqrt{3}$"),  # not cut to its leading number
    ("The final answer is $7$. I hope it is correct.", "$7$"),  # Minerva's format
    ("The answer is\n\n9", "9"),  # on the next non-empty line
    ("2 + 3 = 5, and 10 - 4 = 6", "6"),  # last number
    ("it drops to -3", "-3"),
    ("between 3-5", "5"),  # a minus between two numbers is not a sign
    ("half is 1/2", "1/2"),
    ("it is $\\frac{3}{4}$", "\\frac{3}{4}"),
    ("a rate of 12.5\\%", "12.5\\%"),
    ("no digits at all", None),
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTIONS)
def test_final_answer(completion, expected):
    assert final_answer(completion) == expected


# (answer text, normalised text)
NORMALISATIONS = [
    ("$5$", "5"),
    ("1\\!000", "1000"),
    ("1\\,000", "1000"),
    ("1,234,567", "1234567"),
    ("1{,}000", "1000"),
    ("(1,2)", "(1,2)"),  # not thousands
    ("5.", "5"),
    ("+7", "7"),
    ("\\text{(A)}", "(A)"),
    ("10 \\text{ cm}", "10"),
    ("4\\mbox{ m}", "4"),
    ("90^\\circ", "90"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("\\rightarrow", "\\rightarrow"),  # only the \\left / \\right commands go
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "\\frac{1}{2}"),
    ("2\\sqrt3", "2\\sqrt{3}"),
    ("x = 5", "5"),
    ("50\\%", "50%"),
    (" a + b ", "a+b"),
]


@pytest.mark.parametrize(("text", "expected"), NORMALISATIONS)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("12", (Fraction(12), False)),
        ("-0.25", (Fraction(-1, 4), False)),
        (".5", (Fraction(1, 2), False)),
        ("3/4", (Fraction(3, 4), False)),
        ("-3/4", (Fraction(-3, 4), False)),
        ("\\frac{6}{8}", (Fraction(3, 4), False)),
        ("-\\frac{1}{3}", (Fraction(-1, 3), False)),
        ("\\frac{-1}{3}", (Fraction(-1, 3), False)),
        ("12.5%", (Fraction(25, 2), True)),
        ("1e3", (Fraction(1000), False)),
        ("1/0", None),
        ("\\frac{x}{2}", None),
        ("2\\sqrt{3}", None),
        ("(1,2)", None),
    ],
)
def test_parse_number(text, expected):
    assert parse_number(text) == expected


# (got, expected, same?)
COMPARISONS = [
    ("0.5", "1/2", True),
    ("\\frac{1}{2}", "0.50", True),
    ("\\dfrac{1}{2}", "\\frac12", True),
    ("-\\frac{1}{2}", "-0.5", True),
    ("0.1", "1/10", True),  # 0.1 read as the rational 1/10, not the float
    ("0.3333333", "1/3", False),  # no tolerance
    ("1,000", "1000", True),
    ("+3", "3", True),
    ("3", "-3", False),
    ("50%", "50\\%", True),
    ("50.0%", "50%", True),
    ("50%", "50", False),  # percentages only equal percentages
    ("50%", "0.5", False),
    ("12", "12.0", True),
    ("12", "13", False),
    ("10\\text{ cm}", "10", True),
    ("\\left(1,2\\right)", "(1, 2)", True),
    ("(1,2)", "(2,1)", False),
    ("2\\sqrt{3}", "2\\sqrt3", True),
    ("2\\sqrt{3}", "2", False),
    ("\\text{(A)}", "(A)", True),
    ("x=5", "5", True),
    ("", "", False),  # nothing is never an answer
]


@pytest.mark.parametrize(("got", "expected", "same"), COMPARISONS)
def test_same_answer(got, expected, same):
    assert same_answer(got, expected) is same
    assert same_answer(expected, got) is same  # symmetric


@pytest.mark.parametrize(
    ("record", "completion", "reward"),
    [
        ({"answer": "5"}, "2 + 3 = \\boxed{5}", 1.0),
        ({"answer": "5"}, "2 + 3 = \\boxed{6}", 0.0),
        ({"answer": 0.5}, "The answer is $\\frac{1}{2}$.", 1.0),  # a JSON number as answer
        ({"answer": "-\\frac{3}{4}"}, "so \\boxed{-0.75}", 1.0),
        ({"answer": "Tom has 3 + 4 = 7 apples.\n#### 7"}, "#### 7", 1.0),  # a GSM8K solution
        ({"answer": "so it is $\\boxed{12}$"}, "The answer is 12", 1.0),  # a MATH solution
        ({"answer": "1,200"}, "In total 1200 people came", 1.0),
        ({"answer": "25%"}, "The answer is 0.25", 0.0),
        ({"answer": "5"}, "I do not know", 0.0),
    ],
)
def test_math_answer_reward(record, completion, reward):
    assert get_reward("math_answer")(record, completion) == reward


def test_math_answer_needs_an_answer_field():
    with pytest.raises(KeyError, match="'answer'"):
        get_reward("math_answer")({"prompt": "2 + 3?"}, "\\boxed{5}")
