"""protocol.attest: challenge responses (nonce echoed, our key, P-256 signatures, canonical status JSON)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from protocol import AttestationChallenge, AttestationResponse, decode, encode
from protocol.attest import (
    ChallengeSigner,
    RuntimeHashes,
    SecurityPosture,
    answer_challenge,
    build_status_canonical,
    challenge_message,
    status_canonical,
    verify_signature,
)
from protocol.crypto import ProviderIdentity

CHALLENGE = AttestationChallenge(nonce="q3Jx9vV1mD2b4T0rN8cE5yWkZpHfLsUa7GiOeRtYwXQ=", timestamp="2026-04-30T10:41:07Z")


@pytest.fixture(scope="module")
def signer() -> ChallengeSigner:
    return ChallengeSigner.generate()


def test_response_echoes_nonce_and_carries_our_x25519_key(signer):
    identity = ProviderIdentity.generate()
    posture = SecurityPosture(sip_enabled=True, secure_boot_enabled=True, rdma_disabled=True)
    response = answer_challenge(CHALLENGE, public_key_b64=identity.public_key_b64, signer=signer, posture=posture)
    assert response.nonce == CHALLENGE.nonce
    assert response.public_key == identity.public_key_b64
    wire = json.loads(encode(response))
    assert wire["sip_enabled"] is True and wire["rdma_disabled"] is True and wire["secure_boot_enabled"] is True
    assert "hypervisor_active" not in wire
    assert decode(encode(response)) == response


def test_signature_is_der_ecdsa_p256_over_sha256_of_nonce_plus_timestamp(signer):
    response = answer_challenge(CHALLENGE, public_key_b64="k", signer=signer, posture=SecurityPosture(sip_enabled=True))
    message = (CHALLENGE.nonce + CHALLENGE.timestamp).encode()
    assert challenge_message(CHALLENGE.nonce, CHALLENGE.timestamp) == message
    # Independent check with cryptography: Go's VerifyASN1 over SHA-256(message).
    point = base64.b64decode(signer.public_key_b64)
    assert len(point) == 65 and point[0] == 4
    key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    key.verify(base64.b64decode(response.signature), message, ec.ECDSA(hashes.SHA256()))
    assert verify_signature(signer.public_key_b64, message, response.signature)
    assert not verify_signature(signer.public_key_b64, message + b"x", response.signature)
    assert not verify_signature(ChallengeSigner.generate().public_key_b64, message, response.signature)
    assert not verify_signature(signer.public_key_b64, message, "bm90IGEgc2lnbmF0dXJl")


def test_status_signature_covers_exactly_the_fields_sent(signer):
    hashes_ = RuntimeHashes(runtime_hash="rt", template_hashes={"chatml": "t1"}, model_hashes={"m": "h"})
    posture = SecurityPosture(sip_enabled=True, rdma_disabled=True, secure_boot_enabled=False)
    response = answer_challenge(CHALLENGE, public_key_b64="k", signer=signer, posture=posture, hashes=hashes_)
    received = decode(encode(response))  # what the coordinator rebuilds from
    canonical = status_canonical(received, CHALLENGE.timestamp)
    assert json.loads(canonical) == {
        "nonce": CHALLENGE.nonce,
        "timestamp": CHALLENGE.timestamp,
        "sip_enabled": True,
        "rdma_disabled": True,
        "secure_boot_enabled": False,
        "runtime_hash": "rt",
        "template_hashes": {"chatml": "t1"},
        "model_hashes": {"m": "h"},
    }
    assert verify_signature(signer.public_key_b64, canonical, received.status_signature)
    unsigned = answer_challenge(CHALLENGE, public_key_b64="k", signer=signer, posture=posture, sign_status=False)
    assert unsigned.status_signature == "" and "status_signature" not in json.loads(encode(unsigned))


def test_canonical_json_is_sorted_compact_and_escapes_like_go():
    canonical = build_status_canonical("n", "t", binary_hash="a<b>&c\u2028", model_hashes={"z": "1", "a": "2"})
    assert canonical == b'{"binary_hash":"a\\u003cb\\u003e\\u0026c\\u2028","model_hashes":{"a":"2","z":"1"},"nonce":"n","timestamp":"t"}'
    assert json.loads(canonical)["binary_hash"] == "a<b>&c\u2028"


def test_signer_pem_round_trip_and_curve_check(signer):
    again = ChallengeSigner.from_pem(signer.to_pem())
    assert again.public_key_b64 == signer.public_key_b64
    with pytest.raises(ValueError):
        ChallengeSigner(ec.generate_private_key(ec.SECP384R1()))


def test_response_type_is_the_wire_message(signer):
    response = answer_challenge(CHALLENGE, public_key_b64="k", signer=signer, posture=SecurityPosture())
    assert isinstance(response, AttestationResponse) and response.signature
