"""The job lifecycle transition table: exactly one terminal frame, nothing after it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from provider.jobs import TRANSITIONS, JobEvent, JobLifecycle, JobState, JobStateError

TERMINAL_EVENTS = {JobEvent.COMPLETE, JobEvent.FAIL}


def test_the_happy_path():
    job = JobLifecycle()
    for event, state in [(JobEvent.ADMIT, JobState.ADMITTED), (JobEvent.ACCEPT, JobState.ACCEPTED),
                         (JobEvent.CHUNK, JobState.STREAMING), (JobEvent.CHUNK, JobState.STREAMING),
                         (JobEvent.COMPLETE, JobState.COMPLETED)]:
        assert job.step(event) is state
    assert job.terminal


def test_fast_reject_is_a_fail_from_open():
    job = JobLifecycle()
    assert job.step(JobEvent.FAIL) is JobState.FAILED


@pytest.mark.parametrize("terminal", [JobState.COMPLETED, JobState.FAILED, JobState.CANCELLED])
def test_terminal_states_allow_nothing(terminal):
    assert TRANSITIONS[terminal] == {}


def test_a_second_terminal_frame_raises():
    job = JobLifecycle()
    job.step(JobEvent.FAIL)
    with pytest.raises(JobStateError, match="FAILED"):
        job.step(JobEvent.FAIL)
    with pytest.raises(JobStateError):
        job.step(JobEvent.COMPLETE)


def test_no_frame_after_cancel():
    job = JobLifecycle()
    for event in (JobEvent.ADMIT, JobEvent.ACCEPT, JobEvent.CHUNK, JobEvent.CANCEL):
        job.step(event)
    for event in JobEvent:
        with pytest.raises(JobStateError):
            job.step(event)


def test_complete_needs_a_chunk_and_accept_needs_admission():
    with pytest.raises(JobStateError):
        JobLifecycle().step(JobEvent.ACCEPT)
    job = JobLifecycle()
    job.step(JobEvent.ADMIT)
    job.step(JobEvent.ACCEPT)
    with pytest.raises(JobStateError):
        job.step(JobEvent.COMPLETE)


@settings(max_examples=300)
@given(st.lists(st.sampled_from(list(JobEvent)), max_size=12))
def test_any_sequence_sends_at_most_one_terminal_frame(events):
    job = JobLifecycle()
    accepted = terminal_frames = 0
    chunks_after_terminal = 0
    for event in events:
        try:
            job.step(event)
        except JobStateError:
            continue
        if event in TERMINAL_EVENTS:
            terminal_frames += 1
        if event is JobEvent.ACCEPT:
            accepted += 1
        if event is JobEvent.CHUNK and terminal_frames:
            chunks_after_terminal += 1
    assert terminal_frames <= 1 and accepted <= 1 and chunks_after_terminal == 0
