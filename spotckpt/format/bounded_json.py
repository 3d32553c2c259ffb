"""JSON from a bucket, parsed with bounded cost: nesting depth and number length are checked first.

`json.loads` recurses once per nesting level (100,000 brackets raise RecursionError) and converts
integers of any length (quadratic in the digit count, or ValueError past Python's digit limit).
`loads` refuses both before parsing, with a few C-speed passes over the bytes: string literals are
blanked out, then every run of digits and the bracket nesting are measured. Every failure is a
`BoundedJSONError` that names the problem.

Blanking the literals with a regular expression costs ~15 ns a byte; the common document (no
backslash, no long run of digits anywhere: every manifest json.dumps writes with ASCII names) takes
a shortcut of ~2 ns a byte that finds the same brackets outside strings (`_brackets_outside`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from spotckpt.errors import BoundedJSONError

MAX_DEPTH = 64
MAX_NUMBER_DIGITS = 20  # 2**64 - 1 has 20 digits

# A string literal runs to its closing quote or, unterminated, to the end of the input: always
# matched on the first try from its opening quote, so the scan stays linear for any input.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_DIGITS_TO_ZERO = bytes(0x30 if 0x30 <= c <= 0x39 else 0x20 for c in range(256))
_TOO_MANY_DIGITS = b"0" * (MAX_NUMBER_DIGITS + 1)
_OPENERS_TO_BRACKET = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_NOT_QUOTES_OR_BRACKETS = bytes(c for c in range(256) if c not in b'"[]{}')


def loads(data: bytes, what: str) -> Any:
    """Parse UTF-8 JSON `data` (described as `what` in errors) once its bounds are checked."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise BoundedJSONError(f"{what} is not UTF-8 (truncated or corrupt?): {error}") from None
    check_bounds(data, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise BoundedJSONError(
            f"{what} is not valid JSON (truncated or corrupt?): {error}"
        ) from None


def check_bounds(data: bytes, what: str) -> None:
    """Refuse UTF-8 JSON that nests deeper than MAX_DEPTH or has a number of too many digits."""
    if b"\\" in data or _TOO_MANY_DIGITS in data.translate(_DIGITS_TO_ZERO):
        outside_strings = _STRING.sub(b'""', data)
        if _TOO_MANY_DIGITS in outside_strings.translate(_DIGITS_TO_ZERO):
            raise BoundedJSONError(f"{what} holds a number of more than {MAX_NUMBER_DIGITS} digits")
        brackets = outside_strings.translate(_OPENERS_TO_BRACKET, _NOT_BRACKETS)
    else:
        brackets = _brackets_outside(data)
    if _nesting_bound(brackets) > MAX_DEPTH:
        raise BoundedJSONError(f"{what} nests deeper than {MAX_DEPTH} levels")


def _brackets_outside(data: bytes) -> bytes:
    """The brackets outside string literals of `data` that holds no backslash, as ``[`` and ``]``:
    what blanking out the literals (`_STRING`) and then keeping the brackets gives.

    Without a backslash no literal has an escape: each runs from an opening quote to the next
    quote, or to the end. So a byte lies outside every literal exactly when an even number of
    quotes precede it and it is no quote itself. No digit is counted here: a run of digits outside
    the literals is a run of `data` too (a blanked literal leaves quotes between its neighbours),
    so `check_bounds` takes this path only when `data` has no run of too many digits at all.
    """
    marks = np.frombuffer(data.translate(_OPENERS_TO_BRACKET, _NOT_QUOTES_OR_BRACKETS), np.uint8)
    quotes = marks == ord('"')
    inside = np.bitwise_xor.accumulate(quotes)  # odd number of quotes up to here (it included)
    return marks[~(inside | quotes)].tobytes()


def _nesting_bound(brackets: bytes) -> int:
    """An upper bound of the nesting depth of a string of ``[`` and ``]``, exact when balanced.

    Each pass deletes the innermost pairs (``[]``), one level. What no pass can shorten is
    closers then openers (``]]][[``); its openers may still nest on top of the deleted levels.
    """
    levels = 0
    while levels <= MAX_DEPTH:
        inner = brackets.replace(b"[]", b"")
        if len(inner) == len(brackets):
            break
        brackets, levels = inner, levels + 1
    return levels + brackets.count(b"[")
