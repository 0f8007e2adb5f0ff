"""Signing for the coordinator: the registration attestation and challenge answers.

Registration attestation (``register.attestation``; [A] attestation.go ``AttestationBlob`` /
``Verify``, Swift ``AttestationService.createAttestation``):

* ``{"attestation": <blob>, "signature": <base64 DER ECDSA P-256>}``. The signature covers SHA-256 of
  the blob's exact bytes: [A] keeps the blob as ``json.RawMessage`` and hashes what it received, so
  ``sign_attestation`` returns a ``RawJSON`` whose blob text is the signed text, and ``codec.encode``
  splices it into the frame unchanged.
* The blob is one compact JSON object with sorted keys (Swift's ``JSONEncoder`` with ``.sortedKeys``).
  Always present: ``authenticatedRootEnabled``, ``chipName``, ``hardwareModel``, ``hypervisorActive``,
  ``osVersion``, ``publicKey``, ``rdmaDisabled``, ``secureBootEnabled``, ``secureEnclaveAvailable``,
  ``sipEnabled``, ``timestamp``. Left out when empty (Go ``omitempty``, Swift ``nil``):
  ``binaryHash``, ``encryptionPublicKey``, ``serialNumber``, ``systemVolumeHash``.
* ``publicKey``: the signing key's uncompressed X9.62 point (65 bytes, ``0x04‖X‖Y``), base64; [A] also
  takes the 64-byte ``X‖Y`` CryptoKit form. ``timestamp``: what Swift's ``.iso8601`` date strategy
  writes, UTC to the second with ``Z`` (``2026-04-16T12:00:00Z``); [A] parses RFC 3339.
* What the values may claim is the caller's business (``provider.session.attestation``): this module
  encodes and signs, it never fills in a security state.

Challenge answers (``attestation_challenge``):

* ``signature`` — base64 DER ECDSA P-256 over SHA-256(``nonce`` + ``timestamp``), the two challenge strings
  concatenated. [A] verifies it with the blob's ``publicKey`` whenever ``register`` carried a blob it could
  parse (even one it found invalid); without one it is not checked, but it must never be empty.
* ``status_signature`` — the same key over the canonical status JSON: sorted keys, no whitespace, built from
  exactly the fields the response carries (the coordinator rebuilds it from the response it received).
* ``public_key`` — our registered X25519 key string, byte-identical to ``register.public_key``.

The posture booleans (``sip_enabled``, ``secure_boot_enabled``, ``rdma_disabled``, ``hypervisor_active``)
are inputs: this module reports what the caller knows, it never assumes a macOS security state.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from protocol._wire import RawJSON
from protocol.crypto import b64decode_strict, b64encode
from protocol.to_coordinator import AttestationResponse
from protocol.to_provider import AttestationChallenge

__all__ = [
    "AttestationBlob",
    "ChallengeSigner",
    "RuntimeHashes",
    "SecurityPosture",
    "answer_challenge",
    "attestation_timestamp",
    "build_status_canonical",
    "challenge_message",
    "sign_attestation",
    "status_canonical",
    "verify_signature",
]

_ECDSA = ec.ECDSA(hashes.SHA256())
# Go's encoding/json escapes these inside strings; doing the same keeps the signed bytes identical.
_GO_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028", "\u2029": "\\u2029"})


class ChallengeSigner:
    """A P-256 signing key (the role the Secure Enclave key plays on a Mac)."""

    __slots__ = ("_key",)

    def __init__(self, private_key: ec.EllipticCurvePrivateKey) -> None:
        if not isinstance(private_key.curve, ec.SECP256R1):
            raise ValueError("challenge signing key must be P-256")
        self._key = private_key

    @classmethod
    def generate(cls) -> ChallengeSigner:
        return cls(ec.generate_private_key(ec.SECP256R1()))

    @classmethod
    def from_pem(cls, pem: bytes) -> ChallengeSigner:
        key = serialization.load_pem_private_key(pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("not an EC private key")
        return cls(key)

    def to_pem(self) -> bytes:
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @property
    def public_key_b64(self) -> str:
        """The public point, uncompressed X9.62 (65 bytes), base64 — the attestation blob's ``publicKey``."""
        point = self._key.public_key().public_bytes(
            serialization.Encoding.X962, serialization.PublicFormat.UncompressedPoint
        )
        return b64encode(point)

    def sign(self, message: bytes) -> str:
        """Base64 DER ECDSA signature over SHA-256(message)."""
        return b64encode(self._key.sign(message, _ECDSA))


def verify_signature(public_key_b64: str, message: bytes, signature_b64: str) -> bool:
    """What the coordinator does with a signature (for tests and the coordinator double)."""
    try:
        point = b64decode_strict(public_key_b64)
        key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
        key.verify(b64decode_strict(signature_b64), message, _ECDSA)
    except (ValueError, InvalidSignature):
        return False
    return True


def challenge_message(nonce: str, timestamp: str) -> bytes:
    """The bytes ``signature`` covers."""
    return (nonce + timestamp).encode("utf-8")


def build_status_canonical(
    nonce: str,
    timestamp: str,
    *,
    hypervisor_active: bool | None = None,
    rdma_disabled: bool | None = None,
    sip_enabled: bool | None = None,
    secure_boot_enabled: bool | None = None,
    binary_hash: str = "",
    active_model_hash: str = "",
    python_hash: str = "",
    runtime_hash: str = "",
    grpc_binary_hash: str = "",
    image_bridge_hash: str = "",
    template_hashes: Mapping[str, str] | None = None,
    model_hashes: Mapping[str, str] | None = None,
) -> bytes:
    """Go ``BuildStatusCanonical``: booleans when not None (``false`` explicit), strings and maps when
    non-empty, keys sorted at every level, no whitespace, Go's string escaping."""
    status: dict[str, object] = {"nonce": nonce, "timestamp": timestamp}
    for name, flag in (
        ("hypervisor_active", hypervisor_active),
        ("rdma_disabled", rdma_disabled),
        ("sip_enabled", sip_enabled),
        ("secure_boot_enabled", secure_boot_enabled),
    ):
        if flag is not None:
            status[name] = flag
    for name, value in (
        ("binary_hash", binary_hash),
        ("active_model_hash", active_model_hash),
        ("python_hash", python_hash),
        ("runtime_hash", runtime_hash),
        ("grpc_binary_hash", grpc_binary_hash),
        ("image_bridge_hash", image_bridge_hash),
    ):
        if value:
            status[name] = value
    for name, mapping in (("template_hashes", template_hashes), ("model_hashes", model_hashes)):
        if mapping:
            status[name] = dict(mapping)
    text = json.dumps(status, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return text.translate(_GO_ESCAPES).encode("utf-8")


def status_canonical(response: AttestationResponse, timestamp: str) -> bytes:
    """The canonical status bytes of exactly the fields ``response`` carries (what the coordinator rebuilds)."""
    return build_status_canonical(
        response.nonce,
        timestamp,
        hypervisor_active=response.hypervisor_active,
        rdma_disabled=response.rdma_disabled,
        sip_enabled=response.sip_enabled,
        secure_boot_enabled=response.secure_boot_enabled,
        binary_hash=response.binary_hash,
        active_model_hash=response.active_model_hash,
        python_hash=response.python_hash,
        runtime_hash=response.runtime_hash,
        template_hashes=response.template_hashes,
        model_hashes=response.model_hashes,
    )


@dataclass(frozen=True, slots=True)
class SecurityPosture:
    """What the host reports about itself; ``None`` leaves the field out of the response."""

    sip_enabled: bool | None = None
    secure_boot_enabled: bool | None = None
    rdma_disabled: bool | None = None
    hypervisor_active: bool | None = None


@dataclass(frozen=True, slots=True)
class RuntimeHashes:
    """Hashes checked against the coordinator's known-good lists; empty ones are left out."""

    binary_hash: str = ""
    active_model_hash: str = ""
    python_hash: str = ""
    runtime_hash: str = ""
    template_hashes: Mapping[str, str] = field(default_factory=dict)
    model_hashes: Mapping[str, str] = field(default_factory=dict)


def answer_challenge(
    challenge: AttestationChallenge,
    *,
    public_key_b64: str,
    signer: ChallengeSigner,
    posture: SecurityPosture,
    hashes: RuntimeHashes = RuntimeHashes(),
    sign_status: bool = True,
) -> AttestationResponse:
    """The ``attestation_response`` to ``challenge``: nonce echoed, our X25519 key, signatures."""
    unsigned = AttestationResponse(
        nonce=challenge.nonce,
        signature=signer.sign(challenge_message(challenge.nonce, challenge.timestamp)),
        public_key=public_key_b64,
        hypervisor_active=posture.hypervisor_active,
        rdma_disabled=posture.rdma_disabled,
        sip_enabled=posture.sip_enabled,
        secure_boot_enabled=posture.secure_boot_enabled,
        binary_hash=hashes.binary_hash,
        active_model_hash=hashes.active_model_hash,
        python_hash=hashes.python_hash,
        runtime_hash=hashes.runtime_hash,
        template_hashes=dict(hashes.template_hashes),
        model_hashes=dict(hashes.model_hashes),
    )
    if not sign_status:
        return unsigned
    status_signature = signer.sign(status_canonical(unsigned, challenge.timestamp))
    return unsigned.model_copy(update={"status_signature": status_signature})


# --- registration attestation ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AttestationBlob:
    """[A] ``AttestationBlob``: the signed description of this machine. Empty optional strings are left out."""

    authenticated_root_enabled: bool
    chip_name: str
    hardware_model: str
    hypervisor_active: bool
    os_version: str
    public_key: str
    rdma_disabled: bool
    secure_boot_enabled: bool
    secure_enclave_available: bool
    sip_enabled: bool
    timestamp: str
    encryption_public_key: str = ""
    serial_number: str = ""
    binary_hash: str = ""
    system_volume_hash: str = ""

    def to_json(self) -> str:
        """The blob text that is signed and sent: sorted keys, no whitespace."""
        blob: dict[str, object] = {
            "authenticatedRootEnabled": self.authenticated_root_enabled,
            "chipName": self.chip_name,
            "hardwareModel": self.hardware_model,
            "hypervisorActive": self.hypervisor_active,
            "osVersion": self.os_version,
            "publicKey": self.public_key,
            "rdmaDisabled": self.rdma_disabled,
            "secureBootEnabled": self.secure_boot_enabled,
            "secureEnclaveAvailable": self.secure_enclave_available,
            "sipEnabled": self.sip_enabled,
            "timestamp": self.timestamp,
        }
        for name, value in (("binaryHash", self.binary_hash), ("encryptionPublicKey", self.encryption_public_key),
                            ("serialNumber", self.serial_number), ("systemVolumeHash", self.system_volume_hash)):
            if value:
                blob[name] = value
        return json.dumps(blob, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def attestation_timestamp(now: datetime) -> str:
    """Swift ``JSONEncoder.DateEncodingStrategy.iso8601``: UTC, whole seconds, ``Z``."""
    if now.tzinfo is None:
        raise ValueError("timestamp needs an aware datetime")
    return now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def sign_attestation(blob: AttestationBlob, signer: ChallengeSigner) -> RawJSON:
    """``register.attestation``: the blob's text and a signature over exactly its UTF-8 bytes."""
    if blob.public_key != signer.public_key_b64:
        raise ValueError("the blob's publicKey must be the signing key")
    text = blob.to_json()
    signature = signer.sign(text.encode("utf-8"))
    return RawJSON(f'{{"attestation":{text},"signature":{json.dumps(signature)}}}')
