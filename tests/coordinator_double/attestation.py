"""The coordinator's side of attestation ([A] provider.go verifyProviderAttestation / verifyChallengeResponse,
attestation.go Verify / VerifyChallengeSignature).

Pure functions over decoded frames, written from the Go code, not from our provider's encoder:

* ``verify_registration`` reads ``register.attestation`` as [A] does: the inner ``attestation`` member's
  exact bytes are what the signature must cover (``json.RawMessage``), the typed fields are read the way
  ``encoding/json`` fills ``AttestationBlob`` (a wrong type is a parse failure: no result at all; a missing
  field or ``null`` is the zero value), then ``Verify``'s steps in order — RFC 3339 ``timestamp``,
  ``publicKey`` a 65-byte uncompressed or 64-byte raw P-256 point in standard base64, a DER signature over
  SHA-256 of the raw bytes (each step failing with Go's error text, up to its colon), then ``secureEnclaveAvailable``, ``sipEnabled``, ``secureBootEnabled`` true
  — and provider.go's binding: when ``register.public_key`` is set, ``encryptionPublicKey`` must be
  present and equal to it. Valid ⇒ trust ``self_signed`` and a passed challenge as of now.
* A blob that parsed keeps its ``publicKey`` even when invalid ([A] stores the result before the validity
  check): every challenge answer's signatures are then checked with that key. Without a parsed blob the
  signature is only required to be non-empty (``SignatureCheck.PRESENT_UNVERIFIED``).

Not modelled: the known-binary-hash list (``binaryHash`` is accepted as is), Go's case-insensitive key
matching, and the MDM / ACME upgrades to ``hardware``.
"""

from __future__ import annotations

import base64
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from protocol import AttestationChallenge, AttestationResponse, RawJSON
from protocol.attest import challenge_message, status_canonical
from protocol.codec import _top_level_members  # exact member bytes: the blob's signature covers them
from protocol.crypto import b64decode_strict

from .events import ChallengeFailure, SignatureCheck, TrustLevel

# Failures that make the provider untrusted at once; the others count toward MaxFailedChallenges.
IMMEDIATELY_UNTRUSTED = frozenset(
    {ChallengeFailure.SIP_DISABLED, ChallengeFailure.SECURE_BOOT_DISABLED, ChallengeFailure.RDMA_ENABLED}
)


def new_challenge() -> AttestationChallenge:
    """[A] generateNonce: base64 of 32 random bytes; timestamp RFC 3339 UTC, seconds precision."""
    nonce = base64.b64encode(os.urandom(32)).decode("ascii")
    timestamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return AttestationChallenge(nonce=nonce, timestamp=timestamp)


@dataclass(frozen=True, slots=True)
class Verdict:
    failure: ChallengeFailure | None
    signature: SignatureCheck

    @property
    def ok(self) -> bool:
        return self.failure is None


def verify_challenge(
    response: AttestationResponse,
    challenge: AttestationChallenge,
    *,
    registered_key: str,
    p256_key: str | None,
    require_secure_boot_present: bool,
) -> Verdict:
    """The checks of [A] verifyChallengeResponse, in its order (the nonce was matched by the caller)."""
    if response.public_key != registered_key:
        return Verdict(ChallengeFailure.PUBLIC_KEY_MISMATCH, SignatureCheck.NOT_CHECKED)
    if not response.signature:
        return Verdict(ChallengeFailure.EMPTY_SIGNATURE, SignatureCheck.NOT_CHECKED)
    check = SignatureCheck.PRESENT_UNVERIFIED
    if p256_key is not None:
        if not verify_p256(p256_key, challenge_message(challenge.nonce, challenge.timestamp), response.signature):
            return Verdict(ChallengeFailure.BAD_SIGNATURE, SignatureCheck.NOT_CHECKED)
        if response.status_signature and not verify_p256(
            p256_key, status_canonical(response, challenge.timestamp), response.status_signature
        ):
            return Verdict(ChallengeFailure.BAD_STATUS_SIGNATURE, SignatureCheck.NOT_CHECKED)
        check = SignatureCheck.VERIFIED
    if response.sip_enabled is None:
        return Verdict(ChallengeFailure.SIP_MISSING, check)
    if not response.sip_enabled:
        return Verdict(ChallengeFailure.SIP_DISABLED, check)
    if response.secure_boot_enabled is None and require_secure_boot_present:
        return Verdict(ChallengeFailure.SECURE_BOOT_MISSING, check)
    if response.secure_boot_enabled is False:
        return Verdict(ChallengeFailure.SECURE_BOOT_DISABLED, check)
    if response.rdma_disabled is None:
        return Verdict(ChallengeFailure.RDMA_MISSING, check)
    if not response.rdma_disabled and response.hypervisor_active is not True:
        return Verdict(ChallengeFailure.RDMA_ENABLED, check)
    return Verdict(None, check)


TRUST_RANK = {TrustLevel.NONE: 0, TrustLevel.SELF_SIGNED: 1, TrustLevel.HARDWARE: 2}  # registry.go trustRank

_BLOB_BOOLS = ("authenticatedRootEnabled", "hypervisorActive", "rdmaDisabled", "secureBootEnabled",
               "secureEnclaveAvailable", "sipEnabled")
_BLOB_STRINGS = ("binaryHash", "chipName", "encryptionPublicKey", "hardwareModel", "osVersion", "publicKey",
                 "serialNumber", "systemVolumeHash", "timestamp")
_RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")
PARSE_FAILED = "failed to parse provider attestation"


class _ParseError(ValueError):
    """Where Go's json.Unmarshal returns an error (VerifyJSON fails: no result is stored)."""


@dataclass(frozen=True, slots=True)
class AttestationResult:
    """[A] VerificationResult, the parts the double acts on."""

    valid: bool
    public_key: str  # the blob's publicKey, kept when invalid: challenge signatures are checked with it
    error: str | None  # [A]'s reason (the prefix of its message) when not valid
    blob: dict[str, bool | str]

    @property
    def trust_level(self) -> TrustLevel:
        return TrustLevel.SELF_SIGNED if self.valid else TrustLevel.NONE


def parse_p256_point(raw: bytes) -> ec.EllipticCurvePublicKey:
    """[A] ParseP256PublicKey: 65 bytes ``0x04‖X‖Y`` or 64 bytes ``X‖Y``, on the curve; nothing else."""
    if len(raw) == 65 and raw[0] == 4:
        x, y = raw[1:33], raw[33:]
    elif len(raw) == 64:
        x, y = raw[:32], raw[32:]
    else:
        raise ValueError("unsupported public key format")
    return ec.EllipticCurvePublicNumbers(int.from_bytes(x), int.from_bytes(y), ec.SECP256R1()).public_key()


def verify_p256(public_key_b64: str, message: bytes, signature_b64: str) -> bool:
    """[A] VerifyChallengeSignature (and Verify's signature step): DER ECDSA over SHA-256(message)."""
    try:
        key = parse_p256_point(b64decode_strict(public_key_b64))
        key.verify(b64decode_strict(signature_b64), message, ec.ECDSA(hashes.SHA256()))
    except (ValueError, InvalidSignature):
        return False
    return True


def _typed_blob(value: object) -> dict[str, bool | str]:
    """encoding/json into AttestationBlob: zero values for missing/null fields, a wrong type fails."""
    if value is None:
        value = {}
    if not isinstance(value, dict):
        raise _ParseError("attestation is not an object")
    blob: dict[str, bool | str] = {}
    for name in _BLOB_BOOLS:
        item = value.get(name)
        if item is not None and not isinstance(item, bool):
            raise _ParseError(name)
        blob[name] = bool(item)
    for name in _BLOB_STRINGS:
        item = value.get(name)
        if item is not None and not isinstance(item, str):
            raise _ParseError(name)
        blob[name] = item or ""
    return blob


def _parse(attestation: RawJSON) -> tuple[str, dict[str, bool | str], str]:
    """(raw blob text, typed blob, signature), or _ParseError."""
    outer = attestation.value()
    if not isinstance(outer, dict) or "attestation" not in outer:
        raise _ParseError("no attestation member")
    signature = outer.get("signature")
    if signature is not None and not isinstance(signature, str):
        raise _ParseError("signature")
    raw = _top_level_members(attestation.text, frozenset({"attestation"}))["attestation"]
    return raw, _typed_blob(RawJSON(raw).value()), signature or ""


def _valid_timestamp(text: str) -> bool:
    if not _RFC3339.fullmatch(text):
        return False
    try:
        datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


def _verify_blob(raw: str, blob: dict[str, bool | str], signature: str) -> str | None:
    """attestation.go Verify: the first failing step's reason, then the security flags (the last one
    that fails names the error, as in Go); None when valid."""
    if not _valid_timestamp(str(blob["timestamp"])):
        return "invalid timestamp"
    try:
        point = b64decode_strict(str(blob["publicKey"]))
    except ValueError:
        return "invalid public key base64"
    try:
        key = parse_p256_point(point)
    except ValueError:
        return "invalid public key"
    try:
        der = b64decode_strict(signature)
    except ValueError:
        return "invalid signature base64"
    try:
        r, s = decode_dss_signature(der)  # Go: asn1.Unmarshal into (R, S)
    except ValueError:
        return "invalid DER signature"
    try:
        key.verify(encode_dss_signature(r, s), raw.encode("utf-8"), ec.ECDSA(hashes.SHA256()))
    except (ValueError, InvalidSignature):
        return "signature verification failed"
    error = None
    for flag, reason in (("secureEnclaveAvailable", "Secure Enclave not available"),
                         ("sipEnabled", "SIP not enabled"), ("secureBootEnabled", "Secure Boot not enabled")):
        if not blob[flag]:
            error = reason
    return error


def verify_registration(attestation: RawJSON | None, register_public_key: str) -> AttestationResult | None:
    """What [A] stores for ``register.attestation``: None when there is none or it does not parse.
    ``register_public_key`` is the register frame's ``public_key`` as sent."""
    if attestation is None:
        return None
    try:
        raw, blob, signature = _parse(attestation)
    except (_ParseError, ValueError, KeyError, IndexError, RecursionError):
        return None
    error = _verify_blob(raw, blob, signature)
    if error is None and register_public_key:
        if not blob["encryptionPublicKey"]:
            error = "attestation missing encryption public key"
        elif blob["encryptionPublicKey"] != register_public_key:
            error = "encryption key mismatch"
    return AttestationResult(error is None, str(blob["publicKey"]), error, blob)

