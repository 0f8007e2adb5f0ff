"""provider/jobs: one ``inference_request`` end to end.

* ``run_job(request, ctx, send)`` / ``Job`` — open → admit → accept → stream → complete | error (job.py)
* ``JobLifecycle``, ``JobState``, ``JobEvent``, ``TRANSITIONS`` — the transition table (lifecycle.py)
* ``PromptCounter`` — re-exported from ``provider.request`` (the prompt counter both front doors use)
* ``ServingStats`` — cumulative counters shared with the heartbeat (stats.py)
"""

from provider.jobs.job import (
    CHAT_ENDPOINT,
    Job,
    JobContext,
    JobOutcome,
    ModelManager,
    Slot,
    engine_failure,
    exception_failure,
    run_job,
)
from provider.jobs.lifecycle import TRANSITIONS, JobEvent, JobLifecycle, JobState, JobStateError
from provider.jobs.stats import ServingStats
from provider.request.tokens import PromptCounter, PromptError, UnknownModel

__all__ = [
    "CHAT_ENDPOINT",
    "TRANSITIONS",
    "Job",
    "JobContext",
    "JobEvent",
    "JobLifecycle",
    "JobOutcome",
    "JobState",
    "JobStateError",
    "ModelManager",
    "PromptCounter",
    "PromptError",
    "ServingStats",
    "Slot",
    "UnknownModel",
    "engine_failure",
    "exception_failure",
    "run_job",
]
