"""The CLI end to end in a subprocess: doctor figures, bad-config messages, service install."""

from __future__ import annotations

import json
import plistlib
import sys
from pathlib import Path

import pytest

import memory
from cli_runner import closed_port, run_cli
from memory import Probe
from memory.probe import no_mlx_counters

GIB = 1 << 30


@pytest.fixture
def home(tmp_path: Path) -> Path:
    (tmp_path / "hub").mkdir()
    return tmp_path


def model_env(home: Path, tiny_model_path: Path, **extra: str) -> dict[str, str]:
    return {"DARKBLOOM_MODEL_ALIASES": f"demo/tiny={tiny_model_path}", "DARKBLOOM_HF_CACHE_DIR": str(home / "hub"),
            **extra}


def test_doctor_json_for_a_64_gib_limit_on_a_larger_machine_has_effective_cap_57_6_gib(home, tiny_model_path):
    out = run_cli("doctor", "--json", "--no-coordinator", "--machine-gb", "128",
                  env=model_env(home, tiny_model_path, DARKBLOOM_MEMORY_LIMIT_GB="64"), home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    expected = memory.figures(128 * GIB, env={}, memory_limit_gb=64)
    assert doc["cap"]["physical_bytes"] == 64 * GIB
    assert doc["cap"]["effective_cap_bytes"] == expected.effective_cap_bytes
    assert abs(doc["cap"]["effective_cap_bytes"] - 57.6 * GIB) <= 1
    assert doc["cap"]["effective_cap_gib"] == 57.6
    assert doc["machine"]["hypothetical"] is True


def test_doctor_json_on_this_machine_uses_the_probe_and_memory_figures(home, tiny_model_path):
    out = run_cli("doctor", "--json", "--no-coordinator",
                  env=model_env(home, tiny_model_path, DARKBLOOM_MEMORY_LIMIT_GB="16"), home=home)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    physical = Probe(16, mlx_counters=no_mlx_counters).snapshot().physical_bytes
    expected = memory.figures(physical, env={}, memory_limit_gb=16).for_models(())  # nothing loaded
    for field in ("physical_bytes", "hard_cap_bytes", "effective_cap_bytes", "load_reserve_bytes",
                  "activation_reserve_bytes"):
        assert doc["cap"][field] == getattr(expected, field), field
    # nothing in MLX: what counts is doctor's own process (its interpreter and libraries, as the agent's)
    assert doc["pressure"]["level"] == "green" and 0 < doc["pressure"]["utilization"] < 0.1
    assert len(doc["runtime_hash"]) == 64
    [model] = doc["models"]
    assert model["id"] == "demo/tiny" and model["path"] == str(tiny_model_path)
    assert model["weight_bytes"] == sum(p.stat().st_size for p in tiny_model_path.glob("*.safetensors"))
    assert model["verdict"] == "fits_now" and model["context_length"] == 2048
    reserve = model["activation_reserve"]
    assert reserve["source"] == "estimated" and 0 < reserve["bytes"] < 3 * GIB  # never loaded here: its config's
    assert model["required_bytes"] == expected.required_load_bytes(memory.padded_weight_bytes(model["weight_bytes"]),
                                                                   reserve["bytes"])
    assert doc["coordinator"] == {"url": "wss://api.darkbloom.dev/ws/provider", "checked": False,
                                  "reachable": None, "detail": "not_checked", "http_status": None}


def test_doctor_reports_an_unreachable_coordinator_and_a_model_that_never_fits(home, tiny_model_path):
    url = f"ws://127.0.0.1:{closed_port()}/ws/provider"
    # 8.003 GiB: 4 GiB reserve, a fixed 3 GiB of activations, 1 GiB KV leave ~3 MB, less than the tiny
    # model's 6 MB. (At 5 GiB nothing at all would fit: doctor then names the reserve instead, see
    # test_doctor_settings.)
    out = run_cli("doctor", "--json", "--timeout", "2", "--coordinator-url", url, "--memory-limit-gb", "8.003",
                  env=model_env(home, tiny_model_path, DARKBLOOM_ACTIVATION_RESERVE_GB="3"), home=home)
    assert out.returncode == 1
    doc = json.loads(out.stdout)  # still valid JSON
    assert doc["ok"] is False
    assert doc["coordinator"]["reachable"] is False and doc["coordinator"]["detail"] == "connection_refused"
    codes = {p["code"] for p in doc["problems"] if p["severity"] == "error"}
    assert codes == {"coordinator_unreachable", "model_never_fits"}
    assert doc["models"][0]["verdict"] == "too_large"


def test_doctor_table_exits_1_without_models(home):
    out = run_cli("doctor", "--no-coordinator", "--hf-cache-dir", str(home / "hub"), home=home)
    assert out.returncode == 1
    assert "effective cap" in out.stdout and "no_models" in out.stdout and "NOT OK" in out.stdout


def test_models_lists_size_quantization_context_and_fit(home, tiny_model_path):
    out = run_cli("models", "--json", env=model_env(home, tiny_model_path), home=home)
    assert out.returncode == 0, out.stderr
    [model] = json.loads(out.stdout)["models"]
    assert (model["id"], model["quantization"], model["context_length"], model["verdict"]) == (
        "demo/tiny", None, 2048, "fits_now")


@pytest.mark.parametrize(
    ("toml", "env", "needles"),
    [
        ("max_model_slots = 0\n", {}, ("key 'max_model_slots'", "value 0", "Allowed: an integer >= 1")),
        ("max_modle_slots = 2\n", {}, ("unknown key 'max_modle_slots'", "did you mean 'max_model_slots'")),
        ("", {"DARKBLOOM_LOCAL_PORT": "eighty"}, ("DARKBLOOM_LOCAL_PORT", "'eighty'", "Allowed: an integer port")),
        ("", {"DARKBLOOM_LOCAL_HOST": "0.0.0.0"}, ("DARKBLOOM_LOCAL_HOST", "'0.0.0.0'", "loopback")),
    ],
)
def test_bad_configuration_is_one_line_and_exit_78(home, toml, env, needles):
    config = home / "provider.toml"
    config.write_text(toml)
    out = run_cli("--config", str(config), "doctor", "--no-coordinator", env=env, home=home)
    assert out.returncode == 78
    assert out.stdout == ""
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1
    for needle in needles:
        assert needle in lines[0]


def test_bad_flag_value_names_the_flag(home):
    out = run_cli("models", "--max-model-slots", "many", home=home)
    assert out.returncode == 78
    assert "option --max-model-slots" in out.stderr and "'many'" in out.stderr and "Traceback" not in out.stderr


def test_service_install_no_load_renders_a_valid_service_file_in_a_temporary_home(home):
    config = home / "provider.toml"
    config.write_text("")
    out = run_cli("--config", str(config), "service", "install", "--no-load", "--drain-timeout-s", "10",
                  home=home, env={"DARKBLOOM_MAX_MODEL_SLOTS": "2"})
    assert out.returncode == 0, out.stderr
    assert "not started (--no-load)" in out.stdout
    if sys.platform == "darwin":
        plist_path = home / "Library" / "LaunchAgents" / "io.darkbloom.provider.plist"
        plist = plistlib.loads(plist_path.read_bytes())
        assert plist["ProgramArguments"][-3:] == ["serve", "--config", str(config)]
        assert plist["ExitTimeOut"] == 25 and plist["EnvironmentVariables"]["DARKBLOOM_MAX_MODEL_SLOTS"] == "2"
        return
    unit = home / ".config" / "systemd" / "user" / "darkbloom-provider.service"
    text = unit.read_text()
    exec_start = next(line for line in text.splitlines() if line.startswith("ExecStart="))
    assert '"serve"' in exec_start and f'"--config" "{config}"' in exec_start
    assert "TimeoutStopSec=25" in text and "RestartPreventExitStatus=78" in text
    assert 'Environment="DARKBLOOM_MAX_MODEL_SLOTS=2"' in text
    gone = run_cli("service", "uninstall", "--no-load", home=home)
    assert gone.returncode == 0 and not unit.exists()


def test_status_rendering_shows_models_ledger_and_prefix_cache():
    from provider.cli import render_status

    text = render_status({
        "mode": "coordinator", "pressure": {"level": "green"}, "in_flight": 1,
        "models": [{"id": "tiny", "state": "loaded", "resident_bytes": 5 * 2**20, "active_requests": 1}],
        "ledger": {"bytes_by_kind": {"request_kv": 2**20, "prefix_cache": 2**19}},
        "prefix_cache": {"hits": 3, "partial_hits": 1, "misses": 2, "ram_bytes": 2**19, "disk_bytes": 0},
    })
    assert "mode coordinator, pressure green, in flight 1" in text
    assert "tiny  loaded" in text and "ledger prefix_cache" in text
    assert "prefix cache: 3 hits, 1 partial, 2 misses" in text


def test_the_local_host_message_says_what_is_really_accepted(home):
    """127.0.0.2 was accepted while the message listed only 127.0.0.1, ::1 and localhost."""
    from provider.config import load_settings

    for host in ("127.0.0.2", "127.255.0.9", "::1", "localhost"):
        assert load_settings(env={"HOME": str(home)}, overrides={"local_host": host}).local_host == host
    out = run_cli("status", "--local-host", "10.0.0.1", home=home)
    assert out.returncode == 78
    assert "127.0.0.0/8" in out.stderr and "::1" in out.stderr and "localhost" in out.stderr, out.stderr
