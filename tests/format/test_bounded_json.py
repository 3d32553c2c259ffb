"""`bounded_json.check_bounds` decides as blanking every string literal does (issue 48).

The common document takes a shortcut (no backslash, no long run of digits anywhere); these tests
hold it to the general rule on random documents, full of brackets, quotes, digits and escapes
inside and outside string literals, near the depth and digit limits.
"""

from __future__ import annotations

import random
import re

import pytest

from spotckpt.errors import BoundedJSONError
from spotckpt.format.bounded_json import MAX_DEPTH, MAX_NUMBER_DIGITS, check_bounds

_LITERAL = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)


def _reference(data: bytes) -> str | None:
    """The rule spelled out: blank every literal, then measure digit runs and bracket depth
    (an upper bound of the depth for unbalanced brackets, exact for balanced ones)."""
    outside = _LITERAL.sub(b'""', data)
    if re.search(rb"[0-9]{%d}" % (MAX_NUMBER_DIGITS + 1), outside):
        return f"doc holds a number of more than {MAX_NUMBER_DIGITS} digits"
    brackets = re.sub(rb"[^\[\]]", b"", outside.translate(bytes.maketrans(b"{}", b"[]")))
    levels = 0
    while levels <= MAX_DEPTH and b"[]" in brackets:
        brackets, levels = brackets.replace(b"[]", b""), levels + 1
    if levels + brackets.count(b"[") > MAX_DEPTH:
        return f"doc nests deeper than {MAX_DEPTH} levels"
    return None


def _verdict(data: bytes) -> str | None:
    try:
        check_bounds(data, "doc")
    except BoundedJSONError as error:
        return str(error)
    return None


_PIECES = [b"[", b"]", b"{", b"}", b'"', b'"', b"a", b":", b",", b" ", b"7"]


def _document(rng: random.Random, backslashes: bool) -> bytes:
    pieces = [*_PIECES, b"\\", b'\\"', b"\\\\"] if backslashes else _PIECES
    out = []
    for _ in range(rng.randrange(1, 60)):
        out.append(rng.choice(pieces) * rng.choice((1, 1, 1, 5, 12, 24, 40, 70)))
    return b"".join(out)


@pytest.mark.parametrize("backslashes", [False, True], ids=["plain", "escapes"])
def test_random_documents_get_the_verdict_of_blanking_every_literal(backslashes: bool) -> None:
    rng = random.Random(48)
    verdicts: set[str | None] = set()
    for _ in range(4000):
        data = _document(rng, backslashes)
        expected = _reference(data)
        assert _verdict(data) == expected, data
        verdicts.add(expected)
    assert verdicts == {
        None,
        f"doc holds a number of more than {MAX_NUMBER_DIGITS} digits",
        f"doc nests deeper than {MAX_DEPTH} levels",
    }


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b'{"a":"' + b"[" * 100 + b'"}', None),
        (b'{"a":' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}", "nests deeper"),
        (b"[" * MAX_DEPTH + b"]" * MAX_DEPTH, None),
        (b'["]' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b'"]', None),
        (b'["' + b"]" * 3 + b'",' + b"[" * MAX_DEPTH + b"]" * (MAX_DEPTH + 1), "nests deeper"),
        (b'"' + b"[" * 100, None),  # unterminated literal to the end
        (b'"a"' + b"[" * 100, "nests deeper"),
        (b'["' + b"9" * 50 + b'",1]', None),
        (b'["x",' + b"9" * (MAX_NUMBER_DIGITS + 1) + b"]", "more than"),
        (b"[" + b"9" * MAX_NUMBER_DIGITS + b"]", None),
        (b'["\\"' + b"[" * 100 + b'"]', None),  # an escaped quote does not end the literal
        (b'["\\\\"' + b"[" * 100 + b'"]', "nests deeper"),  # an escaped backslash does
    ],
)
def test_literals_hide_brackets_and_digits_and_nothing_else(
    data: bytes, expected: str | None
) -> None:
    verdict = _verdict(data)
    assert verdict == _reference(data)
    if expected is None:
        assert verdict is None
    else:
        assert verdict is not None and expected in verdict
