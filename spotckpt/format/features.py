"""Format versions and named features: the one scheme by which a manifest says what its reader must
understand.

A manifest's ``format`` is a layout version, optionally followed by the features it uses, each
after a ``+``: ``spotckpt/1`` (one document), ``spotckpt/2`` (an indexed root and its parts),
``spotckpt/1+references`` (chunks may lie in an earlier step's objects), ``spotckpt/1+compressed``
(chunks stored compressed, `spotckpt.format.compression`). A
manifest that uses no feature is written exactly as before, so older readers keep reading it; one
that uses a feature carries a format string that no older reader accepts (they compare it whole),
so an older spotckpt skips the step with "unknown manifest format" instead of reading bytes it
does not understand. A reader refuses a step naming a feature it does not know in the same way
(`UnknownFormatError`: skipped, never quarantined, since the step may be healthy for a newer
reader). Every format change adds one feature name to `KNOWN_FEATURES`; layout versions change only
when the document's shape does.
"""

from __future__ import annotations

from collections.abc import Iterable

from spotckpt.errors import UnknownFormatError

KNOWN_FEATURES: frozenset[str] = frozenset({"compressed", "packed", "references", "signed"})
"""Every feature this spotckpt reads, by name; a writer may only use these."""
MAX_FORMAT_CHARS = 256


def format_string(layout: str, features: Iterable[str] = ()) -> str:
    """The ``format`` value of a manifest of `layout` that uses `features` (sorted, so that one
    set of features has one spelling)."""
    names = sorted(set(features))
    unknown = [name for name in names if name not in KNOWN_FEATURES]
    if unknown:
        raise ValueError(f"unknown manifest feature(s) {unknown}; known: {sorted(KNOWN_FEATURES)}")
    return "+".join([layout, *names])


def parse_format(value: object, layouts: Iterable[str]) -> tuple[str, frozenset[str]]:
    """Split a manifest's ``format`` into its layout (one of `layouts`) and features, refusing
    (`UnknownFormatError`) an unknown layout or a feature this spotckpt does not know."""
    readable = sorted(layouts)
    if not isinstance(value, str) or len(value) > MAX_FORMAT_CHARS:
        raise UnknownFormatError(
            f"unknown manifest format {str(value)[:40]!r}; this spotckpt reads {readable}"
        )
    layout, *names = value.split("+")
    if layout not in readable:
        raise UnknownFormatError(
            f"unknown manifest format {value[:40]!r}; this spotckpt reads {readable}"
        )
    unknown = sorted(set(names) - KNOWN_FEATURES)
    if unknown:
        raise UnknownFormatError(
            f"manifest format {value[:80]!r} uses feature(s) {unknown} that this spotckpt does "
            "not read; a newer spotckpt wrote it: upgrade spotckpt to restore this step"
        )
    return layout, frozenset(names)
