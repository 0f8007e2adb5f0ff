"""The official golden frames and crypto vectors (copied into tests/vectors/) against protocol/."""

from __future__ import annotations

import base64
import hashlib
import json
from enum import Enum
from typing import Any

import pytest

import protocol
from protocol import FRAME_TYPES, RawJSON, UnknownMessage, decode, encode
from protocol._wire import WireModel
from protocol.attest import build_status_canonical, status_canonical
from protocol.crypto import DecryptError, ProviderIdentity
from protocol.sse import ChunkFactory, event
from vectors import load as _load

P2C = _load("provider_to_coordinator.json")
C2P = _load("coordinator_to_provider.json")
NACL = _load("nacl_box.json")
P2C_CASES = {case["name"]: case for case in P2C["cases"]}
C2P_CASES = {case["name"]: case for case in C2P["cases"]}


def test_vector_files_are_the_expected_contract():
    assert P2C["direction"] == "provider_to_coordinator" and C2P["direction"] == "coordinator_to_provider"
    assert len(P2C_CASES) == 17 and len(C2P_CASES) == 11
    assert NACL["algorithm"] == "x25519-xsalsa20-poly1305-nacl-box"


def _assert_fields(decoded: Any, expected: Any, where: str) -> None:
    """Every value in the fixture is the decoded value, field by field (independent of encode())."""
    if isinstance(decoded, WireModel):
        assert isinstance(expected, dict), where
        for key, value in expected.items():
            assert key in type(decoded).model_fields, f"{where}.{key} is not a field"
            _assert_fields(getattr(decoded, key), value, f"{where}.{key}")
    elif isinstance(decoded, RawJSON):
        assert decoded.value() == expected, where
    elif isinstance(decoded, tuple):
        assert isinstance(expected, list) and len(decoded) == len(expected), where
        for index, (item, value) in enumerate(zip(decoded, expected)):
            _assert_fields(item, value, f"{where}[{index}]")
    else:
        if isinstance(decoded, Enum):
            decoded = decoded.value
        assert type(decoded) is type(expected) or (type(decoded), type(expected)) == (float, int), where
        assert decoded == expected, where


@pytest.mark.parametrize("name", sorted(P2C_CASES) + sorted(C2P_CASES))
def test_golden_frame_decodes_to_its_class_with_its_values(name):
    case = P2C_CASES.get(name) or C2P_CASES[name]
    message = decode(case["wire"])
    assert type(message) is FRAME_TYPES[case["message_type"]]
    assert message.type == case["message_type"]
    _assert_fields(message, json.loads(case["wire"]), name)
    # bytes decode the same as text
    assert decode(case["wire"].encode("utf-8")) == message


@pytest.mark.parametrize("name", sorted(P2C_CASES))
def test_provider_frame_reencodes_semantically_equal(name):
    wire = P2C_CASES[name]["wire"]
    assert json.loads(encode(decode(wire))) == json.loads(wire)


def test_register_attestation_bytes_survive_decode_and_encode_exactly():
    case = P2C_CASES["register_full_raw_attestation"]
    assert case["exact_bytes"] is True
    raw = '{"signature":"sig","attestation":{"z":1,"a":[true,false]}}'
    assert raw in case["wire"]
    message = decode(case["wire"])
    assert message.attestation == RawJSON(raw)
    assert message.attestation.encoded() == raw.encode()
    assert f'"attestation":{raw}' in encode(message)


def test_attestation_bytes_are_kept_even_when_not_compact():
    raw = '{ "signature" : "s\\u00e9",\n "attestation": {"z": 1.50, "a": [true ,false]} }'
    wire = P2C_CASES["register_full_raw_attestation"]["wire"].replace(
        '{"signature":"sig","attestation":{"z":1,"a":[true,false]}}', raw
    )
    message = decode(wire)
    assert message.attestation.text == raw
    assert f'"attestation":{raw}' in encode(message)
    assert decode(encode(message)) == message


def test_selected_golden_values():
    heartbeat = decode(P2C_CASES["heartbeat_no_active_model"]["wire"])
    assert heartbeat.active_model is None and heartbeat.backend_capacity is None
    assert heartbeat.system_metrics.thermal_state == ""
    full = decode(P2C_CASES["heartbeat_full"]["wire"])
    assert full.backend_capacity.free_for_load_gb == 20.5
    assert full.backend_capacity.slots[0].kv_bytes_per_token == 393216
    assert full.stats.usage_gaps == 10 and full.apns_device_token == "rotated-token"
    error = decode(P2C_CASES["inference_error"]["wire"])
    assert error.error_reason is protocol.ErrorReason.MODEL_LOAD and error.status_code == 503
    assert error.failure_code is None and error.available_token_budget is None
    legacy = decode(P2C_CASES["attestation_response_legacy_hypervisor_false"]["wire"])
    assert legacy.hypervisor_active is False and legacy.sip_enabled is None
    verified = decode(P2C_CASES["prefetch_model_status_verified"]["wire"])
    assert verified.status is protocol.PrefetchStatus.VERIFIED and verified.bytes_done == 0
    plain = decode(C2P_CASES["inference_request_plain"]["wire"])
    assert plain.encrypted_body is None and plain.body["max_tokens"] == 256
    sealed = decode(C2P_CASES["inference_request_encrypted"]["wire"])
    assert sealed.encrypted_body.ciphertext == "nonce-and-box"
    assert sealed.body == {"model": "", "messages": None, "stream": False}
    assert decode(C2P_CASES["runtime_status_verified"]["wire"]).mismatches == ()
    assert decode(C2P_CASES["prefetch_model_default_priority"]["wire"]).priority == 0


# --- the protocol's example frames, both directions (verified against the Go coordinator) -------------------


MD_FRAMES = _load("protocol_md_frames.json")["frames"]


def test_protocol_md_section_5_has_its_frames():
    assert len(MD_FRAMES) == 18  # 9 provider frames, 9 coordinator frames


@pytest.mark.parametrize("wire", MD_FRAMES, ids=lambda w: json.loads(w)["type"])
def test_protocol_md_frame_decodes_and_reencodes(wire):
    message = decode(wire)
    assert not isinstance(message, UnknownMessage)
    _assert_fields(message, json.loads(wire), message.type)
    assert json.loads(encode(message)) == json.loads(wire)


def test_recommended_fast_reject_frame_is_what_errors_builds():
    from protocol.errors import Failure, RejectionReason, inference_error_frame

    golden = next(w for w in MD_FRAMES if '"capacity_busy"' in w)
    frame = inference_error_frame(
        "7b1d4c3e-5f60-4a8b-9c2d-1e0f3a4b5c6d", Failure.capacity(RejectionReason.TOKEN_BUDGET, available_token_budget=0)
    )
    assert json.loads(encode(frame)) == json.loads(golden)


# --- nacl_box.json ------------------------------------------------------------------------------------------


def _key(name: str) -> bytes:
    return base64.b64decode(NACL[name])


def test_nacl_vector_opens_to_the_plaintext():
    recipient = ProviderIdentity.from_private_bytes(_key("recipient_private_key_base64"))
    assert recipient.public_key_b64 == NACL["recipient_public_key_base64"]
    _, plaintext = recipient.open_request(protocol.EncryptedPayload(**NACL["payload"]))
    assert hashlib.sha256(plaintext).hexdigest() == NACL["plaintext_sha256"]
    assert plaintext == base64.b64decode(NACL["plaintext_base64"])
    assert json.loads(plaintext)["messages"][0]["content"] == "hello π"


def test_nacl_vector_seals_byte_for_byte_with_its_nonce():
    sender = ProviderIdentity.from_private_bytes(_key("sender_private_key_base64"))
    assert sender.public_key_b64 == NACL["sender_public_key_base64"]
    box = sender.box_for(NACL["recipient_public_key_base64"])
    sealed = box.seal(base64.b64decode(NACL["plaintext_base64"]), nonce=_key("nonce_base64"))
    assert sealed.model_dump() == NACL["payload"]


def test_nacl_tampered_vector_is_rejected():
    recipient = ProviderIdentity.from_private_bytes(_key("recipient_private_key_base64"))
    with pytest.raises(DecryptError):
        recipient.open_request(protocol.EncryptedPayload(**NACL["tampered_payload"]))


STATUS_FIELDS = dict(
    rdma_disabled=True,
    sip_enabled=True,
    secure_boot_enabled=True,
    binary_hash="binhash",
    active_model_hash="activemodel",
    python_hash="pyhash",
    runtime_hash="rthash",
    template_hashes={"gemma": "tmplhash2", "chatml": "tmplhash1"},
    model_hashes={"trinity": "modelhash2", "qwen": "modelhash1"},
)


@pytest.mark.parametrize(
    ("name", "fields"),
    [
        ("current_base64", dict(nonce="test-nonce", **STATUS_FIELDS)),
        ("legacy_hypervisor_false_base64", dict(nonce="test-nonce", hypervisor_active=False, **STATUS_FIELDS)),
        ("explicit_security_false_base64", dict(nonce="n", sip_enabled=False)),
    ],
)
def test_status_canonical_vectors_byte_for_byte(name, fields):
    expected = base64.b64decode(NACL["status_canonical"][name])
    timestamp = json.loads(expected)["timestamp"]
    response = protocol.AttestationResponse(signature="s", public_key="k", **fields)
    assert status_canonical(response, timestamp) == expected


def test_status_canonical_rust_golden_from_protocol_md():
    golden = (
        b'{"active_model_hash":"activemodel","binary_hash":"binhash","hypervisor_active":true,'
        b'"image_bridge_hash":"imghash","model_hashes":{"qwen":"modelhash1","trinity":"modelhash2"},'
        b'"nonce":"test-nonce","python_hash":"pyhash","rdma_disabled":true,"runtime_hash":"rthash",'
        b'"secure_boot_enabled":true,"sip_enabled":true,"template_hashes":{"chatml":"tmplhash1",'
        b'"gemma":"tmplhash2"},"timestamp":"2026-04-16T12:00:00Z"}'
    )
    built = build_status_canonical(
        "test-nonce", "2026-04-16T12:00:00Z", hypervisor_active=True, image_bridge_hash="imghash", **STATUS_FIELDS
    )
    assert built == golden


# --- encryption vectors R (a sealed request) and C (a sealed chunk) ------------------------------------------

SK_P = base64.b64decode("/AzRHq2voWuzyK2Bw8OL8oVbheD/UKR1aG7TTIIIoy8=")
PK_P = "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU="
SK_S = base64.b64decode("rJnHFe+JMG4zyZzr2XH77PFpzMpty5biJzvEfuN1bXQ=")
PK_S = "X6IvWt6JfUs/rZfjNb0jxCJZa33vVeIwJZnkd3fyskg="
MODEL = "mlx-community/Qwen3.5-9B-Instruct-4bit"
PLAINTEXT_R = (
    b'{"model":"mlx-community/Qwen3.5-9B-Instruct-4bit","messages":[{"role":"user","content":"What is 2+2?"}],'
    b'"stream":true,"max_tokens":64}'
)


def test_deterministic_keys_are_the_hashes_of_their_labels():
    assert SK_P == hashlib.sha256(b"darkbloom-test-provider-x25519").digest()
    assert SK_S == hashlib.sha256(b"darkbloom-test-coordinator-session-x25519").digest()
    assert ProviderIdentity.from_private_bytes(SK_P).public_key_b64 == PK_P
    assert ProviderIdentity.from_private_bytes(SK_S).public_key_b64 == PK_S


@pytest.mark.parametrize("wire", [w for w in MD_FRAMES if '"inference_request"' in w], ids=["A", "N"])
def test_vector_r_round_trips(wire):
    request = decode(wire)
    box, plaintext = ProviderIdentity.from_private_bytes(SK_P).open_request(request.encrypted_body)
    assert len(PLAINTEXT_R) == 134 and plaintext == PLAINTEXT_R
    coordinator = ProviderIdentity.from_private_bytes(SK_S).box_for(PK_P)
    resealed = coordinator.seal(PLAINTEXT_R, nonce=bytes(range(24)))
    assert resealed == request.encrypted_body
    assert len(base64.b64decode(resealed.ciphertext)) == 174


def test_vector_c_round_trips_through_sse_seal_and_frame():
    golden = decode(next(w for w in MD_FRAMES if '"inference_response_chunk"' in w))
    chunk = ChunkFactory("chatcmpl-1", 1777777777, MODEL).content("4")
    plaintext = event(chunk)
    assert plaintext.endswith(b'"finish_reason":null}]}\n\n')
    box = ProviderIdentity.from_private_bytes(SK_P).box_for(PK_S)
    frame = protocol.InferenceResponseChunk(
        request_id=golden.request_id, encrypted_data=box.seal(plaintext, nonce=bytes(range(0x64, 0x7C)))
    )
    assert frame == golden
    assert frame.encrypted_data.ephemeral_public_key == PK_P
    session = ProviderIdentity.from_private_bytes(SK_S).box_for(PK_P)
    assert session.open(golden.encrypted_data.ciphertext) == plaintext


def test_vector_r_rejects_a_flipped_byte():
    request = decode(next(w for w in MD_FRAMES if '"inference_request"' in w))
    sealed = bytearray(base64.b64decode(request.encrypted_body.ciphertext))
    for index in (0, 30, len(sealed) - 1):  # nonce, tag/body, last byte
        tampered = bytearray(sealed)
        tampered[index] ^= 0x01
        payload = request.encrypted_body.model_copy(update={"ciphertext": base64.b64encode(tampered).decode()})
        with pytest.raises(DecryptError):
            ProviderIdentity.from_private_bytes(SK_P).open_request(payload)


