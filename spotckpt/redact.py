"""Text that is safe to print: credentials redacted, control characters escaped.

`redact` removes ``user:password@`` from URLs, the values of ``secret=...``-like pairs (Azure's
``AccountKey=`` inside a connection string and ``account_key``/``connection_string`` options
among them), the ``sig=`` signature of an Azure SAS URL or token, PEM private keys (the whole
block, or all that follows its first line when the end is cut off), and any known secret value;
`printable` escapes control characters (such as ``"\\x1b[2J"`` or ``"\\n"`` in a tensor name
read from a bucket) so they never reach a terminal raw. Config errors, the CLI
and its log lines use both.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Mapping
from typing import Any

MASK = "***"
SECRET_WORDS = (
    "secret",
    "token",
    "password",
    "passwd",
    "credential",
    "key_id",
    "access_key",
    "account_key",
    "accountkey",
    "connection_string",
    "private",
    "signature",
)
_MIN_SECRET_LENGTH = 4
_URL_USERINFO = re.compile(r"(?P<scheme>\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@?#]*@")
_BARE_USERINFO = re.compile(r"(?<![\w/:.%+-])[\w.%+-]+:[^\s/@?#\"'`]+@(?=[\w\[])")
_SECRET_PAIR = re.compile(
    r"(?P<key>\b[\w.-]*(?:" + "|".join(SECRET_WORDS) + r")[\w.-]*)"
    r"(?P<sep>\s*=\s*|[\"']\s*:\s*)(?P<quote>[\"']?)(?P<value>[^\"'\s,;&}\]]+)",
    re.IGNORECASE,
)
_SAS_SIGNATURE = re.compile(r"(?P<key>(?<![\w.-])sig=)(?P<value>[^&\s\"';,]+)", re.IGNORECASE)
_PEM_PRIVATE_KEY = re.compile(
    r"-----BEGIN (?P<kind>[A-Z0-9 ]*PRIVATE KEY)-----.*?(?:-----END (?P=kind)-----|\Z)", re.DOTALL
)
_UNPRINTABLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def is_secret_key(key: str) -> bool:
    """Whether an option named `key` holds a credential (``aws_secret_access_key``, ``token``)."""
    return any(word in key.lower() for word in SECRET_WORDS)


def secret_values(options: Mapping[str, Any]) -> set[str]:
    """The values of `options` whose keys name credentials (long enough to mask safely)."""
    return {
        str(value)
        for key, value in options.items()
        if is_secret_key(str(key)) and len(str(value)) >= _MIN_SECRET_LENGTH
    }


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with URL credentials, ``secret=value`` pairs and each of `secrets` masked."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= _MIN_SECRET_LENGTH:
            text = text.replace(secret, MASK)
    text = _PEM_PRIVATE_KEY.sub(f"{MASK} (a PEM private key)", text)
    text = _URL_USERINFO.sub(lambda m: f"{m['scheme']}{MASK}@", text)
    text = _BARE_USERINFO.sub(f"{MASK}@", text)
    text = _SAS_SIGNATURE.sub(lambda m: f"{m['key']}{MASK}", text)
    return _SECRET_PAIR.sub(lambda m: f"{m['key']}{m['sep']}{m['quote']}{MASK}", text)


def printable(text: str) -> str:
    """`text` with control, format and separator characters written as escapes (``\\x1b``)."""
    if text.isprintable():
        return text
    return "".join(_escape(c) for c in text)


def _escape(char: str) -> str:
    if unicodedata.category(char) not in _UNPRINTABLE_CATEGORIES:
        return char
    return char.encode("unicode_escape").decode("ascii")
