"""SessionCore (sans-I/O) and the pure reconnect policy."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol import (
    AttestationChallenge,
    AttestationResponse,
    CpuCores,
    Hardware,
    InferenceError,
    Register,
    decode,
    encode,
)
from protocol.to_provider import MAX_NONCE_CHARS, MAX_REQUEST_ID_CHARS
from provider.config import LogLevel
from provider.session.backoff import (
    INITIAL_DELAY_S,
    JITTER,
    MAX_DELAY_S,
    backoff_delays,
    clock_jumped,
    is_retryable,
    should_reset_backoff,
)
from provider.session.core import (
    CancelJob,
    InvalidState,
    Log,
    ModelDirective,
    Note,
    RecentRequestIds,
    Send,
    SessionCore,
    SessionState,
    StartJob,
)
from provider.session.status import BarrierAcked, ChallengeSeen, RuntimeVerdict, TrustReport

KEY = "tHFZkLURE4Ne6qGImKWQ5P0vHEfBq17lkLkV/Wm2rSU="
SESSION_KEY = "X6IvWt6JfUs/rZfjNb0jxCJZa33vVeIwJZnkd3fyskg="
HW = Hardware(machine_model="m", chip_name="c", chip_family="Unknown", chip_tier="Unknown", memory_gb=16,
              memory_available_gb=8.0, cpu_cores=CpuCores(total=2, performance=2, efficiency=0), gpu_cores=0,
              memory_bandwidth_gbs=0.0)
REGISTER = Register(hardware=HW, models=(), backend="inprocess-mlx", public_key=KEY, encrypted_response_chunks=True)


def answer(challenge: AttestationChallenge) -> AttestationResponse:
    return AttestationResponse(nonce=challenge.nonce, signature="c2ln", public_key=KEY, sip_enabled=False)


def open_core() -> SessionCore:
    core = SessionCore(register=REGISTER, answer_challenge=answer)
    assert core.connection_made() == [Send(REGISTER)]
    return core


def request_frame(rid: str) -> str:
    return json.dumps({"type": "inference_request", "request_id": rid,
                       "encrypted_body": {"ephemeral_public_key": SESSION_KEY, "ciphertext": "AAAA"}})


def sends(actions) -> list:
    return [a.frame for a in actions if isinstance(a, Send)]


# --- register and states -------------------------------------------------------------------------------


def test_register_is_sent_exactly_once_per_core():
    core = SessionCore(register=REGISTER, answer_challenge=answer)
    assert core.state is SessionState.CONNECTING
    with pytest.raises(InvalidState):
        core.receive_text(request_frame("r1"))  # nothing may be received before register went out
    assert core.connection_made() == [Send(REGISTER)]
    assert core.state is SessionState.REGISTERED
    with pytest.raises(InvalidState):
        core.connection_made()


def test_closed_core_refuses_frames():
    core = open_core()
    core.connection_lost()
    assert core.state is SessionState.CLOSED
    with pytest.raises(InvalidState):
        core.receive_text(request_frame("r1"))
    assert core.connection_lost() == []


# --- requests and cancels ------------------------------------------------------------------------------


def test_request_starts_a_job_and_cancel_cancels_it_once():
    core = open_core()
    (start,) = core.receive_text(request_frame("r1"))
    assert isinstance(start, StartJob) and start.request.request_id == "r1"
    assert core.active_jobs == {"r1"}
    actions = core.receive_text('{"type":"cancel","request_id":"r1"}')
    assert CancelJob("r1") in actions and not sends(actions)  # nothing is sent for a cancelled job
    assert core.active_jobs == frozenset()
    again = core.receive_text('{"type":"cancel","request_id":"r1"}')
    assert not any(isinstance(a, CancelJob | Send) for a in again)


def test_cancel_for_unknown_or_finished_ids_is_ignored():
    core = open_core()
    core.receive_text(request_frame("r1"))
    core.job_finished("r1")
    for rid in ("r1", "never-seen", ""):
        actions = core.receive_text(json.dumps({"type": "cancel", "request_id": rid}))
        assert all(isinstance(a, Log) for a in actions)


def test_duplicate_request_id_is_not_answered():
    core = open_core()
    core.receive_text(request_frame("r1"))
    actions = core.receive_text(request_frame("r1"))
    assert all(isinstance(a, Log) for a in actions) and core.active_jobs == {"r1"}


def test_draining_refuses_new_requests_with_503_draining():
    core = open_core()
    core.receive_text(request_frame("running"))
    core.start_draining()
    assert core.state is SessionState.DRAINING
    (frame,) = sends(core.receive_text(request_frame("late")))
    wire = json.loads(encode(frame))
    assert wire["type"] == "inference_error" and wire["request_id"] == "late"
    assert wire["status_code"] == 503 and wire["error_reason"] == "draining" and wire["failure_code"] == "capacity"
    assert core.active_jobs == {"running"}  # running work goes on
    assert CancelJob("running") in core.receive_text('{"type":"cancel","request_id":"running"}')


def test_connection_lost_cancels_every_running_job():
    core = open_core()
    for rid in ("a", "b", "c"):
        core.receive_text(request_frame(rid))
    core.job_finished("b")
    assert core.connection_lost() == [CancelJob("a"), CancelJob("c")]
    assert core.active_jobs == frozenset()


def test_request_without_encrypted_body_still_starts_a_job_to_answer_400():
    core = open_core()
    (start,) = core.receive_text('{"type":"inference_request","request_id":"r9"}')
    assert isinstance(start, StartJob) and start.request.encrypted_body is None


def error_frames(actions) -> list[dict]:
    return [json.loads(encode(f)) for f in sends(actions) if isinstance(f, InferenceError)]


@pytest.mark.parametrize("fields", [
    {"encrypted_body": "sealed"},
    {"encrypted_body": {"ephemeral_public_key": SESSION_KEY, "ciphertext": None}},
    {"first_content_budget_ms": "100"},
    {"first_content_budget_ms": 1500.0},
    {"tool_schema_metadata_protocol": True},
    {"cache_scope": "\ud800"},  # a lone surrogate: not valid JSON text for the strict parser
])
def test_an_undecodable_request_with_a_readable_id_gets_exactly_one_400(fields):
    """A request whose id can be read is answered, even when the frame does not decode."""
    core = open_core()
    frame = {"type": "inference_request", "request_id": "r-typed",
             "encrypted_body": {"ephemeral_public_key": SESSION_KEY, "ciphertext": "AAAA"}, **fields}
    actions = core.receive_text(json.dumps(frame))
    (error,) = error_frames(actions)
    assert (error["request_id"], error["status_code"], error["failure_code"]) == ("r-typed", 400, "invalid_request")
    assert not any(isinstance(a, StartJob) for a in actions) and core.active_jobs == frozenset()
    assert any(isinstance(a, Log) and a.event == "frame_rejected" for a in actions)


def test_an_undecodable_duplicate_of_a_running_request_is_left_to_the_running_job():
    core = open_core()
    core.receive_text(request_frame("r1"))
    actions = core.receive_text(json.dumps({"type": "inference_request", "request_id": "r1", "encrypted_body": 5}))
    assert not sends(actions) and core.active_jobs == {"r1"}


@pytest.mark.parametrize("rid", ["x" * (MAX_REQUEST_ID_CHARS + 1), "y" * (11 * 1024 * 1024)])
@pytest.mark.parametrize("decodable", [True, False])
def test_a_request_id_beyond_the_size_rule_is_refused_before_any_work(rid, decodable):
    """An id whose answer could not be encoded is refused by a size rule, unanswered."""
    core = open_core()
    frame = {"type": "inference_request", "request_id": rid,
             "encrypted_body": {"ephemeral_public_key": SESSION_KEY, "ciphertext": "AAAA" if decodable else 7}}
    actions = core.receive_text(json.dumps(frame))
    assert actions and all(isinstance(a, Log) for a in actions)
    assert all(len(str(v)) < 1024 for a in actions for v in a.fields.values())  # the id is not logged either
    assert core.active_jobs == frozenset()


def test_a_request_id_at_the_size_limit_is_served():
    core = open_core()
    (start,) = core.receive_text(request_frame("z" * MAX_REQUEST_ID_CHARS))
    assert isinstance(start, StartJob)


def test_a_replayed_request_id_gets_one_400_without_running():
    """A finished request's frame, replayed, is not run again."""
    core = open_core()
    (start,) = core.receive_text(request_frame("done-1"))
    core.job_finished("done-1")
    actions = core.receive_text(request_frame("done-1"))
    (error,) = error_frames(actions)
    assert (error["request_id"], error["status_code"], error["failure_code"]) == ("done-1", 400, "invalid_request")
    assert not any(isinstance(a, StartJob) for a in actions) and core.active_jobs == frozenset()
    # Cancelled and refused ids are finished too; a replay after the connection changed is still a replay.
    core.receive_text(request_frame("cancelled-1"))
    core.receive_text('{"type":"cancel","request_id":"cancelled-1"}')
    assert error_frames(core.receive_text(request_frame("cancelled-1")))[0]["status_code"] == 400
    core.connection_lost()
    fresh = SessionCore(register=REGISTER, answer_challenge=answer, recent=core.recent)
    fresh.connection_made()
    assert error_frames(fresh.receive_text(request_frame("done-1")))[0]["status_code"] == 400


def test_the_memory_of_finished_ids_is_bounded():
    recent = RecentRequestIds(capacity=3)
    for rid in ("a", "b", "c", "d"):
        recent.add(rid)
    assert "a" not in recent and all(rid in recent for rid in ("b", "c", "d")) and len(recent) == 3
    core = SessionCore(register=REGISTER, answer_challenge=answer, recent=recent)
    core.connection_made()
    assert isinstance(core.receive_text(request_frame("a"))[0], StartJob)  # forgotten: served again


# --- challenges, runtime status, unknown and malformed frames ----------------------------------------------


def test_challenge_is_answered_with_the_nonce():
    core = open_core()
    actions = core.receive_text('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"2026-04-30T10:41:07Z"}')
    (frame,) = sends(actions)
    assert isinstance(frame, AttestationResponse) and frame.nonce == "bm9uY2U=" and frame.public_key == KEY


@pytest.mark.parametrize("nonce", ["", "n" * (MAX_NONCE_CHARS + 1), "n" * (11 * 1024 * 1024)])
def test_an_empty_or_over_long_challenge_is_logged_and_not_answered(nonce):
    """Every echoed field is bounded; the session stays up."""
    core = open_core()
    actions = core.receive_text(json.dumps({"type": "attestation_challenge", "nonce": nonce,
                                            "timestamp": "2026-04-30T10:41:07Z"}))
    assert actions and all(isinstance(a, Log | Note) for a in actions) and not sends(actions)
    assert [a.event for a in actions if isinstance(a, Note)] in ([], [ChallengeSeen(answered=False)])
    assert core.state is SessionState.REGISTERED
    (frame,) = sends(core.receive_text('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":""}'))
    assert frame.nonce == "bm9uY2U="


def test_runtime_status_mismatches_are_logged_by_component():
    core = open_core()
    actions = core.receive_text(json.dumps({"type": "runtime_status", "verified": False, "mismatches": [
        {"component": "runtime", "expected": "good", "got": "bad"},
        {"component": "template:chatml", "expected": "x", "got": "y"}]}))
    logs = [a for a in actions if isinstance(a, Log)]
    assert [a.fields["kind"] for a in logs] == ["runtime", "template:chatml"]
    assert all(a.level is LogLevel.WARNING for a in logs)
    assert [a for a in actions if isinstance(a, Note)] == [
        Note(RuntimeVerdict(verified=False, components=("runtime", "template:chatml")))]
    assert core.state is SessionState.REGISTERED


@pytest.mark.parametrize("frame", [
    "", "not json", "[1,2]", "null", '{"no_type":1}', '{"type":5}', '{"type":"cancel","request_id":7}',
    '{"type":"inference_request","request_id":7,"encrypted_body":"oops"}', b"\xff\xfe", "{" * 5000,
])
def test_malformed_frames_are_logged_never_raised(frame):
    core = open_core()
    actions = core.receive_text(frame)
    assert actions and all(isinstance(a, Log) for a in actions)
    assert core.state is SessionState.REGISTERED


@pytest.mark.parametrize("frame", [
    '{"type":"brand_new_type","x":1}',
    '{"type":"register","hardware":{},"models":[],"backend":"x"}',
])
def test_unknown_and_unhandled_types_are_ignored(frame):
    core = open_core()
    actions = core.receive_text(frame)
    assert all(isinstance(a, Log) for a in actions) and core.active_jobs == frozenset()


@pytest.mark.parametrize("frame", [
    '{"type":"load_model","model_id":"model-a"}',
    '{"type":"prefetch_model","model_id":"org/model-b","priority":2}',
    '{"type":"desired_models","models":[{"model_name":"public-a","desired_build":"model-a"}]}',
])
@pytest.mark.parametrize("draining", [False, True])
def test_model_frames_go_to_the_model_handler_also_while_draining(frame, draining):
    core = open_core()
    if draining:
        core.start_draining()
    assert core.receive_text(frame) == [ModelDirective(decode(frame))]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300),
                 st.dictionaries(st.sampled_from(["type", "request_id", "nonce", "encrypted_body", "verified"]),
                                 st.one_of(st.none(), st.integers(), st.text(max_size=20),
                                           st.sampled_from(["inference_request", "cancel", "runtime_status",
                                                            "attestation_challenge"])), max_size=5)
                 .map(json.dumps)))
def test_any_frame_yields_actions_not_exceptions(frame):
    core = open_core()
    actions = core.receive_text(frame)
    for action in actions:
        assert isinstance(action, Send | StartJob | CancelJob | Log | Note | ModelDirective)
        if isinstance(action, Send):
            decode(encode(action.frame))  # whatever we send is a valid frame
            assert isinstance(action.frame, AttestationResponse | InferenceError)
    # A readable request id gets exactly one answer: a job (which answers) or an error frame; nothing else.
    try:
        value = json.loads(frame)
    except ValueError:  # not JSON, or bytes that are not UTF-8
        value = None
    answers = [a.request.request_id for a in actions if isinstance(a, StartJob)] + \
              [a.frame.request_id for a in actions if isinstance(a, Send) and isinstance(a.frame, InferenceError)]
    readable = (isinstance(value, dict) and value.get("type") == "inference_request"
                and isinstance(value.get("request_id"), str) and 0 < len(value["request_id"]) <= MAX_REQUEST_ID_CHARS)
    assert answers == ([value["request_id"]] if readable else [])


# --- backoff ---------------------------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_without_jitter():
    delays = backoff_delays(jitter=0.0)
    assert [next(delays) for _ in range(8)] == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


@given(st.integers(min_value=0, max_value=2**32 - 1))
def test_backoff_jitter_stays_within_bounds(seed):
    rng = random.Random(seed)
    delays = backoff_delays(rand=rng.random)
    base = INITIAL_DELAY_S
    for _ in range(12):
        delay = next(delays)
        assert base * (1 - JITTER) <= delay <= base * (1 + JITTER)
        base = min(MAX_DELAY_S, base * 2)


def test_backoff_rejects_nonsense():
    with pytest.raises(ValueError):
        next(backoff_delays(initial=0))
    with pytest.raises(ValueError):
        next(backoff_delays(initial=5, maximum=1))


def test_backoff_resets_only_after_a_stable_session():
    assert not should_reset_backoff(None)
    assert not should_reset_backoff(29.9)
    assert should_reset_backoff(30.0)
    assert should_reset_backoff(3.0, stable_after_s=2.0)


def test_clock_jump_detection():
    assert not clock_jumped(10.0, 10.0, 10.0)
    assert not clock_jumped(12.0, 10.0, 10.0)  # scheduling noise
    assert clock_jumped(3600.0, 10.0, 10.0)  # slept for an hour
    assert clock_jumped(-100.0, 10.0, 10.0)  # wall clock set back


def test_retryable_errors():
    from websockets.exceptions import InvalidStatus, InvalidURI

    assert is_retryable(OSError("refused"))
    assert is_retryable(TimeoutError())
    assert is_retryable(InvalidStatus.__new__(InvalidStatus))
    assert not is_retryable(InvalidURI("ws//bad", "no scheme"))
    import asyncio

    assert not is_retryable(asyncio.CancelledError())


# --- lifecycle: trust_status, the drain barrier ---------------------------------------------------------


def test_trust_status_is_noted_for_the_status_page_and_changes_nothing_else():
    core = open_core()
    actions = core.receive_text('{"type":"trust_status","trust_level":"self_signed","status":"online",'
                                '"reason":"SE attestation verified, awaiting MDM verification"}')
    assert not any(isinstance(a, (Send, StartJob, CancelJob)) for a in actions)
    assert [a.event for a in actions if isinstance(a, Note)] == [
        TrustReport("self_signed", "online", "SE attestation verified, awaiting MDM verification")]
    assert core.state is SessionState.REGISTERED


NEWER_FRAMES = ('{"type":"trust_status","trust_level":"none","status":"online","reason":""}',
                '{"type":"desired_models","models":[]}',
                '{"type":"load_model","model_id":"m"}',
                '{"type":"prefetch_model","model_id":"m"}',
                '{"type":"capacity_probe","quote_id":"q","model":"m","prompt_tokens_bucket":512,'
                '"max_output_tokens":16,"deadline_remaining_ms":100}')


def test_the_drain_barrier_goes_out_and_only_its_own_ack_settles_it():
    core = open_core()
    core.receive_text(NEWER_FRAMES[0])  # the coordinator speaks the newer protocol
    core.start_draining()
    (send, _) = core.drain_barrier("drain-1")
    assert core.barrier_pending
    assert isinstance(send, Send) and encode(send.frame) == '{"type":"provider_drain","request_id":"drain-1"}'
    for stale in ('{"type":"provider_drain_ack","request_id":"drain-0"}',
                  '{"type":"provider_drain_ack","request_id":""}'):
        assert all(isinstance(a, Log) for a in core.receive_text(stale))
    actions = core.receive_text('{"type":"provider_drain_ack","request_id":"drain-1"}')
    assert [a.event for a in actions if isinstance(a, Note)] == [BarrierAcked("drain-1")]
    # a second ack of the same barrier is stale: the waiter is gone
    assert all(isinstance(a, Log) for a in core.receive_text('{"type":"provider_drain_ack","request_id":"drain-1"}'))


@pytest.mark.parametrize("frame", NEWER_FRAMES)
def test_any_frame_of_the_newer_protocol_earns_the_drain_barrier(frame):
    core = open_core()
    assert not core.newer_protocol
    core.receive_text(frame)
    core.start_draining()
    assert core.newer_protocol and any(isinstance(a, Send) for a in core.drain_barrier("drain-1"))


def test_a_coordinator_that_never_spoke_the_newer_protocol_gets_no_drain_barrier():
    """The April coordinator drops provider_drain as an unknown type and never acknowledges it."""
    core = open_core()
    for frame in ('{"type":"attestation_challenge","nonce":"bm9uY2U=","timestamp":"2026-01-01T00:00:00Z"}',
                  '{"type":"runtime_status","verified":true}', '{"type":"cancel","request_id":"r"}'):
        core.receive_text(frame)  # [A]'s own frames say nothing either way
    core.start_draining()
    actions = core.drain_barrier("drain-1")
    assert not core.newer_protocol and not core.barrier_pending
    assert [a.event for a in actions if isinstance(a, Log)] == ["drain_barrier_skipped"]
    assert not any(isinstance(a, Send) for a in actions)


def test_an_unasked_drain_ack_is_ignored():
    core = open_core()
    assert all(isinstance(a, Log) for a in core.receive_text('{"type":"provider_drain_ack","request_id":"x"}'))


def test_the_drain_barrier_is_only_for_a_draining_session():
    with pytest.raises(InvalidState):
        open_core().drain_barrier("drain-1")


def test_a_capacity_probe_is_answered_at_once_by_the_quoter():
    from protocol import CapacityProbe, CapacityQuote
    from protocol.to_provider import MAX_REQUEST_ID_CHARS

    asked: list[CapacityProbe] = []

    def quoter(probe: CapacityProbe) -> CapacityQuote:
        asked.append(probe)
        return CapacityQuote(quote_id=probe.quote_id, capacity_seq=3, admissible_now=True, ttft_p50_ms=1.0,
                             ttft_p90_ms=2.0, queue_est_ms=0.0, available_token_budget=512, confidence="low")

    core = SessionCore(register=REGISTER, answer_challenge=answer, quote=quoter)
    core.connection_made()
    probe = ('{"type":"capacity_probe","quote_id":"q1","model":"tiny","prompt_tokens_bucket":512,'
             '"max_output_tokens":64,"deadline_remaining_ms":900}')
    (quote,) = sends(core.receive_text(probe))
    assert isinstance(quote, CapacityQuote) and quote.quote_id == "q1" and asked[0].prompt_tokens_bucket == 512
    oversized = probe.replace('"q1"', '"' + "q" * (MAX_REQUEST_ID_CHARS + 1) + '"')
    assert sends(core.receive_text(oversized)) == [] and len(asked) == 1  # it could not be echoed: refused
    assert sends(open_core().receive_text(probe)) == []  # no quoter: we report no capacity_seq, never probed
