"""What `doctor` can find wrong: a closed vocabulary (`ProblemCode`), each code's severity and its
fixed explanation, and `Problem` (a code, the subject it is about, the figures behind it). An ERROR
makes `doctor` exit 1; a WARNING is printed and keeps exit 0 (the package docstring lists them)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from memory import EnvAction, EnvAdjustment
from provider.models.searched import PULL_HINT, README_MODELS_HEADING


class Severity(StrEnum):
    ERROR = "error"
    WARNING = "warning"


class ProblemCode(StrEnum):
    NO_MODELS = "no_models"
    ENABLED_MODEL_MISSING = "enabled_model_missing"
    MODEL_NEVER_FITS = "model_never_fits"
    MODEL_BROKEN = "model_broken"
    NO_ROOM = "reserve_leaves_no_room"
    COORDINATOR_UNREACHABLE = "coordinator_unreachable"
    MEMORY_FATAL = "memory_fatal"
    MODEL_SKIPPED = "model_skipped"
    UNRECOGNISED_ENV = "unrecognised_env"
    RUNTIME_HASH_UNAVAILABLE = "runtime_hash_unavailable"
    SETTING_REJECTED = "setting_rejected"
    SETTING_CLAMPED = "setting_clamped"
    SSD_TIER_UNAVAILABLE = "ssd_tier_unavailable"
    DEV_POSTURE_REFUSED = "dev_posture_refused"
    COORDINATOR_UNTRUSTED = "coordinator_untrusted"
    MEMORY_GATE_BLOCKS = "memory_gate_blocks"
    NOT_IN_CATALOG = "not_in_catalog"
    RESTART_ADVISED = "restart_advised"
    RESTART_NEEDED = "restart_needed"
    SIGNAL_UNAVAILABLE = "signal_unavailable"
    SERVICE_STAYED_DOWN = "service_stayed_down"
    ABNORMAL_EXITS = "abnormal_exits"
    CRASH_LOOP_GUARD_OFF = "crash_loop_guard_off"


_SEVERITY: dict[ProblemCode, Severity] = {
    ProblemCode.NO_MODELS: Severity.ERROR,
    ProblemCode.ENABLED_MODEL_MISSING: Severity.ERROR,
    ProblemCode.MODEL_NEVER_FITS: Severity.ERROR,
    ProblemCode.MODEL_BROKEN: Severity.ERROR,
    ProblemCode.NO_ROOM: Severity.ERROR,
    ProblemCode.COORDINATOR_UNREACHABLE: Severity.ERROR,
    ProblemCode.MEMORY_FATAL: Severity.ERROR,
    ProblemCode.MODEL_SKIPPED: Severity.WARNING,
    ProblemCode.UNRECOGNISED_ENV: Severity.WARNING,
    ProblemCode.RUNTIME_HASH_UNAVAILABLE: Severity.WARNING,
    ProblemCode.SETTING_REJECTED: Severity.WARNING,
    ProblemCode.SETTING_CLAMPED: Severity.WARNING,
    ProblemCode.SSD_TIER_UNAVAILABLE: Severity.WARNING,
    ProblemCode.DEV_POSTURE_REFUSED: Severity.ERROR,
    ProblemCode.COORDINATOR_UNTRUSTED: Severity.WARNING,
    ProblemCode.MEMORY_GATE_BLOCKS: Severity.WARNING,
    ProblemCode.NOT_IN_CATALOG: Severity.WARNING,
    ProblemCode.RESTART_ADVISED: Severity.WARNING,
    ProblemCode.RESTART_NEEDED: Severity.ERROR,
    ProblemCode.SIGNAL_UNAVAILABLE: Severity.WARNING,
    ProblemCode.SERVICE_STAYED_DOWN: Severity.ERROR,
    ProblemCode.ABNORMAL_EXITS: Severity.WARNING,
    ProblemCode.CRASH_LOOP_GUARD_OFF: Severity.WARNING,
}

_EXPLAIN: dict[ProblemCode, str] = {
    ProblemCode.NO_MODELS: f"no servable model found: {PULL_HINT} downloads one (see '{README_MODELS_HEADING}' "
                           "in the README)",
    ProblemCode.ENABLED_MODEL_MISSING: "listed in enabled_models but found nowhere",
    ProblemCode.MODEL_NEVER_FITS: "needs more than the effective cap even on an idle machine",
    ProblemCode.MODEL_BROKEN: "the running agent failed to load it and will not load it again until its folder "
                              "changes or a backoff passes (meanwhile it is not offered)",
    ProblemCode.NO_ROOM: "these settings leave no room for any model under the cap (see deploy/README.md)",
    ProblemCode.COORDINATOR_UNREACHABLE: "WebSocket handshake with the coordinator did not complete",
    ProblemCode.MEMORY_FATAL: "memory pressure is at the FATAL watermark",
    ProblemCode.MODEL_SKIPPED: "model folder skipped",
    ProblemCode.UNRECOGNISED_ENV: "environment variable is not read by anything (typo?)",
    ProblemCode.RUNTIME_HASH_UNAVAILABLE: "runtime hash could not be computed",
    ProblemCode.SETTING_REJECTED: "value not usable, the default was used",
    ProblemCode.SETTING_CLAMPED: "value out of range, clamped",
    ProblemCode.SSD_TIER_UNAVAILABLE: "state directory not writable: the agent starts without the SSD tier",
    ProblemCode.DEV_POSTURE_REFUSED: "dev_posture is only allowed with a coordinator on a loopback address: "
                                     "the agent refuses to start",
    ProblemCode.COORDINATOR_UNTRUSTED: "a coordinator will treat this machine as untrusted",
    ProblemCode.MEMORY_GATE_BLOCKS: "the coordinator's free-memory gate refuses requests for this model",
    ProblemCode.NOT_IN_CATALOG: "not in the coordinator's catalog: dropped at register",
    ProblemCode.RESTART_ADVISED: "the running agent advises a restart (memory does not come back after unloads)",
    ProblemCode.RESTART_NEEDED: "the running agent needs a restart: memory that did not come back costs a model",
    ProblemCode.SIGNAL_UNAVAILABLE: "this pause rule cannot read its signal here: the agent serves as if it said go",
    ProblemCode.SERVICE_STAYED_DOWN: "the agent ended abnormally too often (crashes, kills or memory "
                                     "self-restarts): the launchd service stays down (find the cause in "
                                     "provider.log, then `service install`)",
    ProblemCode.ABNORMAL_EXITS: "the agent ended abnormally recently (a crash, a kill or a memory self-restart)",
    ProblemCode.CRASH_LOOP_GUARD_OFF: "the agent cannot count its abnormal exits in the state directory (a full "
                                      "disk?): it serves, but a crash loop would not be stopped",
}


@dataclass(frozen=True, slots=True)
class Problem:
    code: ProblemCode
    subject: str = ""  # a model id, variable name or URL origin; never user text
    detail: str = ""  # figures and setting values behind it (operator input, never user text)

    @property
    def severity(self) -> Severity:
        return _SEVERITY[self.code]

    @property
    def explanation(self) -> str:
        return _EXPLAIN[self.code]


def adjustment_problem(adjustment: EnvAdjustment) -> Problem:
    """A rejected or clamped memory-policy variable, with what was given and what was used."""
    given = f"{adjustment.given:g}" if isinstance(adjustment.given, float) else repr(adjustment.given)
    used = "no limit" if adjustment.used is None else f"{adjustment.used:g}"
    code = ProblemCode.SETTING_CLAMPED if adjustment.action is EnvAction.CLAMPED else ProblemCode.SETTING_REJECTED
    default = " (the default)" if adjustment.action is EnvAction.REJECTED else ""
    return Problem(code, adjustment.variable, f"given {given} ({adjustment.rule}); used {used}{default}")
