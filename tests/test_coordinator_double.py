"""Tests of the coordinator double itself, driven by a scripted fake provider (websockets + protocol + PyNaCl)
and consumers on the real ``openai`` SDK. Timers are shrunk so every test takes well under a few seconds."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from coordinator_double import (
    ATTESTED_HEADER,
    JOB_HEADER,
    TRUST_LEVEL_HEADER,
    Accepted,
    CancelCause,
    CancelSent,
    ChallengeFailure,
    ChallengeResult,
    ChunkFault,
    ChunkRejected,
    Committed,
    CoordinatorDouble,
    Dispatched,
    DoubleConfig,
    Dropped,
    DropReason,
    Evicted,
    InvalidFrame,
    InvalidKind,
    MarkedUntrusted,
    ProtocolViolation,
    Registered,
    Rejected,
    SignatureCheck,
    TimedOut,
    TrustLevel,
    Unroutable,
    Violation,
    Window,
)
from coordinator_double.attestation import verify_registration
from coordinator_double.events import AfterTerminal, Disconnected
from coordinator_double.fake_provider import MODEL, FakeProvider, Job
from double_fixtures import consumer_for, quick_config
from protocol import (
    AttestationChallenge,
    BackendCapacity,
    EncryptedPayload,
    InferenceAccepted,
    InferenceResponseChunk,
    RawJSON,
    encode,
)
from protocol.attest import ChallengeSigner
from protocol.crypto import ProviderIdentity
from protocol.sse import DONE, ChunkFactory, data_line, event

FAST = {"first_response_timeout": 2.0, "accepted_timeout": 3.0, "stream_idle_timeout": 3.0, "queue_timeout": 1.0}


@pytest.fixture
def double_config() -> DoubleConfig:  # this module's shrunk timers
    return quick_config(**FAST)


@pytest.fixture
async def providers(coordinator_double: CoordinatorDouble) -> AsyncIterator[list[FakeProvider]]:
    made: list[FakeProvider] = []
    yield made
    for provider in made:
        await provider.close()


async def routable_provider(double: CoordinatorDouble, made: list[FakeProvider], **register: Any) -> FakeProvider:
    provider = FakeProvider(double.ws_url)
    made.append(provider)
    await provider.connect(provider.register_frame(**register) if register else None)
    await double.wait_routable(len(made), timeout=5)
    return provider


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi <there> & you"}], **extra}


# --- consumers through the openai SDK ------------------------------------------------------------------------


async def test_streaming_consumer_gets_events_verbatim_with_usage_and_job_id(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)

    async def consume() -> tuple[str, list[Any], str]:
        raw = await openai_consumer.chat.completions.with_raw_response.create(
            stream=True, stream_options={"include_usage": True}, **chat()
        )
        chunks = [chunk async for chunk in raw.parse()]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks, raw.headers[JOB_HEADER]

    consumer = asyncio.create_task(consume())
    job = await provider.next_job()
    # The coordinator forwards the body with max_tokens injected, re-marshalled like a Go map.
    assert job.body["max_tokens"] == 8192 and job.body["stream"] is True
    assert job.body["messages"][0]["content"] == "hi <there> & you"
    await provider.accept(job)
    await provider.stream(job, ["Hello", ",", " world"], usage_chunk=True)
    text, chunks, job_id = await asyncio.wait_for(consumer, 5)

    assert text == "Hello, world"
    assert job_id == job.request_id
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    # [A] deferred cancel after every committed request, even a successful one.
    sent = await double.wait_for(lambda e: isinstance(e, CancelSent) and e.request_id == job.request_id, timeout=5)
    assert sent.cause is CancelCause.FINISHED and sent.delivered
    await provider.received(lambda: job.request_id in provider.cancels)
    assert double.anomalies() == []


async def test_non_streaming_consumer_gets_reassembled_completion_with_usage_from_complete(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(max_tokens=16, **chat()))
    job = await provider.next_job()
    assert job.body["max_tokens"] == 16  # an explicit bound is kept
    await provider.stream(job, ["Hel", "lo"], prompt_tokens=7)
    completion = await asyncio.wait_for(consumer, 5)

    assert completion.choices[0].message.content == "Hello"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.model == MODEL
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == (7, 2, 9)
    await double.wait_for(lambda e: isinstance(e, CancelSent) and e.request_id == job.request_id, timeout=5)


async def test_single_chat_completion_chunk_is_passed_through(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    provider = await routable_provider(coordinator_double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(**chat()))
    job = await provider.next_job()
    whole = {
        "id": "chatcmpl-whole",
        "object": "chat.completion",
        "created": 1,
        "model": "other-name",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "all at once"}, "finish_reason": "length"}],
    }
    await provider.event(job, b"data: " + json.dumps(whole).encode())
    await provider.complete(job, 3, 4)
    completion = await asyncio.wait_for(consumer, 5)
    assert completion.id == "chatcmpl-whole" and completion.model == MODEL
    assert completion.choices[0].message.content == "all at once" and completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 4


async def test_models_endpoint_lists_registered_models(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    await routable_provider(coordinator_double, providers)
    models = await openai_consumer.models.list()
    assert [m.id for m in models.data] == [MODEL]


# --- challenges -----------------------------------------------------------------------------------------------


def _answer_with(**update: Any) -> Callable[[FakeProvider, AttestationChallenge], Any]:
    def answer(provider: FakeProvider, challenge: AttestationChallenge) -> Any:
        return provider.valid_answer(challenge).model_copy(update=update)

    return answer


@pytest.mark.parametrize(
    ("answer", "failure", "untrusted"),
    [
        (_answer_with(public_key=ProviderIdentity.generate().public_key_b64), ChallengeFailure.PUBLIC_KEY_MISMATCH, False),
        (_answer_with(signature=""), ChallengeFailure.EMPTY_SIGNATURE, False),
        (_answer_with(sip_enabled=None), ChallengeFailure.SIP_MISSING, False),
        (_answer_with(sip_enabled=False), ChallengeFailure.SIP_DISABLED, True),
        (_answer_with(secure_boot_enabled=None), ChallengeFailure.SECURE_BOOT_MISSING, False),
        (_answer_with(rdma_disabled=False), ChallengeFailure.RDMA_ENABLED, True),
    ],
    ids=["wrong-key", "empty-signature", "no-sip", "sip-off", "no-secure-boot", "rdma-on"],
)
async def test_failed_challenge_leaves_provider_unroutable(
    coordinator_double: CoordinatorDouble,
    providers: list[FakeProvider],
    answer: Callable[..., Any],
    failure: ChallengeFailure,
    untrusted: bool,
) -> None:
    double = coordinator_double
    provider = FakeProvider(double.ws_url, answer=answer)
    providers.append(provider)
    await provider.connect()
    result = await double.wait_for(lambda e: isinstance(e, ChallengeResult), timeout=5)
    assert not result.ok and result.failure is failure
    view = double.provider(0)
    assert view.registered and not view.routable
    assert Unroutable.CHALLENGE_NOT_PASSED in view.unroutable
    assert view.untrusted is untrusted


async def test_unanswered_challenge_times_out(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(DoubleConfig(challenge_response_timeout=0.3)) as double:
        provider = FakeProvider(double.ws_url, answer=lambda p, c: None)
        providers.append(provider)
        await provider.connect()
        result = await double.wait_for(lambda e: isinstance(e, ChallengeResult), timeout=5)
        assert result.failure is ChallengeFailure.TIMEOUT and not double.provider(0).routable
        await provider.close()


async def test_signatures_verified_only_for_attested_providers(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    plain = FakeProvider(double.ws_url)
    attested = FakeProvider(double.ws_url)
    forged = FakeProvider(double.ws_url, answer=_answer_with(signature=ChallengeSigner.generate().sign(b"x")))
    providers.extend([plain, attested, forged])
    await plain.connect()
    await attested.connect(attested.register_frame(attested=True))
    await forged.connect(forged.register_frame(attested=True))
    await double.wait_until(lambda: len(double.events.of(ChallengeResult)) == 3, timeout=5)
    by_provider = {r.provider_id: r for r in double.events.of(ChallengeResult)}
    registered = {r.provider_id: r for r in double.events.of(Registered)}
    views = double.providers
    assert [registered[v.provider_id].attested for v in views] == [False, True, True]
    results = [by_provider[v.provider_id] for v in views]
    assert [(r.ok, r.signature) for r in results[:2]] == [
        (True, SignatureCheck.PRESENT_UNVERIFIED),
        (True, SignatureCheck.VERIFIED),
    ]
    assert results[2].failure is ChallengeFailure.BAD_SIGNATURE
    # an extra challenge on demand, answered again
    again = await double.send_challenge(views[1])
    assert again.ok and again.signature is SignatureCheck.VERIFIED


# --- registration attestation, as [A] verifies it ------------------------------------------------------------


def _attestation(provider: FakeProvider, text_edit: Callable[[str], str] | None = None, **blob: Any):
    """The fake provider's attestation, with ``blob`` fields changed before signing and ``text_edit`` applied
    to the signed text afterwards (tampering in flight)."""
    signed = provider.attestation(**blob)
    return signed if text_edit is None else RawJSON(text_edit(signed.text))


def _signature(signed: RawJSON, signature: str) -> RawJSON:
    """``signed`` with its signature member replaced (the blob bytes untouched)."""
    head, _, _ = signed.text.rpartition('"signature":')
    return RawJSON(f'{head}"signature":"{signature}"}}')


def _compact(key_b64: str) -> str:
    return base64.b64encode(base64.b64decode(key_b64)[1:]).decode()  # X‖Y, CryptoKit's rawRepresentation


@pytest.mark.parametrize(("make", "valid", "error"), [
    (lambda p: _attestation(p), True, None),
    (lambda p: _attestation(p, publicKey=_compact(p.signer.public_key_b64)), True, None),  # 64 bytes: accepted
    (lambda p: _attestation(p, lambda t: t.replace("Mac15,8", "Mac99,1")), False, "signature verification failed"),
    (lambda p: _attestation(p, lambda t: t.replace('"sipEnabled":true', '"sipEnabled": true')), False,
     "signature verification failed"),  # one space: other bytes, the same JSON
    (lambda p: _attestation(p, secureEnclaveAvailable=False), False, "Secure Enclave not available"),
    (lambda p: _attestation(p, sipEnabled=False), False, "SIP not enabled"),
    (lambda p: _attestation(p, secureBootEnabled=False), False, "Secure Boot not enabled"),
    (lambda p: _attestation(p, timestamp="2026-04-16 12:00:00"), False, "invalid timestamp"),
    (lambda p: _attestation(p, encryptionPublicKey=None), False, "attestation missing encryption public key"),
    (lambda p: _attestation(p, encryptionPublicKey=ProviderIdentity.generate().public_key_b64), False,
     "encryption key mismatch"),
    (lambda p: _attestation(p, publicKey=base64.b64encode(
        bytes([2 + (base64.b64decode(p.signer.public_key_b64)[64] & 1)]) + base64.b64decode(p.signer.public_key_b64)[1:33]
    ).decode()), False, "invalid public key"),  # compressed point: [A] takes 64 or 65 bytes only
    (lambda p: _attestation(p, publicKey=ChallengeSigner.generate().public_key_b64), False,
     "signature verification failed"),
    (lambda p: _attestation(p, publicKey="not base64!"), False, "invalid public key base64"),
    (lambda p: _signature(_attestation(p), "not base64!"), False, "invalid signature base64"),
    (lambda p: _signature(_attestation(p), base64.b64encode(b"not DER").decode()), False, "invalid DER signature"),
], ids=["valid", "raw-xy-key", "tampered-field", "tampered-whitespace", "no-enclave", "no-sip", "no-secure-boot",
        "bad-timestamp", "no-encryption-key", "other-encryption-key", "compressed-key", "other-signing-key",
        "key-not-base64", "signature-not-base64", "signature-not-der"])
def test_registration_attestation_checks_follow_a(make, valid, error):
    provider = FakeProvider("ws://unused")
    result = verify_registration(make(provider), provider.identity.public_key_b64)
    assert result is not None and (result.valid, result.error) == (valid, error)
    assert result.trust_level is (TrustLevel.SELF_SIGNED if valid else TrustLevel.NONE)


def test_an_attestation_that_does_not_parse_is_no_attestation_at_all():
    provider = FakeProvider("ws://unused")
    assert verify_registration(None, "") is None
    for broken in (_attestation(provider, sipEnabled="true"), RawJSON('{"signature":"x"}'),
                   RawJSON('{"attestation":[1],"signature":"x"}'), RawJSON('{"attestation":{},"signature":5}')):
        assert verify_registration(broken, provider.identity.public_key_b64) is None
    # null members are Go zero values: parsed, invalid, no key to check challenges with
    empty = verify_registration(RawJSON('{"attestation":null,"signature":null}'), "")
    assert empty is not None and (empty.valid, empty.public_key, empty.error) == (False, "", "invalid timestamp")


async def test_min_trust_self_signed_routes_only_a_valid_attestation(providers: list[FakeProvider]) -> None:
    """[A] at EIGENINFERENCE_MIN_TRUST=self_signed: a valid blob is routable at once (it counts as a passed
    challenge); a tampered one is refused yet keeps its key, so challenge signatures are still verified;
    no blob at all is trust none. Consumers see the trust in X-Provider-Attested / X-Provider-Trust-Level."""
    async with CoordinatorDouble(quick_config(**FAST, min_trust=TrustLevel.SELF_SIGNED,
                                              challenge_interval=3600)) as double:
        good, tampered, plain, broken = (FakeProvider(double.ws_url) for _ in range(4))
        providers.extend([good, tampered, plain, broken])
        await good.connect(good.register_frame(attestation=_attestation(good)))
        await tampered.connect(tampered.register_frame(
            attestation=_attestation(tampered, lambda t: t.replace("Apple M3 Max", "Apple M4 Max"))))
        await plain.connect()
        await broken.connect(broken.register_frame(attestation=_attestation(broken, sipEnabled="true")))
        await double.wait_until(lambda: len(double.events.of(ChallengeResult)) == 4, timeout=5)
        views = double.providers
        assert [(v.trust_level, v.attested, v.attestation_error) for v in views] == [
            (TrustLevel.SELF_SIGNED, True, None),
            (TrustLevel.NONE, False, "signature verification failed"),
            (TrustLevel.NONE, False, None),
            (TrustLevel.NONE, False, "failed to parse provider attestation"),
        ]
        assert [v.routable for v in views] == [True, False, False, False]
        assert all(Unroutable.TRUST_BELOW_MINIMUM in v.unroutable for v in views[1:])
        signatures = {r.provider_id: r.signature for r in double.events.of(ChallengeResult)}
        assert [signatures[v.provider_id] for v in views] == [
            SignatureCheck.VERIFIED, SignatureCheck.VERIFIED, SignatureCheck.PRESENT_UNVERIFIED,
            SignatureCheck.PRESENT_UNVERIFIED]
        registered = {r.provider_id: r for r in double.events.of(Registered)}
        assert registered[views[1].provider_id].attestation_error == "signature verification failed"

        async def serve(provider: FakeProvider) -> None:
            job = await provider.next_job(timeout=5)
            await provider.accept(job)
            await provider.stream(job, ["hi"])

        server = asyncio.create_task(serve(good))
        async with consumer_for(double) as client:
            raw = await client.chat.completions.with_raw_response.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4)
        await server
        assert raw.headers[ATTESTED_HEADER] == "true" and raw.headers[TRUST_LEVEL_HEADER] == "self_signed"
        assert [d.provider_id for d in double.events.of(Dispatched)] == [views[0].provider_id]


@pytest.mark.parametrize(
    ("register", "reason"),
    [
        ({"backend": "mlx-swift"}, Unroutable.WRONG_BACKEND),
        ({"public_key": "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV_Wm2rSU"}, Unroutable.NO_PUBLIC_KEY),
        ({"encrypted_response_chunks": False}, Unroutable.PLAINTEXT_RESPONSES),
        ({"privacy_capabilities": None}, Unroutable.PRIVACY_CAPABILITIES),
    ],
    ids=["backend", "urlsafe-key", "plaintext", "no-privacy"],
)
async def test_registration_requirements(
    coordinator_double: CoordinatorDouble,
    providers: list[FakeProvider],
    register: dict[str, Any],
    reason: Unroutable,
) -> None:
    provider = FakeProvider(coordinator_double.ws_url)
    providers.append(provider)
    await provider.connect(provider.register_frame(**register))
    await coordinator_double.wait_for(lambda e: isinstance(e, ChallengeResult), timeout=5)
    assert reason in coordinator_double.provider(0).unroutable


# --- dispatch: reroute, timeouts, chunk faults ------------------------------------------------------------------


async def test_pre_chunk_error_reroutes_with_new_request_id_and_session_key(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    full = await routable_provider(double, providers)  # registered first: tried first
    spare = await routable_provider(double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.with_raw_response.create(**chat()))
    first = await full.next_job()
    await full.reject(first, 503)
    second = await spare.next_job()
    await spare.stream(second, ["ok"])
    raw = await asyncio.wait_for(consumer, 5)

    assert raw.parse().choices[0].message.content == "ok"
    assert raw.headers[JOB_HEADER] == second.request_id != first.request_id
    assert second.session_key != first.session_key
    dispatched = double.events.of(Dispatched)
    assert [(d.attempt, d.request_id) for d in dispatched] == [(0, first.request_id), (1, second.request_id)]
    rejected = double.events.of(Rejected)
    assert [(r.request_id, r.status_code, r.internal) for r in rejected] == [(first.request_id, 503, False)]
    await double.wait_for(lambda e: isinstance(e, CancelSent) and e.request_id == second.request_id, timeout=5)
    assert first.request_id not in full.cancels  # [A]: no cancel for a rejected attempt
    assert all(c.request_id != first.request_id for c in double.events.of(CancelSent))


async def test_single_provider_reject_exhausts_with_provider_status(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    provider = await routable_provider(coordinator_double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(**chat()))
    await provider.reject(await provider.next_job(), 503)
    with pytest.raises(openai.APIStatusError) as caught:
        await asyncio.wait_for(consumer, 5)
    assert caught.value.status_code == 503
    assert caught.value.body == {
        "type": "provider_error",
        "message": "inference failed after 3 attempt(s): Provider capacity is temporarily unavailable.",
    }


async def test_first_response_timeout_cancels_reroutes_and_ends_in_504(providers: list[FakeProvider]) -> None:
    config = quick_config(first_response_timeout=0.3, queue_timeout=1.0)
    async with CoordinatorDouble(config) as double:
        silent = [await routable_provider(double, providers) for _ in range(2)]
        async with consumer_for(double) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(**chat())
        assert caught.value.status_code == 504
        timed_out = double.events.of(TimedOut)
        assert len(timed_out) == 2 and {t.window for t in timed_out} == {Window.FIRST_RESPONSE}
        await double.wait_until(lambda: len(double.events.of(CancelSent)) == 2, timeout=5)
        assert {c.cause for c in double.events.of(CancelSent)} == {CancelCause.TIMEOUT}
        for provider in silent:
            await provider.received(lambda p=provider: len(p.cancels) == 1)
        assert {p.cancels[0] for p in silent} == {t.request_id for t in timed_out}
        assert not double.errors


async def test_accept_moves_to_the_long_window(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(quick_config(first_response_timeout=0.3, accepted_timeout=5.0)) as double:
        provider = await routable_provider(double, providers)
        async with consumer_for(double) as client:
            consumer = asyncio.create_task(client.chat.completions.create(**chat()))
            job = await provider.next_job()
            await provider.accept(job)
            await double.wait_for(lambda e: isinstance(e, Accepted), timeout=5)
            await asyncio.sleep(0.6)  # a slow model load: twice the first-response window
            await provider.stream(job, ["late"])
            completion = await asyncio.wait_for(consumer, 5)
        assert completion.choices[0].message.content == "late"
        assert double.events.of(TimedOut) == []


async def test_accepted_window_timeout(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(quick_config(first_response_timeout=0.3, accepted_timeout=0.4)) as double:
        provider = await routable_provider(double, providers)
        async with consumer_for(double) as client:
            consumer = asyncio.create_task(client.chat.completions.create(**chat()))
            await provider.accept(await provider.next_job())
            with pytest.raises(openai.APIStatusError) as caught:
                await asyncio.wait_for(consumer, 5)
        assert caught.value.status_code == 504
        assert [t.window for t in double.events.of(TimedOut)] == [Window.ACCEPTED]


def _tamper(provider: FakeProvider, job: Job, sse: bytes) -> str:
    sealed = job.box.seal_chunk(job.request_id, sse)
    assert sealed.encrypted_data is not None
    cipher = bytearray(base64.b64decode(sealed.encrypted_data.ciphertext))
    cipher[-1] ^= 1
    payload = EncryptedPayload(
        ephemeral_public_key=provider.identity.public_key_b64,
        ciphertext=base64.b64encode(bytes(cipher)).decode(),
    )
    return encode(InferenceResponseChunk(request_id=job.request_id, encrypted_data=payload))


CHUNK_FAULTS: dict[ChunkFault, Callable[[FakeProvider, Job, bytes], str]] = {
    ChunkFault.PLAINTEXT: lambda p, j, sse: encode(InferenceResponseChunk(request_id=j.request_id, data=sse.decode())),
    ChunkFault.BOTH: lambda p, j, sse: encode(
        j.box.seal_chunk(j.request_id, sse).model_copy(update={"data": sse.decode()})
    ),
    ChunkFault.WRONG_KEY: lambda p, j, sse: encode(
        InferenceResponseChunk(
            request_id=j.request_id,
            encrypted_data=j.box.seal(sse).model_copy(
                update={"ephemeral_public_key": ProviderIdentity.generate().public_key_b64}
            ),
        )
    ),
    ChunkFault.UNDECRYPTABLE: _tamper,
}


@pytest.mark.parametrize("fault", list(CHUNK_FAULTS), ids=lambda f: f.value)
async def test_unverifiable_chunk_marks_provider_untrusted_and_fails_502(
    coordinator_double: CoordinatorDouble,
    openai_consumer: openai.AsyncOpenAI,
    providers: list[FakeProvider],
    fault: ChunkFault,
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(**chat()))
    job = await provider.next_job()
    sse = event(ChunkFactory(id="c", created=1, model=MODEL).content("secret"))
    await provider.send(CHUNK_FAULTS[fault](provider, job, sse))
    with pytest.raises(openai.APIStatusError) as caught:
        await asyncio.wait_for(consumer, 5)
    assert caught.value.status_code == 502
    assert [(r.fault, r.request_id) for r in double.events.of(ChunkRejected)] == [(fault, job.request_id)]
    assert len(double.events.of(MarkedUntrusted)) == 1
    view = double.provider(0)
    assert view.untrusted and Unroutable.UNTRUSTED in view.unroutable


async def test_mid_stream_error_is_surfaced_not_rerouted(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    first = await routable_provider(double, providers)
    await routable_provider(double, providers)

    async def consume() -> list[str]:
        got: list[str] = []
        stream = await openai_consumer.chat.completions.create(stream=True, **chat())
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content or "")
        return got

    consumer = asyncio.create_task(consume())
    job = await first.next_job()
    await first.event(job, data_line(ChunkFactory(id="c", created=1, model=MODEL).content("par")))
    await double.wait_for(lambda e: isinstance(e, Committed), timeout=5)
    await first.reject(job, 500)
    with pytest.raises(openai.APIError):
        await asyncio.wait_for(consumer, 5)
    assert len(double.events.of(Dispatched)) == 1


async def test_consumer_disconnect_mid_stream_sends_cancel(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)

    async def serve_one_chunk() -> Job:
        job = await provider.next_job()
        await provider.event(job, data_line(ChunkFactory(id="c", created=1, model=MODEL).content("a")))
        return job

    serving = asyncio.create_task(serve_one_chunk())
    async with httpx.AsyncClient(base_url=double.http_url) as client:
        async with client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: ")
            # leave mid-stream
    job = await serving
    sent = await double.wait_for(lambda e: isinstance(e, CancelSent) and e.request_id == job.request_id, timeout=5)
    assert sent.cause is CancelCause.CONSUMER_GONE
    await provider.received(lambda: job.request_id in provider.cancels)
    assert double.provider(0).in_flight == 0


async def test_concurrency_cap_queues_extra_requests(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(quick_config(queue_timeout=5.0)) as double:
        provider = await routable_provider(double, providers)
        capacity = BackendCapacity(
            slots=(), gpu_memory_active_gb=0.0, gpu_memory_peak_gb=0.0, gpu_memory_cache_gb=0.0, total_memory_gb=16.0
        )
        await provider.heartbeat(backend_capacity=capacity)
        await double.wait_until(lambda: double.provider(0).max_concurrency == 2, timeout=5)
        async with consumer_for(double) as client:
            consumers = [asyncio.create_task(client.chat.completions.create(**chat())) for _ in range(3)]
            jobs = [await provider.next_job(), await provider.next_job()]
            with pytest.raises(TimeoutError):
                await provider.next_job(timeout=0.3)  # the third waits in the model's queue
            await provider.stream(jobs[0], ["a"])
            jobs.append(await provider.next_job())
            for job in jobs[1:]:
                await provider.stream(job, ["b"])
            results = await asyncio.wait_for(asyncio.gather(*consumers), 5)
        assert sorted(r.choices[0].message.content for r in results) == ["a", "b", "b"]


# --- liveness ---------------------------------------------------------------------------------------------------


async def test_eviction_after_heartbeat_silence_fails_pending_and_keeps_socket(providers: list[FakeProvider]) -> None:
    config = quick_config(eviction_timeout=0.6, eviction_sweep_interval=0.1, queue_timeout=0.5)
    async with CoordinatorDouble(config) as double:
        silent = await routable_provider(double, providers)
        alive = await routable_provider(double, providers)
        beating = asyncio.Event()
        # Both beat until the silent one has the job (the first routable by order): on a busy machine the
        # request's routing could otherwise outlast the silent one's 0.6 s; then only `alive` beats.
        beaters = [silent, alive]

        async def keep_alive() -> None:
            while True:
                for provider in list(beaters):
                    await provider.heartbeat()
                beating.set()
                await asyncio.sleep(0.1)  # the heartbeat interval, a real period

        beats = asyncio.create_task(keep_alive())
        try:
            await beating.wait()
            async with consumer_for(double) as client:
                consumer = asyncio.create_task(client.chat.completions.create(**chat()))
                job = await silent.next_job()
                beaters.remove(silent)
                await silent.accept(job)
                evicted = await double.wait_for(lambda e: isinstance(e, Evicted), timeout=5)
                assert evicted.provider_id == double.providers[0].provider_id
                # [A]: the uncommitted request fails with 502 "provider disconnected" and is rerouted
                rerouted = await alive.next_job()
                await alive.stream(rerouted, ["saved"])
                completion = await asyncio.wait_for(consumer, 5)
            assert completion.choices[0].message.content == "saved"
            rejected = double.events.of(Rejected)
            assert [(r.request_id, r.status_code, r.internal) for r in rejected] == [(job.request_id, 502, True)]
            view = double.providers[0]
            assert view.evicted and not view.routable and view.connected
            assert not double.providers[1].evicted
            await silent.heartbeat()  # too late: ignored, as [A] "heartbeat from unknown provider"
            dropped = await double.wait_for(lambda e: isinstance(e, Dropped), timeout=5)
            assert dropped.reason is DropReason.EVICTED
            assert silent.ws is not None and silent.ws.close_code is None  # the socket was not closed
        finally:
            beats.cancel()


# --- Go-strict frame validation and injection -----------------------------------------------------------------


async def test_invalid_frames_are_dropped_and_recorded(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(**chat()))
    job = await provider.next_job()
    mark = double.mark()
    # Go: "cannot unmarshal number 503.0 into ... status_code of type int" -> the frame is skipped
    await provider.send(f'{{"type":"inference_error","request_id":"{job.request_id}","error":"x","status_code":503.0}}')
    await provider.send('{"type":"code_attestation_response","nonce":"n","signature":"s"}')  # [N] only
    await provider.send('{"type":"from_the_future"}')
    await provider.send("not json")
    await provider.send("[1,2]")
    await double.wait_until(lambda: len(double.events.of(InvalidFrame, mark)) == 5, timeout=5)
    kinds = [e.kind for e in double.events.of(InvalidFrame, mark)]
    assert kinds == [
        InvalidKind.SCHEMA,
        InvalidKind.UNKNOWN_TYPE,
        InvalidKind.UNKNOWN_TYPE,
        InvalidKind.NOT_JSON,
        InvalidKind.NOT_AN_OBJECT,
    ]
    assert "status_code" in double.events.of(InvalidFrame, mark)[0].detail
    # the dropped error did not end the request: it is still served
    await provider.stream(job, ["fine"])
    assert (await asyncio.wait_for(consumer, 5)).choices[0].message.content == "fine"


async def test_float_in_register_means_never_registered(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = FakeProvider(double.ws_url)
    providers.append(provider)
    frame = json.loads(encode(provider.register_frame()))
    frame["hardware"]["memory_gb"] = 64.0
    assert provider.ws is None
    provider.ws = await connect(double.ws_url)
    await provider.send(json.dumps(frame))
    await provider.heartbeat()
    dropped = await double.wait_for(lambda e: isinstance(e, Dropped), timeout=5)
    assert dropped.reason is DropReason.NOT_REGISTERED
    assert double.events.of(InvalidFrame)[0].kind is InvalidKind.SCHEMA
    assert not double.provider(0).registered


async def test_frames_after_terminal_and_sse_violations_are_recorded(
    coordinator_double: CoordinatorDouble, openai_consumer: openai.AsyncOpenAI, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    consumer = asyncio.create_task(openai_consumer.chat.completions.create(**chat()))
    job = await provider.next_job()
    factory = ChunkFactory(id="c", created=1, model=MODEL)
    await provider.event(job, event(factory.content("one")) + event(factory.content("two")))
    await provider.complete(job, 1, 2)
    await provider.event(job, data_line(factory.content("late")))
    await provider.send(encode(InferenceAccepted(request_id="never-dispatched")))
    after = await double.wait_for(lambda e: isinstance(e, AfterTerminal), timeout=5)
    assert (after.request_id, after.frame_type) == (job.request_id, "inference_response_chunk")
    unknown = await double.wait_for(lambda e: isinstance(e, Dropped), timeout=5)
    assert unknown.reason is DropReason.UNKNOWN_REQUEST
    violations = double.events.of(ProtocolViolation)
    assert [v.kind for v in violations] == [Violation.SSE_MULTIPLE_EVENTS]
    await asyncio.wait_for(consumer, 5)


async def test_a_streaming_consumer_gets_each_chunk_plus_a_blank_line_then_the_doubles_done(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    """[A] writes ``chunk + "\\n\\n"`` per chunk and its own ``data: [DONE]\\n\\n`` after inference_complete:
    a provider sending one ``data:`` line per chunk gives the consumer exactly OpenAI's stream; one that adds
    its own blank line or ``[DONE]`` gives the consumer them twice (recorded as violations)."""
    double = coordinator_double
    provider = await routable_provider(double, providers)
    factory = ChunkFactory(id="c", created=1, model=MODEL)

    async def consume() -> bytes:
        async with httpx.AsyncClient(base_url=double.http_url, timeout=5) as http:
            async with http.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as response:
                return b"".join([part async for part in response.aiter_raw()])

    consumer = asyncio.create_task(consume())
    job = await provider.next_job()
    await provider.event(job, data_line(factory.role()))
    await provider.event(job, data_line(factory.content("hi")))
    await provider.complete(job, 1, 1)
    assert await asyncio.wait_for(consumer, 5) == event(factory.role()) + event(factory.content("hi")) + DONE
    assert double.anomalies() == []

    consumer = asyncio.create_task(consume())
    job = await provider.next_job()
    await provider.event(job, event(factory.content("hi")))  # with its own blank line
    await provider.event(job, DONE)  # and its own [DONE]
    await provider.complete(job, 1, 1)
    assert await asyncio.wait_for(consumer, 5) == event(factory.content("hi")) + b"\n\n" + DONE + b"\n\n" + DONE
    assert [v.kind for v in double.events.of(ProtocolViolation)] == [Violation.SSE_TRAILING_NEWLINE,
                                                                      Violation.SSE_DONE_CHUNK]


async def test_send_raw_injects_text_binary_and_33_mib_frames(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    big = '{"type":"x","pad":"' + "a" * (33 * 1024 * 1024) + '"}'
    await double.send_raw(0, "{not json")
    await double.send_raw(double.providers[0], b"\x00\xff")
    await double.send_raw(double.providers[0].provider_id, big)
    await provider.received(lambda: len(provider.raw_frames) >= 4, timeout=10)  # challenge + three
    assert provider.raw_frames[1:4] == ["{not json", b"\x00\xff", big]


# --- kill and restart -------------------------------------------------------------------------------------------


async def test_kill_mid_stream_then_restart_on_same_port(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(quick_config(**FAST)) as double:
        ws_url, http_url = double.ws_url, double.http_url
        provider = await routable_provider(double, providers)
        first_id = double.providers[0].provider_id
        async with consumer_for(double) as client:

            async def consume() -> None:
                stream = await client.chat.completions.create(stream=True, **chat())
                async for _ in stream:
                    pass

            consumer = asyncio.create_task(consume())
            job = await provider.next_job()
            await provider.event(job, data_line(ChunkFactory(id="c", created=1, model=MODEL).content("a")))
            await double.wait_for(lambda e: isinstance(e, Committed), timeout=5)
            await double.kill()
            with pytest.raises((openai.APIError, httpx.HTTPError)):
                await asyncio.wait_for(consumer, 5)
        assert provider._reader is not None
        await asyncio.wait_for(provider._reader, 5)
        assert provider.ws is not None and provider.ws.close_code == 1006  # no close handshake
        gone = await double.wait_for(lambda e: isinstance(e, Disconnected), timeout=5)
        assert gone.close_code is None

        mark = double.mark()
        await double.restart()
        assert (double.ws_url, double.http_url) == (ws_url, http_url)
        assert double.providers == []
        again = FakeProvider(ws_url)
        again.identity = provider.identity  # the same provider process reconnecting
        providers.append(again)
        await again.connect()
        await double.wait_for(lambda e: isinstance(e, ChallengeResult) and e.ok, since=mark, timeout=5)
        assert double.providers[0].provider_id != first_id  # a fresh provider id per socket, as [A]
        async with consumer_for(double) as client:
            consumer = asyncio.create_task(client.chat.completions.create(**chat()))
            await again.stream(await again.next_job(), ["back"])
            assert (await asyncio.wait_for(consumer, 5)).choices[0].message.content == "back"
        assert not double.errors


# --- smaller behaviours ---------------------------------------------------------------------------------------


async def test_no_provider_for_model_waits_in_queue_then_503(providers: list[FakeProvider]) -> None:
    async with CoordinatorDouble(quick_config(queue_timeout=0.2)) as double:
        await routable_provider(double, providers)
        async with consumer_for(double) as client:
            with pytest.raises(openai.APIStatusError) as caught:
                await client.chat.completions.create(**{**chat(), "model": "nobody/serves-this"})
        assert caught.value.status_code == 503
        assert caught.value.body["type"] == "model_not_available"
        assert double.events.of(Dispatched) == []


async def test_consumer_leaving_before_commit_sends_cancel(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    double = coordinator_double
    provider = await routable_provider(double, providers)
    async with httpx.AsyncClient(base_url=double.http_url) as client:
        request = asyncio.create_task(client.post("/v1/chat/completions", json=chat()))
        job = await provider.next_job()
        await provider.accept(job)
        await double.wait_for(lambda e: isinstance(e, Accepted), timeout=5)
        request.cancel()  # the consumer gives up while the provider is still loading
        await asyncio.gather(request, return_exceptions=True)
    sent = await double.wait_for(lambda e: isinstance(e, CancelSent), timeout=5)
    assert (sent.request_id, sent.cause) == (job.request_id, CancelCause.CONSUMER_GONE)
    await provider.received(lambda: job.request_id in provider.cancels)


def test_forwarded_body_is_go_marshalled_only_when_modified() -> None:
    from coordinator_double.chat_wire import forwarded_body

    raw = b'{"model": "m", "max_tokens": 5, "messages": []}'
    assert forwarded_body(json.loads(raw), raw, 8192) is raw  # untouched: the consumer's own bytes
    raw = b'{"provider_serial": "s", "model": "m", "messages": [{"role": "user", "content": "<a&b>"}]}'
    assert forwarded_body(json.loads(raw), raw, 8192) == (
        b'{"max_tokens":8192,"messages":[{"content":"\\u003ca\\u0026b\\u003e","role":"user"}],"model":"m"}'
    )


async def test_records_carry_the_loop_clock(
    coordinator_double: CoordinatorDouble, providers: list[FakeProvider]
) -> None:
    before = asyncio.get_running_loop().time()
    await routable_provider(coordinator_double, providers)
    registered = coordinator_double.events.of(Registered)[0]
    result = coordinator_double.events.of(ChallengeResult)[0]
    assert before <= registered.at <= result.at <= asyncio.get_running_loop().time()


# --- hostile mode ---------------------------------------------------------------------------------------------


def test_hostile_cases_are_seeded_and_cover_every_frame_type_and_operator() -> None:
    from coordinator_double.hostile import FRAME_OPS, KINDS, TEXT_OPS, hostile_cases

    key = ProviderIdentity.generate().public_key_b64
    first = list(hostile_cases(7, count=2000, provider_key=key))
    again = list(hostile_cases(7, count=2000, provider_key=key))
    assert [c.payload for c in first] == [c.payload for c in again]
    assert [c.payload for c in first] != [c.payload for c in hostile_cases(8, count=2000, provider_key=key)]
    assert sum(c.operators != ("none",) for c in first) == 2000
    assert {c.kind for c in first} == set(KINDS)
    assert {op for c in first for op in c.operators} >= set(FRAME_OPS) | set(TEXT_OPS) | {"none"}
    assert any(c.binary for c in first) and any(c.expect.answer_id for c in first)
    ids = [c.expect.answer_id for c in first if c.expect.answer_id is not None]
    assert len(ids) == len(set(ids))  # every readable id names one case


def test_hostile_expectations_follow_the_rules_not_the_provider() -> None:
    from coordinator_double.hostile import Expect, expect
    from protocol.to_provider import MAX_NONCE_CHARS, MAX_REQUEST_ID_CHARS

    req = '{"type":"inference_request","request_id":%s,"encrypted_body":"sealed"}'
    assert expect(req % '"r1"') == Expect(answer_id="r1")  # readable although it does not decode
    assert expect((req % '"r2"').encode()) == Expect(answer_id="r2")  # a binary frame is read too
    assert expect(b'{"type":"inference_request","request_id":"r3"\xff}') == Expect()  # not UTF-8
    assert expect('{"type":"inference_request","request_id":"a","request_id":"b"}') == Expect(answer_id="b")
    assert expect('{"type":"cancel","request_id":"c","type":"inference_request"}') == Expect(answer_id="c")
    assert expect(req % '"\\udc80"') == Expect()  # a lone surrogate cannot be echoed
    assert expect(req % json.dumps("x" * (MAX_REQUEST_ID_CHARS + 1))) == Expect()
    assert expect(req % json.dumps("x" * MAX_REQUEST_ID_CHARS)).answer_id == "x" * MAX_REQUEST_ID_CHARS
    assert expect(req % '""') == Expect() and expect(req % "7") == Expect()
    assert expect('{"type":"cancel","request_id":"r4"}') == Expect()
    assert expect('{"type":"attestation_challenge","nonce":"n1"}', mutated=False) == \
        Expect(nonce="n1", nonce_echoable=True, must_answer=True)
    assert not expect(json.dumps({"type": "attestation_challenge", "nonce": "n" * (MAX_NONCE_CHARS + 1)})
                      ).nonce_echoable
    assert not expect('{"type":"attestation_challenge","nonce":"n2","timestamp":5}').nonce_echoable
