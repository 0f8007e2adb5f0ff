"""Hostile mode of the coordinator double: seeded mutations of every coordinator → provider frame type.

    cases = list(hostile_cases(seed, count=10_000, provider_key=view.public_key))
    mark = double.mark()
    await double.send_hostile(view, cases)
    report = HostileReport.of(cases, double.events[mark:])
    assert report.violations() == []

Each case is one frame (``str``: a text frame, ``bytes``: a binary frame) built from a valid frame of one
type by one to three mutation operators: wrong types, missing and extra fields, huge strings, non-UTF-8
bytes and lone surrogates, binary frames, duplicate keys, numbers as strings, unknown and altered types,
deep nesting, truncation. Every string value the generator writes is unique, so every id names one case.

What a correct provider does with a case (``Expect``) follows from the frame alone, by these rules,
never from the provider's code:

* an ``inference_request`` whose ``request_id`` can be read (the frame is UTF-8 JSON, its last ``type`` is
  ``inference_request``, its last ``request_id`` a string of 1 to ``MAX_REQUEST_ID_CHARS`` characters that
  encodes as UTF-8) gets exactly one terminal frame (``inference_complete`` or ``inference_error``);
* an ``attestation_challenge`` may be answered only if its nonce can be echoed (1 to ``MAX_NONCE_CHARS``
  characters), at most once; an unmutated challenge must be answered;
* nothing else gets an answer: no frame of the provider may name an id the cases did not make readable.

The inference requests are sealed to the provider's key but name a model nobody serves, or carry a body
that is not a chat request: a mutation that leaves them valid is answered at once (404/400) and never
takes capacity from the valid requests a test sends beside them.
"""

from __future__ import annotations

import base64
import json
import random
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from nacl.public import Box, PrivateKey

from protocol.crypto import RequestBox, b64encode, parse_public_key
from protocol.to_provider import MAX_NONCE_CHARS, MAX_REQUEST_ID_CHARS, MAX_TIMESTAMP_CHARS

from . import events as ev

UNSERVED_MODEL = "hostile/no-such-model"
HUGE_BYTES = 11 * 1024 * 1024  # over the coordinator's 10 MiB frame limit: an echo of it could not be sent
TERMINAL_TYPES = frozenset({"inference_complete", "inference_error"})


# --- JSON with duplicate keys and raw tokens -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Raw:
    """A JSON token written as is (``NaN``, ``1e400``, a deep array)."""

    text: str


class Pairs(list):  # type: ignore[type-arg]
    """An object as (key, value) pairs, so a key can appear twice."""


def dumps(value: Any) -> str:
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, (Pairs, dict)):
        items = value if isinstance(value, Pairs) else value.items()
        return "{" + ",".join(f"{json.dumps(k)}:{dumps(v)}" for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v) for v in value) + "]"
    return json.dumps(value)  # ensure_ascii: a lone surrogate is written as a \\udXXX escape


# --- what a correct provider does with a frame -------------------------------------------------------------


def _echoable(value: object, limit: int) -> bool:
    if not isinstance(value, str) or not 0 < len(value) <= limit:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Expect:
    answer_id: str | None = None  # exactly one terminal frame for this request id
    nonce: str | None = None  # a challenge's nonce (a string), answered at most once
    nonce_echoable: bool = False  # it may be answered
    must_answer: bool = False  # an unmutated challenge: it must be answered


def expect(payload: str | bytes, *, mutated: bool = True) -> Expect:
    """The rules, read off the frame: the last duplicate key wins, as in every JSON decoder we know."""
    try:
        text = payload if isinstance(payload, str) else payload.decode("utf-8")
        value = json.loads(text)
    except (ValueError, RecursionError):
        return Expect()
    if not isinstance(value, dict):
        return Expect()
    if value.get("type") == "inference_request" and _echoable(value.get("request_id"), MAX_REQUEST_ID_CHARS):
        return Expect(answer_id=value["request_id"])
    if value.get("type") == "attestation_challenge" and isinstance(value.get("nonce"), str):
        timestamp = value.get("timestamp", "")
        echoable = _echoable(value["nonce"], MAX_NONCE_CHARS) and isinstance(timestamp, str) \
            and len(timestamp) <= MAX_TIMESTAMP_CHARS
        return Expect(nonce=value["nonce"], nonce_echoable=echoable, must_answer=not mutated)
    return Expect()


@dataclass(frozen=True, slots=True)
class HostileCase:
    kind: str  # the frame type it was made from
    operators: tuple[str, ...]  # what was done to it ("none": a valid frame)
    payload: str | bytes
    expect: Expect

    @property
    def binary(self) -> bool:
        return isinstance(self.payload, bytes)


# --- the generator -------------------------------------------------------------------------------------------


class _Maker:
    """Valid frames of every type, and unique values to mutate them with."""

    def __init__(self, rng: random.Random, provider_key: str) -> None:
        self.rng = rng
        self.provider_key = provider_key
        self.serial = 0
        self.session_key = PrivateKey(bytes(rng.getrandbits(8) for _ in range(32)))
        self.box = RequestBox(Box(self.session_key, parse_public_key(provider_key)),
                              b64encode(bytes(self.session_key.public_key)))

    def unique(self, prefix: str = "h") -> str:
        self.serial += 1
        return f"{prefix}-{self.serial}-{self.rng.getrandbits(32):08x}"

    def sealed(self, body: bytes | None = None) -> dict[str, str]:
        if body is None:
            body = json.dumps({"model": UNSERVED_MODEL, "messages": [{"role": "user", "content": self.unique()}],
                               "max_tokens": 2}).encode()
        sealed = self.box.seal(body, nonce=self.rng.randbytes(24))  # seeded: the same cases every run
        return {"ciphertext": sealed.ciphertext, "ephemeral_public_key": sealed.ephemeral_public_key}

    def inference_request(self) -> Pairs:
        body = self.rng.choice([None, None, None, b"not json", b"[]", json.dumps({"model": UNSERVED_MODEL}).encode()])
        frame = Pairs([("encrypted_body", self.sealed(body)), ("request_id", self.unique("req")),
                       ("type", "inference_request")])  # [A]: a Go map, keys sorted
        if self.rng.random() < 0.4:  # [N]: the struct's fields
            frame[:0] = [("body", {"model": "", "messages": None, "stream": False})]
            frame.append(("first_content_budget_ms", self.rng.randint(1, 20_000)))
            frame.append(("tool_schema_metadata_protocol", 1))
        return frame

    def nonce(self) -> str:
        return base64.b64encode(self.unique("nonce").encode().ljust(32, b"=")[:32]).decode()

    def frame(self, kind: str) -> Pairs:
        u = self.unique
        match kind:
            case "inference_request":
                return self.inference_request()
            case "cancel":
                return Pairs([("type", "cancel"), ("request_id", u("cancel"))])
            case "attestation_challenge":
                return Pairs([("type", kind), ("nonce", self.nonce()), ("timestamp", "2026-04-30T10:41:07Z")])
            case "runtime_status":
                mismatches = [{"component": "runtime", "expected": u(), "got": u()}]
                return Pairs([("type", kind), ("verified", self.rng.random() < 0.5), ("mismatches", mismatches)])
            case "load_model":
                return Pairs([("type", kind), ("model_id", u())])
            case "prefetch_model":
                return Pairs([("type", kind), ("model_id", u()), ("priority", 5)])
            case "desired_models":
                return Pairs([("type", kind), ("models", [{"model_name": u(), "desired_build": u(),
                                                           "previous_build": u()}])])
            case "trust_status":
                return Pairs([("type", kind), ("trust_level", "hardware"), ("status", "online"), ("reason", u())])
            case "capacity_probe":
                return Pairs([("type", kind), ("quote_id", u()), ("model", UNSERVED_MODEL),
                              ("prompt_tokens_bucket", 1024), ("max_output_tokens", 512),
                              ("deadline_remaining_ms", 8700)])
            case "code_attestation_resume_challenge":
                return Pairs([("type", kind), ("code_challenge", self.sealed(b"{}"))])
            case "provider_drain_ack":
                return Pairs([("type", kind), ("request_id", u("drain"))])
            case "models_replace_ack" | "models_replace_resumed" | "app_attest_shadow":
                return Pairs([("type", kind), ("token", u()), ("detail", {"n": 1})])
        raise ValueError(kind)

    def scalar(self) -> Any:
        """A JSON value of any type; strings are unique."""
        return self.rng.choice([
            lambda: None, lambda: True, lambda: False, lambda: 0, lambda: -1, lambda: 2**63, lambda: 2**64,
            lambda: 1.5, lambda: 1500.0, lambda: Raw("1e400"), lambda: Raw("NaN"), lambda: Raw("-Infinity"),
            lambda: Raw("-0"), lambda: "", self.unique, lambda: [], lambda: {}, lambda: [1, self.unique()],
            lambda: {"k": None, self.unique(): [True]},
        ])()


KINDS = ("inference_request", "cancel", "attestation_challenge", "runtime_status", "load_model", "prefetch_model",
         "desired_models", "trust_status", "capacity_probe", "code_attestation_resume_challenge",
         "provider_drain_ack", "models_replace_ack", "models_replace_resumed", "app_attest_shadow")
# Requests are what can go wrong in the most ways: a third of the cases.
_WEIGHTS = (len(KINDS) - 1,) + (2,) * (len(KINDS) - 1)

FrameOp = Callable[[_Maker, Pairs], Pairs]
TextOp = Callable[[_Maker, str], str | bytes]


def _pick_key(m: _Maker, frame: Pairs) -> int | None:
    return m.rng.randrange(len(frame)) if frame else None


def _wrong_type(m: _Maker, frame: Pairs) -> Pairs:
    i = _pick_key(m, frame)
    if i is not None:
        key, old = frame[i]
        new = m.scalar()
        while type(new) is type(old) and not isinstance(new, (Raw, str)):
            new = m.scalar()
        frame[i] = (key, new)
    return frame


def _drop(m: _Maker, frame: Pairs) -> Pairs:
    i = _pick_key(m, frame)
    if i is not None:
        del frame[i]
    return frame


def _extra(m: _Maker, frame: Pairs) -> Pairs:
    names = ["", "x", "ünïcødé", "request_id", "nonce", "encrypted_body", "body", "first_content_budget_ms",
             "cache_scope", "verified", m.unique("key")]
    for _ in range(m.rng.randint(1, 3)):
        frame.insert(m.rng.randint(0, len(frame)), (m.rng.choice(names), m.scalar()))
    return frame


def _huge(m: _Maker, frame: Pairs) -> Pairs:
    i = _pick_key(m, frame)
    if i is not None:
        roll = m.rng.random()
        size = HUGE_BYTES if roll < 0.002 else 1 << 20 if roll < 0.01 else m.rng.choice([300, 600, 4096, 16_384, 65_536])
        frame[i] = (frame[i][0], m.unique("huge").ljust(size, "x"))
    return frame


def _surrogate(m: _Maker, frame: Pairs) -> Pairs:
    i = _pick_key(m, frame)
    if i is not None:
        frame[i] = (frame[i][0], m.unique("s") + m.rng.choice(["\ud800", "\udc80", "\udfff"]))
    return frame


def _numbers_as_strings(m: _Maker, frame: Pairs) -> Pairs:
    for i, (key, value) in enumerate(frame):
        if key in ("request_id", "nonce") and isinstance(value, (bool, int, float)):
            frame[i] = (key, str(m.rng.getrandbits(60)) + str(m.serial))  # ids stay unique
            m.serial += 1
        elif isinstance(value, bool):
            frame[i] = (key, "true" if value else "false")
        elif isinstance(value, (int, float)):
            frame[i] = (key, str(value))
    if not any(isinstance(v, str) and v.isdigit() for _, v in frame):
        frame.append(("first_content_budget_ms", "100"))
    return frame


def _duplicate(m: _Maker, frame: Pairs) -> Pairs:
    i = _pick_key(m, frame)
    if i is not None:
        key = frame[i][0]
        value = m.unique() if isinstance(frame[i][1], str) and key != "type" else m.scalar()
        frame.insert(m.rng.randint(0, len(frame)), (key, value))
    return frame


def _deep(m: _Maker, frame: Pairs) -> Pairs:
    depth = m.rng.choice([50, 150, 250, 600, 1500])
    frame.insert(m.rng.randint(0, len(frame)), (m.rng.choice(["x", "body", "cache_scope"]),
                                                Raw("[" * depth + "]" * depth)))
    return frame


def _retype(m: _Maker, frame: Pairs) -> Pairs:
    types = [i for i, (k, _) in enumerate(frame) if k == "type"]
    new = m.rng.choice(["INFERENCE_REQUEST", "inference_request ", "Inference_Request", "from_the_future",
                        "register", "heartbeat", "inference_error", "", 7, None, m.rng.choice(KINDS)])
    if types:
        frame[types[-1]] = ("type", new)
    else:
        frame.append(("type", new))
    return frame


def _nested(m: _Maker, frame: Pairs) -> Pairs:
    """A mutation one level down (encrypted_body, body, mismatches, models...)."""
    for i, (key, value) in enumerate(frame):
        if isinstance(value, dict):
            inner = m.rng.choice([_wrong_type, _drop, _extra, _surrogate, _numbers_as_strings])(m, Pairs(value.items()))
            frame[i] = (key, inner)
            return frame
    return _wrong_type(m, frame)


FRAME_OPS: dict[str, FrameOp] = {
    "wrong_type": _wrong_type, "drop": _drop, "extra": _extra, "huge": _huge, "surrogate": _surrogate,
    "numbers_as_strings": _numbers_as_strings, "duplicate_key": _duplicate, "deep": _deep, "retype": _retype,
    "nested": _nested,
}


def _binary(m: _Maker, text: str) -> bytes:
    return text.encode("utf-8")


def _non_utf8(m: _Maker, text: str) -> bytes:
    raw = bytearray(text.encode("utf-8"))
    at = m.rng.randint(0, len(raw))
    raw[at:at] = m.rng.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x80"])
    return bytes(raw)


def _truncate(m: _Maker, text: str) -> str:
    return text[: m.rng.randint(0, max(len(text) - 1, 0))]


def _not_object(m: _Maker, text: str) -> str:
    return m.rng.choice([f"[{text}]", "null", "42", json.dumps(m.unique()), f"{text}{text}", f" \n{text}\t "])


def _bom(m: _Maker, text: str) -> str:
    return "\ufeff" + text


TEXT_OPS: dict[str, TextOp] = {
    "binary": _binary, "non_utf8": _non_utf8, "truncate": _truncate, "not_object": _not_object, "bom": _bom,
}


def _fixed_cases(m: _Maker) -> Iterator[tuple[str, tuple[str, ...], str | bytes]]:
    """Frames that once broke the provider (a zero key, wrong types, huge or unencodable ids and nonces,
    binary and non-UTF-8 frames), always among the cases."""
    def request(*changes: tuple[str, Any]) -> str:
        frame = m.inference_request()
        for key, value in changes:
            frame = Pairs([(k, v) for k, v in frame if k != key] + [(key, value)])
        return dumps(frame)

    zero_key = {**m.sealed(), "ephemeral_public_key": base64.b64encode(bytes(32)).decode()}
    yield "inference_request", ("zero_key",), request(("encrypted_body", zero_key))
    yield "inference_request", ("wrong_type",), request(("encrypted_body", "sealed"))
    yield "inference_request", ("wrong_type",), request(("encrypted_body", {**m.sealed(), "ciphertext": None}))
    yield "inference_request", ("numbers_as_strings",), request(("first_content_budget_ms", "100"))
    yield "inference_request", ("wrong_type",), request(("first_content_budget_ms", 1500.0))
    yield "inference_request", ("wrong_type",), request(("tool_schema_metadata_protocol", True))
    yield "inference_request", ("huge",), request(("request_id", m.unique("huge").ljust(HUGE_BYTES, "x")))
    yield "inference_request", ("surrogate",), request(("request_id", m.unique("s") + "\udc80"))
    yield "inference_request", ("binary",), request().encode()
    yield "inference_request", ("non_utf8", "binary"), _non_utf8(m, request())
    yield "attestation_challenge", ("huge",), dumps(Pairs([("type", "attestation_challenge"),
                                                          ("nonce", m.unique("n").ljust(HUGE_BYTES, "n")),
                                                          ("timestamp", "2026-04-30T10:41:07Z")]))


def hostile_cases(seed: int, *, count: int, provider_key: str, valid_every: int = 50) -> Iterator[HostileCase]:
    """``count`` mutated frames (the fixed cases first), with an unmutated frame of a random type
    every ``valid_every`` cases besides. Deterministic for a seed."""
    rng = random.Random(seed)
    m = _Maker(rng, provider_key)
    made = 0
    for kind, ops, payload in _fixed_cases(m):
        made += 1
        yield HostileCase(kind, ops, payload, expect(payload))
    while made < count:
        made += 1
        if made % valid_every == 0:
            kind = rng.choice(KINDS)
            payload = dumps(m.frame(kind))
            yield HostileCase(kind, ("none",), payload, expect(payload, mutated=False))
        kind = rng.choices(KINDS, weights=_WEIGHTS)[0]
        frame = m.frame(kind)
        names = rng.sample(sorted(FRAME_OPS), rng.choice([1, 1, 2, 3]))
        for name in names:
            frame = FRAME_OPS[name](m, frame)
        payload: str | bytes = dumps(frame)
        if rng.random() < 0.15:
            name = rng.choice(sorted(TEXT_OPS))
            names.append(name)
            payload = TEXT_OPS[name](m, payload)
        yield HostileCase(kind, tuple(names), payload, expect(payload))


# --- what happened --------------------------------------------------------------------------------------------


@dataclass
class HostileReport:
    """The provider's answers to the cases, checked against ``Expect``; counts for the test's output."""

    cases: list[HostileCase]
    terminals: Counter[str] = field(default_factory=Counter)  # request id -> terminal frames
    answered_nonces: Counter[str] = field(default_factory=Counter)
    disconnects: list[ev.Disconnected] = field(default_factory=list)
    other_frames: Counter[str] = field(default_factory=Counter)  # accepted/chunks, by type

    @classmethod
    def of(cls, cases: Iterable[HostileCase], events: Iterable[Any]) -> HostileReport:
        report = cls(list(cases))
        for event in events:
            if isinstance(event, ev.Disconnected):
                report.disconnects.append(event)
            if not isinstance(event, ev.FrameReceived):
                continue
            message = event.message
            if message.type in TERMINAL_TYPES:
                report.terminals[message.request_id] += 1
            elif message.type == "attestation_response":
                report.answered_nonces[message.nonce] += 1
            elif message.type in ("inference_accepted", "inference_response_chunk"):
                report.other_frames[message.type] += 1
        return report

    @property
    def answer_ids(self) -> list[str]:
        return [c.expect.answer_id for c in self.cases if c.expect.answer_id is not None]

    def violations(self, *, served_ids: Iterable[str] = ()) -> list[str]:
        """Every broken rule, as text (ids shortened). ``served_ids``: the valid requests' ids."""
        found = []
        expected = Counter(self.answer_ids)
        for rid in expected:
            if self.terminals[rid] != 1:
                found.append(f"request {rid[:40]!r}: {self.terminals[rid]} terminal frames, expected 1")
        served = set(served_ids)
        for rid, n in self.terminals.items():
            if rid not in expected and rid not in served:
                found.append(f"{n} terminal frame(s) for {rid[:40]!r}, which no case made readable")
        challenges = {c.expect.nonce: c.expect for c in self.cases if c.expect.nonce is not None}
        for nonce, n in self.answered_nonces.items():
            spec = challenges.get(nonce)
            if spec is None:
                continue  # the double's own challenges
            if not spec.nonce_echoable:
                found.append(f"challenge {nonce[:40]!r} answered although its nonce cannot be echoed")
            if n > 1:
                found.append(f"challenge {nonce[:40]!r} answered {n} times")
        for nonce, spec in challenges.items():
            if spec.must_answer and self.answered_nonces[nonce] != 1:
                found.append(f"valid challenge {nonce[:40]!r} answered {self.answered_nonces[nonce]} times")
        return found

    def counts(self) -> dict[str, Any]:
        ops: Counter[str] = Counter(op for c in self.cases for op in c.operators)
        return {
            "frames": len(self.cases),
            "mutated": sum(c.operators != ("none",) for c in self.cases),
            "binary": sum(c.binary for c in self.cases),
            "by_type": dict(Counter(c.kind for c in self.cases).most_common()),
            "by_operator": dict(ops.most_common()),
            "readable_request_ids": len(self.answer_ids),
            "terminal_frames": sum(self.terminals[rid] for rid in set(self.answer_ids)),
            "challenges_answered": sum(self.answered_nonces[c.expect.nonce] for c in self.cases
                                       if c.expect.nonce is not None),
            "challenges_not_echoable": sum(c.expect.nonce is not None and not c.expect.nonce_echoable
                                           for c in self.cases),
            "accepted_or_chunks": sum(self.other_frames.values()),
            "disconnects": len(self.disconnects),
        }


__all__ = ["HUGE_BYTES", "KINDS", "UNSERVED_MODEL", "Expect", "HostileCase", "HostileReport", "dumps", "expect",
           "hostile_cases"]
