"""protocol.attest: challenge responses (nonce echoed, our key, P-256 signatures, canonical status JSON)."""

from __future__ import annotations

import base64
import json

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from protocol import AttestationChallenge, AttestationResponse, decode, encode
from protocol.attest import (
    AttestationBlob,
    ChallengeSigner,
    RuntimeHashes,
    SecurityPosture,
    answer_challenge,
    build_status_canonical,
    challenge_message,
    sign_attestation,
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


# --- registration attestation ---------------------------------------------------------------------------

GOLDEN_SCALAR = 0x1F2E3D4C5B6A79880123456789ABCDEFFEDCBA98765432100F1E2D3C4B5A6978
GOLDEN_PUBLIC_KEY = "BF4kdhO6jtAcpH/+A2BG7fpZZRfbZ9BOeInivTs5eH3akIfWJq9/BxNTp/tyGWiNOyWbAWk/Mi6H3+WA3ug/ACc="
GOLDEN_X25519 = "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU="
# The blob as [A] receives it: keys sorted (Swift JSONEncoder .sortedKeys), no whitespace, the optional
# encryptionPublicKey present, serialNumber / binaryHash / systemVolumeHash left out (Go omitempty).
GOLDEN_BLOB = (
    '{"authenticatedRootEnabled":true,"chipName":"Apple M3 Max","encryptionPublicKey":"' + GOLDEN_X25519 + '",'
    '"hardwareModel":"Mac15,8","hypervisorActive":false,"osVersion":"15.3.0","publicKey":"' + GOLDEN_PUBLIC_KEY + '",'
    '"rdmaDisabled":true,"secureBootEnabled":true,"secureEnclaveAvailable":true,"sipEnabled":true,'
    '"timestamp":"2026-04-16T12:00:00Z"}'
)
# One signature of GOLDEN_BLOB by the golden key (ECDSA is randomized: any valid one will do).
GOLDEN_SIGNATURE = "MEUCIDmmJWtMtUTnsIe/NGqcVUrGOq12st5W487MerbFPh5WAiEAl4c4KAztjK8uOPkfXs2s1YaAo4nvS0UyJ1urzjmHG+E="


def go_verify(public_key_b64: str, data: bytes, signature_b64: str) -> bool:
    """attestation.go, step by step, with `cryptography` only: std base64; ParseP256PublicKey (65 bytes
    0x04‖X‖Y, on the curve); sha256.Sum256(data); asn1 DER (R, S); ecdsa.Verify on the digest."""
    import hashlib

    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, decode_dss_signature, encode_dss_signature

    raw = base64.b64decode(public_key_b64, validate=True)
    assert len(raw) == 65 and raw[0] == 0x04
    numbers = ec.EllipticCurvePublicNumbers(int.from_bytes(raw[1:33]), int.from_bytes(raw[33:]), ec.SECP256R1())
    key = numbers.public_key()  # raises if the point is not on P-256
    r, s = decode_dss_signature(base64.b64decode(signature_b64, validate=True))
    digest = hashlib.sha256(data).digest()
    try:
        key.verify(encode_dss_signature(r, s), digest, ec.ECDSA(Prehashed(hashes.SHA256())))
    except InvalidSignature:
        return False
    return True


def golden_blob(**overrides) -> AttestationBlob:
    fields = dict(authenticated_root_enabled=True, chip_name="Apple M3 Max", hardware_model="Mac15,8",
                  hypervisor_active=False, os_version="15.3.0", public_key=GOLDEN_PUBLIC_KEY, rdma_disabled=True,
                  secure_boot_enabled=True, secure_enclave_available=True, sip_enabled=True,
                  timestamp="2026-04-16T12:00:00Z", encryption_public_key=GOLDEN_X25519)
    fields.update(overrides)
    return AttestationBlob(**fields)


@pytest.fixture(scope="module")
def golden_signer() -> ChallengeSigner:
    return ChallengeSigner(ec.derive_private_key(GOLDEN_SCALAR, ec.SECP256R1()))


def test_golden_blob_bytes_and_point_format(golden_signer):
    assert golden_signer.public_key_b64 == GOLDEN_PUBLIC_KEY  # uncompressed X9.62, 65 bytes
    assert golden_blob().to_json() == GOLDEN_BLOB
    keys = list(json.loads(GOLDEN_BLOB))
    assert keys == sorted(keys)
    assert go_verify(GOLDEN_PUBLIC_KEY, GOLDEN_BLOB.encode(), GOLDEN_SIGNATURE)
    assert not go_verify(GOLDEN_PUBLIC_KEY, GOLDEN_BLOB.replace("Mac15,8", "Mac15,9").encode(), GOLDEN_SIGNATURE)


def test_optional_strings_are_left_out_when_empty_and_sorted_in_when_set():
    bare = json.loads(golden_blob(encryption_public_key="").to_json())
    assert set(bare) == {"authenticatedRootEnabled", "chipName", "hardwareModel", "hypervisorActive", "osVersion",
                         "publicKey", "rdmaDisabled", "secureBootEnabled", "secureEnclaveAvailable", "sipEnabled",
                         "timestamp"}
    full = golden_blob(serial_number="C02XYZ", binary_hash="ab" * 32, system_volume_hash="cd" * 32).to_json()
    keys = list(json.loads(full))
    assert keys == sorted(keys) and {"serialNumber", "binaryHash", "systemVolumeHash"} <= set(keys)
    # false booleans are written, never left out (Go's bool fields have no omitempty)
    assert '"secureEnclaveAvailable":false' in golden_blob(secure_enclave_available=False).to_json()


def test_timestamp_is_swifts_iso8601_utc_seconds():
    from datetime import datetime, timedelta, timezone

    from protocol.attest import attestation_timestamp

    local = datetime(2026, 4, 16, 14, 0, 0, 987654, tzinfo=timezone(timedelta(hours=2)))
    assert attestation_timestamp(local) == "2026-04-16T12:00:00Z"
    with pytest.raises(ValueError):
        attestation_timestamp(datetime(2026, 4, 16))


def test_signed_attestation_covers_the_exact_blob_bytes_end_to_end_through_the_codec(golden_signer):
    """The signature verifies (the Go way) over the bytes the frame carries; encode splices the raw value,
    decode gives back the same text, and a re-encode sends the same bytes again."""
    from protocol import CpuCores, Hardware, ModelInfo, Register

    signed = sign_attestation(golden_blob(), golden_signer)
    outer = json.loads(signed.text)
    assert list(outer) == ["attestation", "signature"]
    assert go_verify(GOLDEN_PUBLIC_KEY, GOLDEN_BLOB.encode(), outer["signature"])
    hardware = Hardware(machine_model="Mac15,8", chip_name="Apple M3 Max", chip_family="M3", chip_tier="Max",
                        memory_gb=64, memory_available_gb=58.0, cpu_cores=CpuCores(total=16, performance=12, efficiency=4),
                        gpu_cores=40, memory_bandwidth_gbs=400.0)
    register = Register(hardware=hardware, models=(ModelInfo(id="m", size_bytes=1, model_type="llama", quantization="4bit"),),
                        backend="inprocess-mlx", public_key=GOLDEN_X25519, attestation=signed)
    frame = encode(register)
    assert f'"attestation":{{"attestation":{GOLDEN_BLOB},"signature":' in frame
    decoded = decode(frame)
    assert decoded.attestation.text == signed.text and encode(decoded) == frame
    with pytest.raises(ValueError):  # the blob must name the key that signs it
        sign_attestation(golden_blob(public_key=ChallengeSigner.generate().public_key_b64), golden_signer)
