"""`darkbloom-provider doctor`: what this machine would advertise, and whether anything is wrong.

The package: `report.py` gathers (`run_doctor` -> `DoctorReport`), `problems.py` holds the closed
vocabulary of what can be wrong (`ProblemCode`, `Problem`), `render.py` prints (`render_table`, the
stable `report_json`), `routing.py` and `guest.py` are the routing and owner's-Mac sections.
`python -m provider.doctor [flags]` is `darkbloom-provider doctor [flags]`.

Every number comes from `memory/` -- the same functions the agent enforces -- so the doctor cannot
disagree with the load gate:

* cap figures: `memory.figures(P)` where `P` is the probe's physical size (machine RAM lowered to a
  cgroup limit and to `memory_limit_gb`), with the operator's `memory_reserve_gb`, as the agent has them
  with nothing loaded (`for_models(())`: no activation reserve in force unless the operator set one);
* pressure: `memory.pressure(snapshot)` of *this* process (it has loaded nothing, so MLX usage is 0 and
  what counts is its own memory outside MLX, standing for the agent's; the running agent's own pressure
  is in `darkbloom-provider status`);
* the running agent (its loopback `/status`, when one answers): the restart recommendation and the
  coordinator's last `trust_status` (trust level, status, reason; `agent.trust` in `--json`);
* per model: `memory.fit(figures, snapshot, weight_bytes, evictable_bytes=0)` with the model's own
  activation reserve (what its last load measured, kept in the state dir, else its config's estimate:
  provider/models/activation.py) -- nothing is loaded in the doctor's process, so nothing is evictable
  and `fits_now` / `too_large` are the only answers.

Problems (`Problem`) come in two severities. An ERROR makes `doctor` exit 1:

* ``no_models``             nothing servable was discovered;
* ``enabled_model_missing`` an id in `enabled_models` was found nowhere;
* ``reserve_leaves_no_room`` the reserves leave no room for any model on this machine (subject: the
                            settings that take it, e.g. ``memory_reserve_gb``); replaces the
                            ``model_never_fits`` it would otherwise cause for every model;
* ``model_never_fits``      a model needs more than the effective cap even on an idle machine;
* ``coordinator_unreachable`` the WebSocket handshake to `coordinator_url` did not complete
  (skipped with `--no-coordinator`);
* ``memory_fatal``          projected utilization is at the FATAL watermark.

* ``dev_posture_refused``   `dev_posture` with a coordinator that is not on loopback: the agent refuses
  to start (dev_posture is for a self-hosted coordinator on this machine only).
* ``service_stayed_down``   the last start found `crash_loop_limit` abnormal exits within
  `crash_loop_window_mins` (the agent's own count in the state directory, `provider/supervision.py`)
  and the launchd service stayed down for them: it starts again at the next login or boot (once the
  window has passed) or with `service install`.

WARNINGs are printed but keep exit 0: ``model_skipped`` (a broken or partial model folder, or one
whose chat template passes its time or memory bound on the agent's start-up check, which `doctor`
and `models` repeat: ``chat_template_timeout``, ``chat_template_memory``),
``unrecognised_env`` (a `DARKBLOOM_*` variable nothing reads), ``runtime_hash_unavailable``,
``setting_rejected`` / ``setting_clamped`` (a memory-policy variable that was not usable as given:
the detail says what was given and what was used instead), ``ssd_tier_unavailable`` (the state
directory cannot hold the KV SSD tier -- read-only, someone else's, a file in the way: the agent
starts without it; subject: the OS error's name). That check creates `state_dir/kvcache` (0700) as
the agent would, and writes and removes one probe file there. From the routing section
(`routing.py`): ``coordinator_untrusted`` (a coordinator will route nothing here:
the posture or privacy capabilities it requires are reported false -- always so on Linux without
`dev_posture`; subject: the fields), ``memory_gate_blocks`` (the coordinator's free-memory gate
refuses requests for a model, cold or always; subject: the model; detail: the fix, e.g. preload it),
``not_in_catalog`` (the coordinator's catalog does not list the model: it is dropped at register).
From the owner's-Mac section (`guest.py`: the serving windows, whether one is open and
the next change, every signal's reading): ``signal_unavailable`` (a pause rule is on but its signal
cannot be read here; subject: the setting, detail: the reader's source). From the service's own
count: ``abnormal_exits`` (the agent ended abnormally — a crash, a kill, a memory self-restart, an
error exit — within `crash_loop_window_mins`, fewer times than it takes to stay down; the detail
counts each kind), ``crash_loop_guard_off`` (the state directory cannot take that count, e.g. a full
disk: the agent serves without the guard; subject: the OS error's name; one probe written and removed).
An invalid configuration never reaches this module: the CLI exits 78 with one line first.

`report_json()` is a stable interface (keys are only ever added): ``cap`` holds every
`CapFigures` field (bytes) plus ``*_gib`` conveniences, ``pressure`` {level, utilization},
``runtime_hash``, ``models`` [{id, path, source, weight_bytes, quantization, context_length,
kv_bytes_per_token, activation_reserve {bytes, source, window_tokens, measured_peak_bytes,
measured_peak_tokens}, verdict, required_bytes, ever_fits, capabilities {tools}}] (``tools``: the model
calls tools, as `/v1/models` says; null when its tokenizer could not be read), ``skipped`` [{id, path, reason}],
``searched`` [{source: alias | model_dir | hf_cache, id (an alias's), path, exists}] (where discovery
looked; ``no_models`` names them too),
``coordinator`` {url, checked, reachable, detail}, ``machine`` {...}, ``problems`` [{code, severity,
subject, detail}], ``settings_adjusted`` [{variable, given, used, action, rule}], ``ok``, ``crash_loop``
{abnormal_exits [{at, kind: crash | memory_restart | error_exit}], stayed_down_at}, and
``routing`` (`routing.routing_json`: ``coordinator_sees`` {backend, runtime_hash, dev_posture,
posture, privacy_capabilities, total_memory_gb, hardening_probed}, ``trusted``,
``untrusted_reasons`` [{code, subject}], ``trust_level`` {level (none | self_signed: what the coordinator
assigns at register), attestation_sent, routes_at_min_trust [levels], reasons [{code, detail}] (why no
attestation), detail, attestation {the blob's security values; null = unknown}}, ``coordinator_must`` [text], ``catalog`` {url, checked,
reachable, detail, models}, ``models`` [{id, verdict, fix, preloaded, size_source, size_bytes,
kv_estimate_bytes, total_bytes, cold {required_bytes, free_bytes, passes}, warm {...}}]; null for
`models`, which does not gather it), ``guest`` (`guest.guest_json`: windows, timezone,
window_open, next_window_change (unix) and _local, state, reason, retry_after_s, signals {idle_s,
idle_source, on_battery, power_source, thermal}, rules; null for `models`).
"""

from provider.doctor.problems import Problem, ProblemCode, Severity, adjustment_problem
from provider.doctor.render import quantization_text, render_table, report_json
from provider.doctor.report import (
    DEFAULT_COORDINATOR_TIMEOUT_S,
    CoordinatorCheck,
    DoctorReport,
    ModelReport,
    Reach,
    cap_figures,
    check_coordinator,
    machine_snapshot,
    run_doctor,
    running_agent_diagnostics,
    running_agent_status,
    runtime_hash_of,
)

__all__ = ["DEFAULT_COORDINATOR_TIMEOUT_S", "CoordinatorCheck", "DoctorReport", "ModelReport", "Problem", "ProblemCode",
           "Reach", "Severity", "adjustment_problem", "cap_figures", "check_coordinator", "machine_snapshot",
           "quantization_text", "render_table", "report_json", "run_doctor", "running_agent_diagnostics",
           "running_agent_status", "runtime_hash_of"]
