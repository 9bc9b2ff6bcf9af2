"""Final answers of math completions: extraction, normalisation and comparison.

A completion's final answer is the content of its last ``\\boxed{...}`` (or ``\\fbox{...}``),
else what follows its last answer marker (``The answer is``, ``The final answer is``,
``Answer:``, GSM8K's ``####``), else its last number. Both it and the reference are then
normalised (the rules of MATH's reference grader, Hendrycks et al. 2021, where they are
unambiguous) and compared exactly: as rationals (:class:`fractions.Fraction`, so ``0.5``,
``1/2``, ``\\frac{1}{2}`` and ``\\dfrac12`` are one answer and no float rounding can make two
different answers equal) when both are numbers, else as strings.

Percentages: ``50%`` equals ``50.0\\%`` but neither ``50`` nor ``0.5``. Without the sign a
bare number is ambiguous (is ``0.5`` a half or half a percent?), so the strict rule is the
one that never rewards a guess at the unit; MATH's grader, which deletes ``\\%``, accepts
``50`` for ``50\\%`` and so cannot tell ``0.5`` from ``0.5\\%``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from fractions import Fraction
from typing import Any

__all__ = [
    "final_answer",
    "math_answer",
    "normalize_answer",
    "parse_number",
    "reference_answer",
    "same_answer",
]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)")
_MARKER_RE = re.compile(r"(?:the\s+)?(?:final\s+)?answer\s*(?:is\s*:?|:)|####", re.IGNORECASE)
_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")
# A number as text shows it: sign only where it cannot be a minus between two terms.
_NUM = r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_LAST_NUMBER_RE = re.compile(
    rf"(?:(?<![\w)])-)?\\[dt]?frac\{{\d+\}}\{{\d+\}}|{_NUM}(?:/\d+)?(?:\\?%)?"
)
_LEADING_NUMBER_RE = re.compile(rf"^\$?({_NUM}(?:/\d+)?\\?%?)\$?\s+[A-Za-z]")

_TEXT_CMD = r"\\(?:text|textbf|mbox|mathrm)\{([^{}]*)\}"
_TEXT_WHOLE_RE = re.compile(rf"^{_TEXT_CMD}$")
_TEXT_UNITS_RE = re.compile(rf"(?<=.){_TEXT_CMD}$")
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SPACING_RE = re.compile(r"\\[!,;:> ]|\\q?quad|\\displaystyle")
_DEGREES_RE = re.compile(r"\^\{?\\circ\}?")
_THOUSANDS_RE = re.compile(r"(?<=\d)(?:,|\{,\})(?=\d{3}(?!\d))")
_ASSIGNMENT_RE = re.compile(r"^[A-Za-z]\s*=(?!=)")
_SHORT_FRAC_RE = re.compile(r"\\frac(\d)(\d)")
_SHORT_SQRT_RE = re.compile(r"\\sqrt(\d)")

_DECIMAL = r"\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
_DECIMAL_RE = re.compile(rf"[-+]?(?:{_DECIMAL})")
_SLASH_RE = re.compile(rf"(-?)({_DECIMAL})/({_DECIMAL})")
_FRAC_RE = re.compile(rf"(-?)\\frac\{{(-?(?:{_DECIMAL}))\}}\{{(-?(?:{_DECIMAL}))\}}")


def _braced(text: str, start: int) -> str | None:
    """The text inside the brace group opening at ``text[start]``; None if it never closes."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last complete ``\\boxed{...}`` / ``\\fbox{...}`` (or ``\\boxed 5``)."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        rest = text[match.end() :]
        if rest.startswith("{"):
            content = _braced(text, match.end())
            if content is not None:  # else cut off mid-answer: try the one before
                return content
        elif rest.startswith(" "):
            token = rest.lstrip().split("$")[0].split()
            if token:
                return token[0]
    return None


def _after_marker(text: str) -> str | None:
    """The sentence after the last answer marker (on the next non-empty line if it ends one)."""
    markers = list(_MARKER_RE.finditer(text))
    if not markers:
        return None
    rest = text[markers[-1].end() :].strip()
    if not rest:
        return None
    line = rest.splitlines()[0]
    end = _SENTENCE_END_RE.search(line)
    answer = (line[: end.start()] if end else line).strip().strip("*`").strip()
    if not answer:
        return None
    if parse_number(normalize_answer(answer)) is None:  # "18 dollars": the number only
        leading = _LEADING_NUMBER_RE.match(answer)
        if leading:
            return leading.group(1)
    return answer


def final_answer(completion: str) -> str | None:
    """The completion's final answer, unnormalised: the last ``\\boxed{}``/``\\fbox{}``
    content, else the text after the last answer marker, else the last number; None if
    there is none of them."""
    boxed = _last_boxed(completion)
    if boxed is not None:
        return boxed
    marked = _after_marker(completion)
    if marked is not None:
        return marked
    numbers = _LAST_NUMBER_RE.findall(completion)
    return numbers[-1] if numbers else None


def reference_answer(answer: Any) -> str:
    """A record's ``answer`` as the answer to compare with: a full MATH solution counts by its
    ``\\boxed{}`` and a full GSM8K solution by what follows its ``####``."""
    text = str(answer)
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    if "####" in text:
        return text.rsplit("####", 1)[1].strip()
    return text


def normalize_answer(text: str) -> str:
    """The canonical string form of an answer: LaTeX spacing, ``$``, ``\\left``/``\\right``,
    ``\\text{}`` wrappers and units, degrees, thousands separators, whitespace, a trailing
    period, a leading ``+`` and a leading ``x =`` removed; ``\\dfrac``/``\\tfrac`` written
    ``\\frac``, ``\\frac12`` as ``\\frac{1}{2}``, ``\\sqrt3`` as ``\\sqrt{3}``."""
    s = text.strip()
    s = _LEFT_RIGHT_RE.sub("", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _SPACING_RE.sub("", s)
    s = s.replace("$", "").replace("\\%", "%")
    s = _DEGREES_RE.sub("", s).strip()
    whole = _TEXT_WHOLE_RE.match(s)
    s = whole.group(1) if whole else _TEXT_UNITS_RE.sub("", s)
    s = "".join(s.split())
    s = _THOUSANDS_RE.sub("", s)
    s = s.rstrip(".")
    s = _ASSIGNMENT_RE.sub("", s)
    s = s.removeprefix("+")
    s = _SHORT_FRAC_RE.sub(r"\\frac{\1}{\2}", s)
    return _SHORT_SQRT_RE.sub(r"\\sqrt{\1}", s)


def parse_number(text: str) -> tuple[Fraction, bool] | None:
    """``(value, is_percentage)`` of a normalised answer that is a number (integer, decimal,
    ``a/b``, ``\\frac{a}{b}``, each optionally negative, optionally ending in ``%``); None
    otherwise, or for a zero denominator."""
    percent = text.endswith("%")
    s = text[:-1] if percent else text
    try:
        if _DECIMAL_RE.fullmatch(s):
            return Fraction(s), percent
        match = _SLASH_RE.fullmatch(s) or _FRAC_RE.fullmatch(s)
        if match:
            sign, num, den = match.groups()
            value = Fraction(num) / Fraction(den)
            return (-value if sign else value), percent
    except ZeroDivisionError:
        return None
    return None


def same_answer(got: str, expected: str) -> bool:
    """Whether two answers agree after :func:`normalize_answer`: exactly as numbers (with the
    same use of ``%``) when both are numbers, else as strings."""
    a, b = normalize_answer(got), normalize_answer(expected)
    na, nb = parse_number(a), parse_number(b)
    if na is not None and nb is not None:
        return na == nb
    return a == b and a != ""


def math_answer(record: Mapping[str, Any], completion: str) -> float:
    """1.0 when the completion's :func:`final_answer` equals ``record["answer"]``, else 0.0."""
    if "answer" not in record:
        raise KeyError(f"math_answer needs an 'answer' field in the record (has: {sorted(record)})")
    got = final_answer(completion)
    return 1.0 if got is not None and same_answer(got, reference_answer(record["answer"])) else 0.0
