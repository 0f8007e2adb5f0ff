"""The coordinator's side of attestation ([A] provider.go verifyChallengeResponse, attestation.go Verify).

Pure functions over decoded frames. The P-256 key that challenge signatures are checked with can only come
from a registration attestation blob (``publicKey``) in [A]; without a valid blob the signature is only
required to be non-empty, and ``SignatureCheck.PRESENT_UNVERIFIED`` records that.
"""

from __future__ import annotations

import base64
import os
from dataclasses import dataclass
from datetime import UTC, datetime

from protocol import AttestationChallenge, AttestationResponse, RawJSON
from protocol.attest import challenge_message, status_canonical, verify_signature
from protocol.codec import _top_level_members  # exact member bytes: the blob's signature covers them

from .events import ChallengeFailure, SignatureCheck

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
        if not verify_signature(p256_key, challenge_message(challenge.nonce, challenge.timestamp), response.signature):
            return Verdict(ChallengeFailure.BAD_SIGNATURE, SignatureCheck.NOT_CHECKED)
        if response.status_signature and not verify_signature(
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


def attested_p256_key(attestation: RawJSON | None, registered_key: str) -> str | None:
    """The blob's P-256 ``publicKey`` when ``register.attestation`` verifies (§10.1), else None.

    Valid only if the signature over the exact bytes of the inner ``attestation`` value verifies with the
    embedded key, the Secure Enclave, SIP and Secure Boot flags are true, and ``encryptionPublicKey`` (when
    present) equals the registered X25519 key.
    """
    if attestation is None:
        return None
    try:
        members = _top_level_members(attestation.text, frozenset({"attestation", "signature"}))
        blob_text, signature = members["attestation"], RawJSON(members["signature"]).value()
        blob = RawJSON(blob_text).value()
    except (ValueError, KeyError, IndexError, RecursionError):
        return None
    if not isinstance(blob, dict) or not isinstance(signature, str):
        return None
    key = blob.get("publicKey")
    if not isinstance(key, str) or not verify_signature(key, blob_text.encode("utf-8"), signature):
        return None
    if not all(blob.get(flag) is True for flag in ("secureEnclaveAvailable", "sipEnabled", "secureBootEnabled")):
        return None
    encryption_key = blob.get("encryptionPublicKey")
    if encryption_key is not None and registered_key and encryption_key != registered_key:
        return None
    return key
