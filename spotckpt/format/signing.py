"""Signed manifests: who wrote a step, proven with Ed25519, and what its objects hold, with BLAKE3.

A CRC32C proves the bytes read are the bytes written, not who wrote them, and bytes with a
chosen CRC32C are easy to make: anyone with write access to the bucket prefix could forge a
manifest, or the objects behind one, that restore would trust. With a `Keyring` that holds a
signing key, every manifest (the flat document, or an indexed root and every index part) carries

- ``"job"``: the job identity (`spotckpt.catalog.JobIdentity`) and, as always, ``"step"``, so a
  signed manifest copied in from another step or another job is refused (a replay);
- ``"blake3"`` in every object's record: the BLAKE3 hash of the whole object, computed while
  the object streams out (no extra pass), checked by ``verify`` (and so ``export --verify``);
  and in every tensor chunk's and value's location, checked by every read of the step
  (`spotckpt.engine.chunks`). Only records read under the keyring may enter a signed manifest
  (`spotckpt.engine.incremental.may_vouch_for`), and none without a BLAKE3;
- ``"signature"``: ``{"key": <key id>, "ed25519": <base64>}``, an Ed25519 signature over
  `SIGNED_PREFIX` + the document without ``"signature"``, encoded canonically (`canonical`).

and a flat manifest or root says ``+signed`` in its ``format`` (`spotckpt.format.features`), so
an older spotckpt refuses it instead of reading it without the checks.

Why Ed25519 and not HMAC-SHA256: with HMAC every reader holds the secret that signs, so any
evaluation job, export host or person who may restore could also forge. Ed25519 splits them: the
training job holds the private key, readers only public keys (`verify_keys`), which are not
secret. Its cost, tens of microseconds a signature, is nothing against a save.

Reading with a keyring that has any key (`Keyring.enforcing`), a manifest without a signature, or
with one that does not verify under any accepted key (a forgery, a truncated or altered
signature, an edit after signing), or made for another step or job, is a `SignatureError` (a
`ManifestError`: restore quarantines the step like a corrupt one and falls back to an older one).
`accept_unsigned` lets steps saved before the key was set be read (a wrong signature is still
refused). Rotation: sign with the new key, keep the old public key in `verify_keys` until the
last step it signed is retired. No key, no check: signed manifests read exactly as unsigned ones.

Key material is held as raw bytes (the keyring pickles into DCP's upload process) and never
appears in a repr, a log line, an error or a manifest; a key file that does not load is named by
its path only.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from spotckpt.errors import BoundedJSONError, ConfigError, SignatureError
from spotckpt.format import bounded_json
from spotckpt.format.features import format_string, parse_format

SIGNED = "signed"
"""The format feature of a signed manifest."""
SIGNED_PREFIX = b"spotckpt-signed-manifest/1\n"
"""What a signature covers before the document: a signature made for anything else never fits."""
MAX_KEY_FILE_BYTES = 16 << 10
KeyProvider = Callable[[], "Keyring"]
"""A key-management hook (``key_provider``): returns the keyring to save and read with."""


def canonical(document: Mapping[str, Any]) -> bytes:
    """The bytes a signature covers: the document without its signature, keys sorted, compact
    separators, ASCII only; the same bytes for the writer and for any reader that parsed it."""
    unsigned = {k: v for k, v in document.items() if k != "signature"}
    body = json.dumps(unsigned, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return SIGNED_PREFIX + body.encode()


def key_id(public: bytes) -> str:
    """A short public name of a public key (16 hex digits of its BLAKE3), for rotation."""
    return blake3.blake3(public).hexdigest()[:16]


def new_hasher() -> Any:
    """The strong hash of an object (BLAKE3), updated while the object streams out."""
    return blake3.blake3()


@dataclass(frozen=True)
class Keyring:
    """The key that signs this job's manifests (if any) and the public keys accepted when
    reading (the signer's own among them). Raw key bytes only: picklable, never shown."""

    signer: bytes | None = field(default=None, repr=False)
    verifiers: tuple[bytes, ...] = field(default=(), repr=False)
    accept_unsigned: bool = False

    def __post_init__(self) -> None:
        accepted = list(self.verifiers)
        if self.signer is not None:
            own = _public_bytes(Ed25519PrivateKey.from_private_bytes(self.signer).public_key())
            if own not in accepted:
                accepted.insert(0, own)
        object.__setattr__(self, "verifiers", tuple(accepted))

    def __repr__(self) -> str:
        ids = ", ".join(key_id(v) for v in self.verifiers)
        return (
            f"Keyring(signs={self.signer is not None}, accepts=[{ids}], "
            f"accept_unsigned={self.accept_unsigned})"
        )

    @classmethod
    def generate(cls) -> Keyring:
        """A keyring with a fresh signing key (tests, and ``spotckpt keygen``-like scripts)."""
        key = Ed25519PrivateKey.generate()
        raw = key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return cls(signer=raw)

    @classmethod
    def from_files(
        cls,
        signing_key: str | None,
        verify_keys: str | None = None,
        *,
        accept_unsigned: bool = False,
    ) -> Keyring | None:
        """The keyring of the `signing_key` setting (path of a PEM Ed25519 private key) and
        `verify_keys` (PEM public or private keys, paths separated by ``os.pathsep``); None
        when neither is set."""
        paths = [p for p in (verify_keys or "").split(os.pathsep) if p]
        if signing_key is None and not paths:
            return None
        signer = None
        if signing_key is not None:
            signer = _private_bytes(_load_pem(signing_key, private=True), signing_key)
        verifiers = tuple(_public_of(_load_pem(path, private=False), path) for path in paths)
        return cls(signer=signer, verifiers=verifiers, accept_unsigned=accept_unsigned)

    @property
    def enforcing(self) -> bool:
        """Whether reads refuse unsigned and wrongly signed steps (any key configured)."""
        return bool(self.verifiers)

    def public_pem(self) -> bytes:
        """The signer's public key, PEM: what readers put in `verify_keys`."""
        if self.signer is None:
            raise ConfigError("this keyring has no signing key")
        public = Ed25519PrivateKey.from_private_bytes(self.signer).public_key()
        return public.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign(self, data: bytes, job: str, *, layout: str | None = None) -> bytes:
        """`data` (an encoded manifest, root or index part) with the job identity and a
        signature added; with `layout`, its format also names the ``signed`` feature."""
        if self.signer is None:
            raise ConfigError("no signing key: this keyring only verifies")
        document = json.loads(data)
        document["job"] = job
        if layout is not None:
            _, features = parse_format(document.get("format"), (layout,))
            document["format"] = format_string(layout, features | {SIGNED})
        key = Ed25519PrivateKey.from_private_bytes(self.signer)
        signature = key.sign(canonical(document))
        document["signature"] = {
            "key": key_id(self.verifiers[0]),
            "ed25519": base64.b64encode(signature).decode(),
        }
        return json.dumps(document, separators=(",", ":")).encode()

    def check(self, data: bytes, *, step: int, job: str | None, what: str) -> None:
        """SignatureError unless `data` (a manifest, root or index part of `step`) is signed by
        an accepted key for this `step` and `job` (or unsigned, with `accept_unsigned`)."""
        try:
            document = bounded_json.loads(data, what)
        except BoundedJSONError as error:
            raise SignatureError(f"{what}: {error}") from None
        if not isinstance(document, dict):
            raise SignatureError(f"{what} is not a JSON object")
        signature = document.get("signature")
        declared = SIGNED in str(document.get("format", "")).split("+")[1:]
        if signature is None and not declared and "job" not in document:
            if self.accept_unsigned:
                return
            raise SignatureError(
                f"{what} is not signed, and a signing key is configured: refused (a step "
                "saved before the key was set is read with accept_unsigned=True)"
            )
        self._verify(document, signature, what)
        if document.get("step") != step:
            raise SignatureError(
                f"{what} is signed for step {document.get('step')!r}, not {step}: a replayed "
                "manifest is refused"
            )
        if job is None or document.get("job") != job:
            raise SignatureError(
                f"{what} is signed for another job than this root's job.json: a replayed "
                "manifest is refused"
            )

    def _verify(self, document: dict[str, Any], signature: Any, what: str) -> None:
        if not isinstance(signature, dict) or not isinstance(signature.get("ed25519"), str):
            raise SignatureError(f"{what} has a missing or malformed signature: refused")
        try:
            raw = base64.b64decode(signature["ed25519"], validate=True)
        except ValueError:
            raise SignatureError(f"{what} has a signature that is not base64: refused") from None
        if len(raw) != 64:
            raise SignatureError(f"{what} has a truncated signature ({len(raw)} bytes): refused")
        message = canonical(document)
        for public in self.verifiers:
            try:
                Ed25519PublicKey.from_public_bytes(public).verify(raw, message)
                return
            except InvalidSignature:
                continue
        raise SignatureError(
            f"{what}: the signature does not verify under any accepted key (a forged or altered "
            f"manifest, or one signed with key {str(signature.get('key'))[:16]!r}, which is not "
            "among the accepted ones): refused"
        )


def keyring_of(settings: Any) -> Keyring | None:
    """The keyring of a manager's settings: the `key_provider` hook's, else the key files."""
    if settings.key_provider is not None:
        ring = settings.key_provider()
        if not isinstance(ring, Keyring):
            raise ConfigError("key_provider must return a spotckpt.format.signing.Keyring")
        return ring
    return Keyring.from_files(
        settings.signing_key, settings.verify_keys, accept_unsigned=settings.accept_unsigned
    )


def _public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _load_pem(path: str, *, private: bool) -> Any:
    """A PEM key from `path`; errors name the path only, never the file's bytes."""
    try:
        with Path(path).open("rb") as handle:
            data = handle.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as error:
        raise ConfigError(f"cannot read key file {path}: {error.strerror or error}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise ConfigError(f"key file {path} is too large for a PEM key")
    try:
        if private or b"PRIVATE KEY" in data:
            return serialization.load_pem_private_key(data, password=None)
        return serialization.load_pem_public_key(data)
    except (ValueError, TypeError):
        raise ConfigError(
            f"key file {path} does not hold an unencrypted PEM Ed25519 "
            f"{'private' if private else 'public or private'} key"
        ) from None


def _private_bytes(key: Any, path: str) -> bytes:
    if not isinstance(key, Ed25519PrivateKey):
        raise ConfigError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
    return key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )


def _public_of(key: Any, path: str) -> bytes:
    if isinstance(key, Ed25519PrivateKey):
        return _public_bytes(key.public_key())
    if not isinstance(key, Ed25519PublicKey):
        raise ConfigError(f"key file {path} holds a {type(key).__name__}, not an Ed25519 key")
    return _public_bytes(key)
