"""Settings that say what they did: every rejected or clamped memory variable is named in
the log with the value given and the value used, doctor lists it, and reserves that leave no room
are named instead of blaming every model."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

import memory
from provider.config import load_settings
from provider.doctor import ProblemCode, render_table, report_json, run_doctor
from provider.telemetry import configure_logging

GIB = 1 << 30
FRACTION = "DARKBLOOM_MEM_CAP_FRACTION"
ACTIVATION = "DARKBLOOM_ACTIVATION_RESERVE_GB"


@pytest.fixture
def json_log() -> Iterator[io.StringIO]:
    """The real pipeline (redactor included) rendering JSON lines into a buffer."""
    saved_config, saved_hooks = structlog.get_config(), (sys.excepthook, threading.excepthook)
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    stream = io.StringIO()
    configure_logging("info", "json", stream=stream)
    yield stream
    structlog.configure(**saved_config)
    sys.excepthook, threading.excepthook = saved_hooks
    root.handlers[:] = saved_handlers
    root.setLevel(saved_level)


def doctor(tmp_path: Path, model: Path | None, env: dict[str, str], machine_gb: float = 24, **settings):
    hub = tmp_path / "hub"
    hub.mkdir(exist_ok=True)
    aliases = {"demo/tiny": str(model)} if model else {}
    loaded = load_settings(env={"HOME": str(tmp_path)}, overrides={"hf_cache_dir": str(hub), "model_aliases": aliases,
                                                                   **settings})
    return run_doctor(loaded, check_coordinator_url=False, machine_gb=machine_gb, env=env)


# (variable, value given, what the log shows as given, what was used)
BAD = [
    (FRACTION, "abc", "abc", 0.9),
    (FRACTION, "0", 0.0, 0.9),
    (FRACTION, "-1", -1.0, 0.9),
    (FRACTION, "nan", "nan", 0.9),
    (FRACTION, "inf", "inf", 0.9),
    (ACTIVATION, "-2", -2.0, 3.0),
    (ACTIVATION, "three gigabytes, please, if possible", "three gigabytes,…", 3.0),
]


@pytest.mark.parametrize("variable, raw, shown, used", BAD)
def test_a_bad_value_is_logged_with_its_variable_the_value_and_what_was_used(
        tmp_path, tiny_model_path, json_log, variable, raw, shown, used):
    report = doctor(tmp_path, tiny_model_path, {variable: raw})
    [line] = [json.loads(x) for x in json_log.getvalue().splitlines() if "memory_env_rejected" in x]
    assert (line["variable"], line["given"], line["used"]) == (variable, shown, used)
    assert "redacted" not in line and line["level"] == "warning"
    # the defaults apply: the cap fraction, and each model's own activation reserve (none loaded: 0 in force)
    assert report.cap.cap_fraction == 0.9 and not report.cap.activation_reserve_set
    assert report.cap.activation_reserve_bytes == 0
    [problem] = [p for p in report.problems if p.code is ProblemCode.SETTING_REJECTED]
    assert problem.subject == variable and problem.severity.value == "warning"
    shown_in_doctor = f"{shown:g}" if isinstance(shown, float) else repr(shown)
    assert f"given {shown_in_doctor}" in problem.detail and f"used {used:g} (the default)" in problem.detail
    assert report.ok  # a warning: the agent still runs on the defaults
    table = render_table(report)
    assert "setting_rejected" in table and variable in table and f"used {used:g}" in table
    doc = report_json(report)
    assert doc["settings_adjusted"] == [{"variable": variable, "given": shown, "used": used, "action": "rejected",
                                         "rule": "must be a finite number > 0"}]


def test_a_fraction_above_one_is_clamped_and_doctor_says_so(tmp_path, tiny_model_path, json_log):
    report = doctor(tmp_path, tiny_model_path, {FRACTION: "1.5"})
    [line] = [json.loads(x) for x in json_log.getvalue().splitlines() if "memory_env_clamped" in x]
    assert (line["variable"], line["given"], line["used"]) == (FRACTION, 1.5, 1.0)
    [problem] = [p for p in report.problems if p.code is ProblemCode.SETTING_CLAMPED]
    assert problem.subject == FRACTION and "given 1.5" in problem.detail and "used 1" in problem.detail
    assert report.cap.cap_fraction == 1.0


@pytest.mark.parametrize("env, settings, named", [
    ({ACTIVATION: "1000"}, {}, "DARKBLOOM_ACTIVATION_RESERVE_GB"),
    ({ACTIVATION: "1e30"}, {}, "DARKBLOOM_ACTIVATION_RESERVE_GB"),
    ({}, {"memory_reserve_gb": 30}, "memory_reserve_gb"),  # on a 24 GiB machine
])
def test_reserves_that_leave_no_room_are_named_instead_of_every_model(tmp_path, tiny_model_path, env, settings, named):
    report = doctor(tmp_path, tiny_model_path, env, **settings)
    codes = [p.code for p in report.problems]
    assert ProblemCode.MODEL_NEVER_FITS not in codes
    [problem] = [p for p in report.problems if p.code is ProblemCode.NO_ROOM]
    assert problem.subject == named and problem.severity.value == "error" and not report.ok
    assert report.models[0].fit.verdict.value == "too_large"  # the verdict itself is unchanged
    assert "reserve_leaves_no_room" in render_table(report) and named in render_table(report)


def test_an_8_gib_mac_with_the_defaults_serves_a_model_whose_own_reserve_is_small(tmp_path, tiny_model_path):
    """The tiny model's activation reserve (its config's estimate: ~0.1 GiB) leaves room beside the 4 GiB
    reserve; only the operator's fixed 3 GiB for every model takes it all, and then both are named."""
    report = doctor(tmp_path, tiny_model_path, {}, machine_gb=8)
    assert not [p for p in report.problems if p.code is ProblemCode.NO_ROOM]
    [model] = report.models
    assert model.fit.verdict.value == "fits_now" and model.model.activation_reserve_bytes < GIB // 4
    fixed = doctor(tmp_path, tiny_model_path, {ACTIVATION: "3"}, machine_gb=8)
    [problem] = [p for p in fixed.problems if p.code is ProblemCode.NO_ROOM]
    assert problem.subject == "memory_reserve_gb, DARKBLOOM_ACTIVATION_RESERVE_GB"
    assert "effective cap (4.0 GiB)" in problem.detail


def test_a_model_too_big_for_the_room_left_is_still_blamed_on_the_model(tmp_path, small_model_path):
    # 8.05 GiB, a fixed 3 GiB activation reserve: effective cap 4.05 GiB, 4 GiB of reserves, ~54 MB left:
    # less than the small model's 60 MB padded.
    report = doctor(tmp_path, small_model_path, {ACTIVATION: "3"}, machine_gb=64, memory_limit_gb=8.05)
    assert 0 < memory.room_for_weights(report.cap) < memory.padded_weight_bytes(report.models[0].model.weight_bytes)
    assert [(p.code, p.subject) for p in report.problems if p.severity.value == "error"] == [
        (ProblemCode.MODEL_NEVER_FITS, "demo/tiny")]


def test_doctor_points_at_a_readme_heading_that_exists():
    from provider.doctor import Problem
    from provider.models.searched import README_MODELS_HEADING

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    assert f"### {README_MODELS_HEADING}\n" in readme
    assert README_MODELS_HEADING in Problem(ProblemCode.NO_MODELS).explanation


async def test_the_agent_says_at_startup_which_setting_leaves_no_room(tmp_path, tiny_model_path, json_log):
    from provider.config import Settings
    from provider.runtime import Runtime

    (tmp_path / "hub").mkdir()
    settings = Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub", memory_limit_gb=24.0,
                        memory_reserve_gb=30.0, model_aliases={"tiny": tiny_model_path})
    runtime = await Runtime.start(settings)
    try:
        assert runtime.servable == ()
        lines = [json.loads(x) for x in json_log.getvalue().splitlines()]
        [line] = [e for e in lines if e["event"] == "memory_reserves_leave_no_room"]
        assert line["variable"] == ["memory_reserve_gb"] and line["effective_cap_bytes"] == 0
        assert line["level"] == "warning" and "redacted" not in line
    finally:
        await runtime.aclose()


async def test_the_agent_says_at_startup_which_configured_models_it_cannot_serve(tmp_path, tiny_model_path, json_log):
    # Tried as a user would: an alias to a folder that is not there (a typo, a relative path resolved
    # from the config file's folder) was dropped without a word; only `doctor` and `models` said so.
    from provider.config import Settings
    from provider.runtime import Runtime

    (tmp_path / "hub").mkdir()
    settings = Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub", memory_limit_gb=24.0,
                        model_aliases={"tiny": tiny_model_path, "typo": tmp_path / "no-such-model"},
                        enabled_models=("tiny", "typo", "never-heard-of"))
    runtime = await Runtime.start(settings)
    try:
        assert runtime.servable == ("tiny",)
        lines = [json.loads(x) for x in json_log.getvalue().splitlines()]
        [skipped] = [e for e in lines if e["event"] == "model_skipped"]
        assert skipped["level"] == "warning" and skipped["model"] == "typo"
        assert skipped["reason"] == "not_found" and skipped["path"] == str(tmp_path / "no-such-model")
        [missing] = [e for e in lines if e["event"] == "enabled_model_missing"]
        assert missing["level"] == "warning" and missing["model"] == "never-heard-of"
        assert not [e for e in lines if e["event"] == "model_skipped" and e["model"] == "tiny"]
    finally:
        await runtime.aclose()


def test_doctor_shows_the_kv_room_for_each_kv_quantization(tmp_path: Path, tiny_model_path) -> None:
    """Beside each model: the tokens of KV the cap leaves for it at its dtype, at q8 and at q4 (the tiny
    model is float32: 2,048 bytes a token, 640 at q8, 512 at q4), and which one it is served with."""
    import json
    import subprocess
    import sys

    config = tmp_path / "p.toml"
    (tmp_path / "hub").mkdir()
    config.write_text(f'hf_cache_dir = "{tmp_path / "hub"}"\nkv_quantization = "q8"\n'
                      f'[model_aliases]\n"t" = "{tiny_model_path}"\n')
    out = subprocess.run([sys.executable, "-m", "provider.cli", "--config", str(config), "doctor", "--json"],
                         capture_output=True, text=True, env={"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
    [model] = json.loads(out.stdout)["models"]
    room = model["kv_room_tokens"]
    assert model["kv_quantization"] == {"bits": {"keys": 8, "values": 8, "group_size": 32}, "refused": None}
    assert model["kv_bytes_per_token"] == 640
    assert room["none"] > 0 and abs(room["q8"] / room["none"] - 2048 / 640) < 0.01
    assert abs(room["q4"] / room["none"] - 2048 / 512) < 0.01
