"""decode/encode: tolerant inbound, strict Go-compatible outbound, and their properties (hypothesis)."""

from __future__ import annotations

import json
import re
import types
from enum import Enum
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import JsonValue, ValidationError
from pydantic.fields import FieldInfo

import protocol
from protocol import (
    FRAME_TYPES,
    MAX_INBOUND_FRAME_BYTES,
    EncodeError,
    ProtocolError,
    RawJSON,
    UnknownMessage,
    decode,
    encode,
)
from protocol._wire import WireModel

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# --- strategies built from the models themselves -------------------------------------------------------------

JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def raw_json(draw: st.DrawFn) -> RawJSON:
    value = draw(JSON_VALUES.filter(lambda v: v is not None))
    indent = draw(st.sampled_from([None, 0, 2]))
    return RawJSON(json.dumps(value, indent=indent, ensure_ascii=draw(st.booleans())))


def _bounds(metadata: tuple[Any, ...]) -> tuple[int | None, int | None]:
    # Field(ge=..., le=...) inside a nested Annotated stays a FieldInfo: look into it.
    metadata = tuple(m for item in metadata for m in (item.metadata if isinstance(item, FieldInfo) else [item]))
    low = next((m.ge for m in metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in metadata if isinstance(m, annotated_types.Le)), None)
    return low, high


def strategy_for(tp: Any, metadata: tuple[Any, ...] = ()) -> st.SearchStrategy[Any]:
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return strategy_for(base, (*metadata, *extra))
    if tp is JsonValue:
        return JSON_VALUES
    if tp is RawJSON:
        return raw_json()
    if tp is type(None):
        return st.none()
    if isinstance(tp, type) and issubclass(tp, WireModel):
        return models(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return st.sampled_from(list(tp))
    if origin in (Union, types.UnionType):
        return st.one_of([strategy_for(arg, metadata) for arg in get_args(tp)])
    if origin is Literal:
        return st.sampled_from(get_args(tp))
    if origin is tuple:
        return st.lists(strategy_for(get_args(tp)[0]), max_size=2).map(tuple)
    if origin is dict:
        key, value = get_args(tp)
        return st.dictionaries(strategy_for(key), strategy_for(value), max_size=2)
    if tp is bool:
        return st.booleans()
    if tp is int:
        low, high = _bounds(metadata)
        return st.integers(low, high)
    if tp is float:
        return st.floats(allow_nan=False, allow_infinity=False)
    if tp is str:
        return st.text(max_size=16)
    raise TypeError(f"no strategy for {tp!r}")


def models(cls: type[WireModel]) -> st.SearchStrategy[WireModel]:
    fields = {name: strategy_for(info.annotation, tuple(info.metadata)) for name, info in cls.model_fields.items()}
    return st.builds(cls, **fields)


ALL_FRAMES = sorted(FRAME_TYPES.values(), key=lambda cls: cls.__name__)
MESSAGES = st.sampled_from(ALL_FRAMES).flatmap(models)


def _int_fields(cls: type[WireModel]) -> list[str]:
    return [name for name, info in cls.model_fields.items() if info.annotation is int]


# --- properties ----------------------------------------------------------------------------------------------


@FAST
@given(MESSAGES)
def test_decode_inverts_encode(message):
    assert decode(encode(message)) == message


@FAST
@given(MESSAGES)
def test_encoding_is_one_compact_object_with_ints_as_ints(message):
    text = encode(message)
    parsed = json.loads(text)
    assert isinstance(parsed, dict) and parsed["type"] == message.type
    outside_strings = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    assert not re.search(r"\s", outside_strings) or "attestation" in parsed  # raw attestation keeps its bytes
    _assert_ints_are_ints(message, parsed)


def _assert_ints_are_ints(model: WireModel, wire: dict[str, Any]) -> None:
    for name, info in type(model).model_fields.items():
        if name not in wire:
            continue
        value = getattr(model, name)
        if info.annotation is int:
            assert type(wire[name]) is int, name
        elif isinstance(value, WireModel):
            _assert_ints_are_ints(value, wire[name])
        elif isinstance(value, tuple):
            for item, item_wire in zip(value, wire[name]):
                if isinstance(item, WireModel):
                    _assert_ints_are_ints(item, item_wire)


@FAST
@given(st.data())
def test_a_float_can_never_be_encoded_in_an_int_field(data):
    cls = data.draw(st.sampled_from([c for c in ALL_FRAMES if _int_fields(c)]))
    message = data.draw(models(cls))
    name = data.draw(st.sampled_from(_int_fields(cls)))
    as_float = float(getattr(message, name))
    with pytest.raises(ValidationError):
        cls(**{**dict(message), name: as_float})
    # Even bypassing validation, the encoder refuses it.
    with pytest.raises(EncodeError):
        encode(message.model_copy(update={name: as_float}))
    # And Go's rule holds inbound: 64.0 is not an int.
    wire = json.loads(encode(message))
    wire[name] = as_float
    with pytest.raises(ProtocolError):
        decode(json.dumps(wire))


@FAST
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_protocol_error(data):
    try:
        result = decode(data)
    except ProtocolError:
        return
    assert isinstance(result, WireModel)


FIELD_NAMES = sorted({name for cls in ALL_FRAMES for name in cls.model_fields} | {"body", "nonce"})


@FAST
@given(
    st.sampled_from([*FRAME_TYPES, "future_frame", ""]) | JSON_SCALARS,
    st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), JSON_VALUES, max_size=6),
)
def test_arbitrary_json_objects_only_ever_raise_protocol_error(type_value, fields):
    try:
        result = decode(json.dumps({**fields, "type": type_value}))
    except ProtocolError:
        return
    assert isinstance(result, WireModel) and result.type == type_value


@FAST
@given(JSON_VALUES)
def test_arbitrary_json_values_only_ever_raise_protocol_error(value):
    try:
        result = decode(json.dumps(value))
    except ProtocolError:
        return
    assert isinstance(result, WireModel)


@FAST
@given(st.data())
def test_a_mutated_valid_frame_only_ever_raises_protocol_error(data):
    message = data.draw(MESSAGES)
    wire = json.loads(encode(message))
    key = data.draw(st.sampled_from(sorted(wire)))
    wire[key] = data.draw(JSON_VALUES)
    try:
        result = decode(json.dumps(wire))
    except ProtocolError:
        return
    assert isinstance(result, WireModel)


# --- tolerant inbound ----------------------------------------------------------------------------------------


def test_unknown_type_is_a_value_not_an_error():
    message = decode('{"type":"quantum_entangle","request_id":"r","payload":{"x":[1,2]}}')
    assert message == UnknownMessage(type="quantum_entangle")
    with pytest.raises(EncodeError):
        encode(message)


def test_unknown_fields_are_ignored():
    message = decode('{"type":"cancel","request_id":"r1","reason":"client_gone","v":{"deep":[1]}}')
    assert message == protocol.Cancel(request_id="r1")


@pytest.mark.parametrize(
    "body_json",
    ['"body":null,', "", '"body":{"model":"","messages":null,"stream":false},'],
    ids=["null", "absent", "go-zero-value"],
)
def test_inference_request_body_forms_are_accepted(body_json):
    wire = (
        '{"type":"inference_request","request_id":"r",' + body_json + '"encrypted_body":'
        '{"ephemeral_public_key":"k","ciphertext":"c"},"first_content_budget_ms":9412}'
    )
    message = decode(wire)
    assert isinstance(message, protocol.InferenceRequest)
    assert message.encrypted_body == protocol.EncryptedPayload(ephemeral_public_key="k", ciphertext="c")
    assert message.first_content_budget_ms == 9412


def test_inference_request_without_encrypted_body_still_decodes_so_it_can_be_refused():
    message = decode('{"type":"inference_request","request_id":"r"}')
    assert message.request_id == "r" and message.encrypted_body is None


@pytest.mark.parametrize("active", ["", ',"active_model":null'], ids=["absent", "null"])
def test_heartbeat_active_model_absent_or_null(active):
    wire = (
        '{"type":"heartbeat","status":"idle"' + active + ',"stats":{"requests_served":0,"tokens_generated":0},'
        '"system_metrics":{"memory_pressure":0,"cpu_usage":0,"thermal_state":"nominal"}}'
    )
    assert decode(wire).active_model is None


def test_go_nil_slices_read_as_empty():
    assert decode('{"type":"desired_models","models":null}').models == ()
    assert decode('{"type":"runtime_status","verified":false,"mismatches":null}').mismatches == ()


def test_inbound_frames_up_to_32_mib_are_accepted():
    # [N] seals bodies up to 16 MiB: ≈21.3 MiB of base64 in one frame.
    ciphertext = "A" * (22 * 1024 * 1024)
    wire = (
        '{"type":"inference_request","request_id":"big","encrypted_body":'
        '{"ephemeral_public_key":"k","ciphertext":"' + ciphertext + '"}}'
    )
    message = decode(wire.encode())
    assert len(message.encrypted_body.ciphertext) == len(ciphertext)
    padded = wire[:-1] + "," + '"pad":"' + "x" * (MAX_INBOUND_FRAME_BYTES - len(wire) - 9) + '"}'
    assert len(padded) == MAX_INBOUND_FRAME_BYTES
    assert decode(padded).request_id == "big"
    with pytest.raises(ProtocolError):
        decode(padded[:-2] + 'x"}')


@pytest.mark.parametrize(
    "data",
    [b"", b"\xff\xfe", "not json", "[1,2]", '"cancel"', "{}", '{"type":5}', '{"type":null}',
     '{"type":"cancel","request_id":7}', '{"type":"register"}', '{"type":"cancel"} trailing'],
)
def test_malformed_frames_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


def test_protocol_error_text_never_quotes_the_frame():
    secret = "my-secret-prompt-text"
    with pytest.raises(ProtocolError) as caught:
        decode('{"type":"inference_request","request_id":"r","encrypted_body":"' + secret + '"}')
    assert secret not in str(caught.value) and "encrypted_body" in str(caught.value)


def test_decode_rejects_non_text_input():
    with pytest.raises(ProtocolError):
        decode(12)  # type: ignore[arg-type]


# --- strict outbound -----------------------------------------------------------------------------------------

HARDWARE = protocol.Hardware(
    machine_model="Mac15,8",
    chip_name="Apple M3 Max",
    chip_family="M3",
    chip_tier="Max",
    memory_gb=64,
    memory_available_gb=58,
    cpu_cores=protocol.CpuCores(total=16, performance=12, efficiency=4),
    gpu_cores=40,
    memory_bandwidth_gbs=400,
)


def test_optional_fields_are_omitted_when_empty():
    register = protocol.Register(hardware=HARDWARE, models=[], backend="inprocess-mlx")
    assert set(json.loads(encode(register))) == {"type", "hardware", "models", "backend"}
    chunk = protocol.InferenceResponseChunk(
        request_id="r", encrypted_data=protocol.EncryptedPayload(ephemeral_public_key="k", ciphertext="c")
    )
    assert "data" not in json.loads(encode(chunk))


def test_null_and_false_survive_where_they_mean_something():
    heartbeat = protocol.Heartbeat(
        status=protocol.HeartbeatStatus.IDLE,
        stats=protocol.HeartbeatStats(requests_served=0, tokens_generated=0),
        system_metrics=protocol.SystemMetrics(memory_pressure=0.1, cpu_usage=0.0, thermal_state=protocol.ThermalState.NOMINAL),
    )
    wire = json.loads(encode(heartbeat))
    assert wire["active_model"] is None and wire["status"] == "idle" and wire["system_metrics"]["thermal_state"] == "nominal"
    response = protocol.AttestationResponse(nonce="n", signature="s", public_key="k", sip_enabled=False, rdma_disabled=True)
    wire = json.loads(encode(response))
    assert wire["sip_enabled"] is False and "secure_boot_enabled" not in wire and "hypervisor_active" not in wire
    error = protocol.InferenceError(request_id="r", error="e", status_code=503, available_token_budget=0)
    assert json.loads(encode(error))["available_token_budget"] == 0


@pytest.mark.parametrize("bad", [64.0, True, "64", 2**63])
def test_int_fields_take_only_ints(bad):
    with pytest.raises(ValidationError):
        HARDWARE.model_validate({**HARDWARE.model_dump(), "memory_gb": bad})


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.5", False])
def test_float_fields_take_only_finite_numbers(bad):
    with pytest.raises(ValidationError):
        HARDWARE.model_validate({**HARDWARE.model_dump(), "memory_bandwidth_gbs": bad})


def test_frames_are_frozen():
    with pytest.raises(ValidationError):
        HARDWARE.memory_gb = 1  # type: ignore[misc]


def test_outbound_frames_above_the_coordinator_read_limit_are_refused():
    big = protocol.InferenceResponseChunk(
        request_id="r", encrypted_data=protocol.EncryptedPayload(ephemeral_public_key="k", ciphertext="A" * (10 * 1024 * 1024))
    )
    with pytest.raises(EncodeError):
        encode(big)
    # The coordinator's own frames (a test double sends them) may be larger.
    request = protocol.InferenceRequest(
        request_id="r", encrypted_body=protocol.EncryptedPayload(ephemeral_public_key="k", ciphertext="A" * (12 * 1024 * 1024))
    )
    assert decode(encode(request)) == request


def test_raw_json_must_be_one_json_value():
    for bad in ["", " {}", "{", "{} {}", "nan"]:
        with pytest.raises(ValueError):
            RawJSON(bad)
    assert RawJSON.of({"b": 1, "a": "é"}).text == '{"b":1,"a":"é"}'
