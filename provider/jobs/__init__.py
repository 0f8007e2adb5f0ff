"""provider/jobs: one ``inference_request`` end to end.

* ``run_job(request, ctx, send)`` / ``Job`` — open → admit → accept → stream → complete | error (job.py)
* ``JobLifecycle``, ``JobState``, ``JobEvent``, ``TRANSITIONS`` — the transition table (lifecycle.py)
* ``PromptCounter`` — re-exported from ``provider.request`` (the prompt counter both front doors use)
* ``ServingStats`` — cumulative counters shared with the heartbeat (stats.py)
"""

import importlib

# Imported on first use (PEP 562): a command that needs one submodule (doctor, the CLI) does not
# pay for the rest, the engine and MLX among them.
_WHERE = {
    "CHAT_ENDPOINT": "provider.jobs.job",
    "Job": "provider.jobs.job",
    "JobContext": "provider.jobs.job",
    "JobEvent": "provider.jobs.lifecycle",
    "JobLifecycle": "provider.jobs.lifecycle",
    "JobOutcome": "provider.jobs.job",
    "JobState": "provider.jobs.lifecycle",
    "JobStateError": "provider.jobs.lifecycle",
    "PromptCounter": "provider.request.tokens",
    "PromptError": "provider.request.tokens",
    "ServingStats": "provider.jobs.stats",
    "TRANSITIONS": "provider.jobs.lifecycle",
    "UnknownModel": "provider.request.tokens",
    "run_job": "provider.jobs.job",
}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

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
    "PromptCounter",
    "PromptError",
    "ServingStats",
    "UnknownModel",
    "run_job",
]
