"""The provider's long-lived keys, kept under ``settings.state_dir/identity/`` (directory 0700, files 0600).

* ``x25519.key`` — the end-to-end encryption key (``protocol.crypto.ProviderIdentity``): its public half
  is ``register.public_key``, the ``public_key`` of every challenge answer and the
  ``ephemeral_public_key`` of every response chunk.
* ``challenge-p256.pem`` — the P-256 key that signs challenge answers (``protocol.attest.ChallengeSigner``),
  the role the Secure Enclave key plays in the reference providers. A software key proves continuity of
  identity, not hardware: we never claim more.

Both are created on first run and reused afterwards. A key file that group or others can read is refused
(``KeyFileError``) rather than silently used or replaced: someone may have copied it.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from protocol.attest import ChallengeSigner
from protocol.crypto import KeyFileError, ProviderIdentity, write_private_file
from provider.telemetry import get_logger

log = get_logger("provider.session.identity")

IDENTITY_DIR = "identity"
X25519_FILE = "x25519.key"
SIGNING_FILE = "challenge-p256.pem"
# The signing key is a software key in a file (0600): no Secure Enclave holds it. The attestation's
# secureEnclaveAvailable says the host has an Enclave, not that it holds this key; the coordinator cannot
# tell the two apart, and doctor says so (provider.session.attestation).
SIGNING_KEY_IN_SECURE_ENCLAVE = False


@dataclass(frozen=True, slots=True)
class Keys:
    encryption: ProviderIdentity
    signer: ChallengeSigner


def identity_dir(state_dir: Path) -> Path:
    return Path(state_dir) / IDENTITY_DIR


def load_or_create_keys(state_dir: Path) -> Keys:
    """The provider's keys, created on first run. Blocking file I/O: call it off the event loop."""
    directory = identity_dir(state_dir)
    _ensure_private_dir(directory)
    return Keys(_encryption_key(directory / X25519_FILE), _signing_key(directory / SIGNING_FILE))


def _ensure_private_dir(directory: Path) -> None:
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    mode = stat.S_IMODE(directory.stat().st_mode)
    if mode & 0o077:
        os.chmod(directory, 0o700)  # ours to fix: we created it, or the operator pointed us at it


def _encryption_key(path: Path) -> ProviderIdentity:
    if path.exists():
        return ProviderIdentity.load(path)
    identity = ProviderIdentity.generate()
    identity.save(path)
    log.info("identity_created", kind="x25519", path=path)
    return identity


def _signing_key(path: Path) -> ChallengeSigner:
    if path.exists():
        try:
            with open(path, "rb") as handle:
                if os.fstat(handle.fileno()).st_mode & 0o077:
                    raise KeyFileError("key file must not be accessible to group or others (chmod 600)")
                pem = handle.read(16 * 1024)
        except OSError as exc:
            raise KeyFileError(f"key file cannot be read ({exc.strerror})") from None
        try:
            return ChallengeSigner.from_pem(pem)
        except ValueError:
            raise KeyFileError("key file does not hold a P-256 private key") from None
    signer = ChallengeSigner.generate()
    write_private_file(path, signer.to_pem())
    log.info("identity_created", kind="p256", path=path)
    return signer


__all__ = ["IDENTITY_DIR", "SIGNING_FILE", "SIGNING_KEY_IN_SECURE_ENCLAVE", "X25519_FILE", "Keys", "identity_dir", "load_or_create_keys"]
