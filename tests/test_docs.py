"""The operator docs say what the code does: the memory table in deploy/README.md is what
memory.policy computes, and the example configuration names only commands that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import memory
from provider.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DEPLOY_README = (ROOT / "deploy" / "README.md").read_text(encoding="utf-8")
PROSE = " ".join(DEPLOY_README.split())  # line breaks as spaces
GIB = 1 << 30


def memory_table() -> dict[int, list[str]]:
    header = "| machine | hard cap | effective cap | left for weights | largest model that loads (weight files) |"
    lines = DEPLOY_README[DEPLOY_README.index(header):].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[int(cells[0])] = cells[1:]
    return rows


def test_the_table_has_the_machine_sizes_the_issue_asks_for():
    assert sorted(memory_table()) == [8, 16, 24, 32, 64, 128, 192]


@pytest.mark.parametrize("machine_gib", [8, 16, 24, 32, 64, 128, 192])
def test_each_row_is_what_memory_policy_computes_with_the_defaults(machine_gib):
    hard, effective, room, largest = memory_table()[machine_gib]
    f = memory.figures(machine_gib * GIB, env={})
    assert float(hard) == round(f.hard_cap_bytes / GIB, 1)
    assert float(effective) == round(f.effective_cap_bytes / GIB, 1)
    assert float(room) == round(memory.room_for_weights(f) / GIB, 1)
    loadable = memory.largest_loadable_bytes(f)
    if loadable == 0:
        assert largest.startswith("none")
    else:
        assert float(largest) == round(loadable / GIB, 1)


def test_the_8_gib_advice_is_right():
    for reserve, activation, shown in ((2.0, None, "a 1.7 GiB model"), (2.0, 1.5, "a 2.9 GiB model")):
        f = memory.figures(8 * GIB, env={}, memory_reserve_gb=reserve, activation_reserve_gb=activation)
        assert f"{memory.largest_loadable_bytes(f) / GIB:.1f}" in shown and shown in PROSE
    assert "An 8 GiB Mac has little room with the defaults" in PROSE


def test_the_example_configuration_names_only_real_commands():
    example = (ROOT / "deploy" / "provider.example.toml").read_text(encoding="utf-8")
    commands = set(build_parser()._subparsers._group_actions[0].choices)  # serve, doctor, models, ...
    assert "login" not in commands
    named = set(re.findall(r"`darkbloom-provider ([a-z][a-z-]+)", example))
    assert named <= commands, named - commands


def test_the_self_hosted_coordinator_section_names_what_exists():
    """The self-hosted coordinator section names real commands, settings, gate verdicts and status words."""
    from provider.config import FIELDS
    from provider.session.gates import GateVerdict

    section = DEPLOY_README[DEPLOY_README.index("## Join a self-hosted coordinator"):]
    commands = set(build_parser()._subparsers._group_actions[0].choices)
    assert set(re.findall(r"`darkbloom-provider ([a-z][a-z-]+)", section)) <= commands
    for setting in ("coordinator_url", "dev_posture", "model_aliases", "preload_models", "runtime_hash"):
        assert f"`{setting}" in section and setting in FIELDS
    named = set(re.findall(r"`(passes|blocked_cold|blocked|not_in_catalog|not_gated|passes_preloaded)`", section))
    assert named and named <= {v.value for v in GateVerdict}
    for env in ("EIGENINFERENCE_MIN_TRUST=none", "EIGENINFERENCE_KNOWN_RUNTIME_HASHES"):
        assert env in section
