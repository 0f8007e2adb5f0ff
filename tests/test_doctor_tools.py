"""`doctor` (and `models`) say which model calls tools, as `/v1/models` does: mlx-lm
has a tool parser for its family, read from the tokenizer the start-up check loads anyway."""

from __future__ import annotations

from pathlib import Path

from provider.config import Settings
from provider.doctor import render_table, report_json, run_doctor


def test_doctor_says_which_model_calls_tools(tmp_path: Path, tiny_model_path, tiny_tools_model_path):
    settings = Settings(state_dir=tmp_path, hf_cache_dir=tmp_path / "hf",
                        model_aliases={"demo/tiny": tiny_model_path, "demo/tools": tiny_tools_model_path})
    report = run_doctor(settings, check_coordinator_url=False, explain_routing=False, check_running_agent=False,
                        guest=None)
    doc = report_json(report)
    assert {m["id"]: m["capabilities"] for m in doc["models"]} == {
        "demo/tiny": {"tools": False}, "demo/tools": {"tools": True}}
    table = render_table(report)
    header = next(line for line in table.splitlines() if line.strip().startswith("id "))
    assert header.split()[-1] == "tools"
    rows = {line.split()[0]: line.split()[-1] for line in table.splitlines() if line.strip().startswith("demo/")}
    assert rows == {"demo/tiny": "no", "demo/tools": "yes"}
