"""End-to-end encryption of requests and response chunks: NaCl box via PyNaCl.

* ``ProviderIdentity`` — our static X25519 key pair; ``public_key_b64`` is the exact string registered in
  ``register.public_key``, answered in challenges and put in every ``encrypted_data.ephemeral_public_key``.
* ``RequestBox`` — one per request: a ``nacl.public.Box`` between our key and the request's session key,
  so the shared key is computed once. It opens the ``encrypted_body`` and seals every response chunk.

Wire format of a sealed value: standard padded base64 of ``nonce (24) ‖ tag (16) ‖ ciphertext``, a fresh
random nonce per message. Base64 is parsed strictly (Go ``StdEncoding``): URL-safe, unpadded or otherwise
malformed input is an error, as is a key that is not exactly 32 bytes.

Persistence: ``save``/``load`` keep the secret key as one base64 line in a file only its owner can read;
``save`` writes 0600 atomically. That is the only file I/O in ``protocol/``.
"""

from __future__ import annotations

import base64
import binascii
import os

import nacl.exceptions
from nacl.public import Box, PrivateKey, PublicKey

from kvcache.disk import atomic_write
from protocol._wire import EncryptedPayload
from protocol.to_coordinator import InferenceResponseChunk

KEY_BYTES = 32
NONCE_BYTES = Box.NONCE_SIZE
_OVERHEAD = NONCE_BYTES + 16  # nonce + Poly1305 tag

__all__ = [
    "CryptoError",
    "DecryptError",
    "InvalidKeyError",
    "KeyFileError",
    "ProviderIdentity",
    "RequestBox",
    "b64decode_strict",
    "b64encode",
    "parse_public_key",
    "write_private_file",
]


class CryptoError(ValueError):
    """Base of every error here. Texts are fixed: they never quote keys, ciphertext or plaintext."""


class InvalidKeyError(CryptoError):
    """A key is not standard padded base64 of exactly 32 bytes."""


class DecryptError(CryptoError):
    """A sealed value is malformed or fails authentication (tampered, or sealed to another key)."""


class KeyFileError(CryptoError):
    """A key file is unreadable, malformed, or readable by someone other than its owner."""


def b64encode(data: bytes) -> str:
    """Standard alphabet, padded (Go ``base64.StdEncoding``)."""
    return base64.b64encode(data).decode("ascii")


def b64decode_strict(text: str) -> bytes:
    """Decode standard padded base64; anything else (URL-safe, unpadded, whitespace) raises ValueError."""
    if not isinstance(text, str) or not text.isascii():
        raise ValueError("not ASCII base64 text")
    if len(text) % 4:  # b64decode would accept stray padding such as "YWJj="
        raise ValueError("base64 length is not a multiple of 4")
    try:
        return base64.b64decode(text, validate=True)
    except binascii.Error:
        raise ValueError("not standard padded base64") from None


def parse_public_key(text: str) -> PublicKey:
    """A peer's X25519 public key from its wire form."""
    try:
        raw = b64decode_strict(text)
    except ValueError:
        raise InvalidKeyError("public key is not standard padded base64") from None
    if len(raw) != KEY_BYTES or b64encode(raw) != text:
        raise InvalidKeyError("public key is not the canonical base64 of 32 bytes")
    return PublicKey(raw)


def write_private_file(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` with mode 0600 whatever the umask, atomically and durably
    (`kvcache.disk.atomic_write`: a fresh temp name, fsync, rename, fsync of the directory). Key
    files are the one bit of file I/O this package does."""
    atomic_write(path, data, mode=0o600)


class RequestBox:
    """The box of one request: opens its body, seals its chunks. Create it with ``ProviderIdentity``."""

    __slots__ = ("_box", "_sender_key")

    def __init__(self, box: Box, sender_key_b64: str) -> None:
        self._box = box
        self._sender_key = sender_key_b64

    def open(self, ciphertext_b64: str) -> bytes:
        """Plaintext of one sealed value (nonce ‖ tag ‖ ciphertext, base64)."""
        try:
            sealed = b64decode_strict(ciphertext_b64)
        except ValueError:
            raise DecryptError("ciphertext is not standard padded base64") from None
        if len(sealed) < _OVERHEAD:
            raise DecryptError("ciphertext is shorter than nonce and tag")
        try:
            return self._box.decrypt(sealed)
        except nacl.exceptions.CryptoError:
            raise DecryptError("ciphertext failed authentication") from None

    def seal(self, plaintext: bytes, *, nonce: bytes | None = None) -> EncryptedPayload:
        """Seal one value for the peer. ``nonce`` exists for test vectors only: never reuse one."""
        sealed = self._box.encrypt(plaintext, nonce)
        return EncryptedPayload(ephemeral_public_key=self._sender_key, ciphertext=b64encode(sealed))

    def seal_chunk(self, request_id: str, event: bytes) -> InferenceResponseChunk:
        """The ``inference_response_chunk`` frame carrying one SSE event, sealed."""
        return InferenceResponseChunk(request_id=request_id, encrypted_data=self.seal(event))


class ProviderIdentity:
    """Our X25519 key pair."""

    __slots__ = ("_private", "public_key_b64")

    def __init__(self, private_key: PrivateKey) -> None:
        self._private = private_key
        self.public_key_b64: str = b64encode(bytes(private_key.public_key))

    @classmethod
    def generate(cls) -> ProviderIdentity:
        return cls(PrivateKey.generate())

    @classmethod
    def from_private_bytes(cls, raw: bytes) -> ProviderIdentity:
        if len(raw) != KEY_BYTES:
            raise InvalidKeyError("private key must be 32 bytes")
        return cls(PrivateKey(bytes(raw)))

    def private_bytes(self) -> bytes:
        return bytes(self._private)

    def box_for(self, peer_public_key_b64: str) -> RequestBox:
        """The box shared with one peer key (a request's ``encrypted_body.ephemeral_public_key``). A
        low-order point (all-zero key, …) is refused: libsodium will not derive the all-zero secret."""
        peer = parse_public_key(peer_public_key_b64)
        try:
            box = Box(self._private, peer)
        except nacl.exceptions.CryptoError:
            raise InvalidKeyError("public key is a low-order point") from None
        return RequestBox(box, self.public_key_b64)

    def open_request(self, encrypted_body: EncryptedPayload) -> tuple[RequestBox, bytes]:
        """Open a request body; the returned box seals that request's chunks."""
        box = self.box_for(encrypted_body.ephemeral_public_key)
        return box, box.open(encrypted_body.ciphertext)

    # --- persistence ---------------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the secret key to ``path`` with mode 0600, atomically (temp file, fsync, rename)."""
        write_private_file(path, (b64encode(self.private_bytes()) + "\n").encode("ascii"))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ProviderIdentity:
        """Read a key written by ``save``; refuses a file that group or others may read or write."""
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_mode & 0o077:
                    raise KeyFileError("key file must not be accessible to group or others (chmod 600)")
                content = handle.read(256)
        except OSError as exc:
            raise KeyFileError(f"key file cannot be read ({exc.strerror})") from None
        try:
            raw = b64decode_strict(content.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            raise KeyFileError("key file does not hold a base64 key") from None
        if len(raw) != KEY_BYTES:
            raise KeyFileError("key file does not hold a 32-byte key")
        return cls.from_private_bytes(raw)
