"""``register.attestation``: the signed blob that a coordinator at ``EIGENINFERENCE_MIN_TRUST=self_signed``
routes, or the reasons there is none.

What [A] does with it (provider.go ``verifyProviderAttestation``, attestation.go ``Verify``): the blob is
valid when its signature verifies with its own ``publicKey``, ``secureEnclaveAvailable``, ``sipEnabled``
and ``secureBootEnabled`` are true, and ``encryptionPublicKey`` equals ``register.public_key``. A valid
blob gives trust ``self_signed`` and counts as a passed challenge at once; from then on every challenge
answer's ``signature`` and ``status_signature`` are checked with that ``publicKey``. Nothing else in the
blob is enforced, but nothing in it may be a claim this machine cannot back.

Where each value comes from (``signed_attestation``):

* ``publicKey``: the P-256 key that signs our challenge answers (``identity``), uncompressed point;
* ``encryptionPublicKey``: ``register.public_key``, our X25519 key;
* ``secureEnclaveAvailable``: the host has a Secure Enclave (``HostPosture.secure_enclave``: a Mac with
  Apple silicon), the meaning Darkbloom's Swift provider gives it (``SecureEnclave.isAvailable``);
* ``sipEnabled``, ``secureBootEnabled``, ``rdmaDisabled``: the posture every challenge answer reports
  (``Posture.reported_host``: the host's, or the dev posture);
* ``authenticatedRootEnabled``: the host's sealed system volume (``csrutil authenticated-root status``);
* ``hypervisorActive``: ``MEMORY_ISOLATION`` (false: we do not isolate model memory in a hypervisor);
* ``chipName``, ``hardwareModel``: ``register.hardware``'s ``chip_name`` and ``machine_model``;
* ``osVersion``: ``provider.hardware.os_version``; ``timestamp``: the time of this ``register``;
* ``serialNumber``, ``binaryHash``, ``systemVolumeHash``: not sent. The serial is a device identifier
  [A] uses only to cross-check with MDM (``hardware`` trust, out of our reach); we have no binary or
  sealed-volume hash to offer.

What ``self_signed`` means here, in so many words: the blob is signed by a **software** P-256 key kept in
a file (0600, ``identity``), not a key held in the Secure Enclave. The coordinator cannot tell the two
apart (a software key signs the same way), so ``self_signed`` proves continuity of this key and that the
values were signed by it, and the values are the host's real posture; it does not prove a hardware-held
key. ``doctor`` says so. Under ``dev_posture`` (refused unless the coordinator is on loopback) every
boolean is the dev posture's: the posture of a test harness, not of the host.

Every boolean must be known and the host must have a Secure Enclave (a blob saying false would be
refused). A value the host could not report (Secure Boot unreadable, the sealed volume unreadable) is a
gap too: no attestation, never a guess. The gaps, in the order ``doctor`` lists them, are
``AttestationGap``; an empty list is the only case in which ``register`` carries the blob.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

from protocol import RawJSON
from protocol.attest import AttestationBlob, ChallengeSigner, attestation_timestamp, sign_attestation
from provider.session.gates import TrustLevel
from provider.session.posture import MEMORY_ISOLATION, Posture


class AttestationGap(StrEnum):
    """Why ``register`` carries no attestation (each one alone keeps trust at ``none``)."""

    NO_SECURE_ENCLAVE = "no_secure_enclave"
    SIP_DISABLED = "sip_disabled"
    SECURE_BOOT_DISABLED = "secure_boot_disabled"
    SECURE_BOOT_UNKNOWN = "secure_boot_unknown"
    AUTHENTICATED_ROOT_UNKNOWN = "authenticated_root_unknown"


GAP_TEXT: dict[AttestationGap, str] = {
    AttestationGap.NO_SECURE_ENCLAVE: "this host has no Secure Enclave (not a Mac with Apple silicon), so "
                                      "secureEnclaveAvailable would be false (the coordinator requires true)",
    AttestationGap.SIP_DISABLED: "SIP is not enabled, or there is none (the coordinator requires sipEnabled true)",
    AttestationGap.SECURE_BOOT_DISABLED: "Secure Boot is not at Full Security, or there is none (the coordinator "
                                         "requires secureBootEnabled true)",
    AttestationGap.SECURE_BOOT_UNKNOWN: "Secure Boot could not be read, and a guess is never signed",
    AttestationGap.AUTHENTICATED_ROOT_UNKNOWN: "the sealed system volume (authenticatedRootEnabled) could not be "
                                               "read from csrutil authenticated-root status, and a guess is never "
                                               "signed",
}


@dataclass(frozen=True, slots=True)
class AttestationPlan:
    """The security values an attestation would carry (None: unknown) and what stops it being sent."""

    secure_enclave_available: bool
    sip_enabled: bool
    secure_boot_enabled: bool | None
    rdma_disabled: bool
    hypervisor_active: bool
    authenticated_root_enabled: bool | None
    gaps: tuple[AttestationGap, ...]

    @property
    def sendable(self) -> bool:
        return not self.gaps

    @property
    def trust_level(self) -> TrustLevel:
        """What [A] assigns at ``register`` (``hardware`` needs MDM / Apple attestation: never ours)."""
        return TrustLevel.SELF_SIGNED if self.sendable else TrustLevel.NONE


def plan_attestation(posture: Posture) -> AttestationPlan:
    """The attestation this posture allows. Pure: the posture was read at startup."""
    host = posture.reported_host
    enclave = host.secure_enclave
    gaps: list[AttestationGap] = []
    if not enclave:
        gaps.append(AttestationGap.NO_SECURE_ENCLAVE)
    if not host.sip_enabled:
        gaps.append(AttestationGap.SIP_DISABLED)
    if host.secure_boot_enabled is None:
        gaps.append(AttestationGap.SECURE_BOOT_UNKNOWN)
    elif not host.secure_boot_enabled:
        gaps.append(AttestationGap.SECURE_BOOT_DISABLED)
    if host.authenticated_root_enabled is None:
        gaps.append(AttestationGap.AUTHENTICATED_ROOT_UNKNOWN)
    return AttestationPlan(
        secure_enclave_available=enclave,
        sip_enabled=host.sip_enabled,
        secure_boot_enabled=host.secure_boot_enabled,
        rdma_disabled=host.rdma_disabled,
        hypervisor_active=MEMORY_ISOLATION,
        authenticated_root_enabled=host.authenticated_root_enabled,
        gaps=tuple(gaps),
    )


def signed_attestation(plan: AttestationPlan, *, signer: ChallengeSigner, encryption_public_key: str, chip_name: str,
                       hardware_model: str, os_version: str, now: datetime | None = None) -> RawJSON | None:
    """``register.attestation`` for this connection, or None when the plan has gaps."""
    if not plan.sendable:
        return None
    assert plan.secure_boot_enabled is not None and plan.authenticated_root_enabled is not None
    blob = AttestationBlob(
        authenticated_root_enabled=plan.authenticated_root_enabled,
        chip_name=chip_name,
        hardware_model=hardware_model,
        hypervisor_active=plan.hypervisor_active,
        os_version=os_version,
        public_key=signer.public_key_b64,
        rdma_disabled=plan.rdma_disabled,
        secure_boot_enabled=plan.secure_boot_enabled,
        secure_enclave_available=plan.secure_enclave_available,
        sip_enabled=plan.sip_enabled,
        timestamp=attestation_timestamp(now or datetime.now(UTC)),
        encryption_public_key=encryption_public_key,
    )
    return sign_attestation(blob, signer)


__all__ = ["GAP_TEXT", "AttestationGap", "AttestationPlan", "plan_attestation", "signed_attestation"]
