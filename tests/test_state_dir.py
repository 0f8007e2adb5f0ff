"""An unusable state directory: the agent starts without the SSD tier and says why, once;
`doctor` says it too. Before, an OSError in the startup sweep stopped the agent (exit 1), and a service
manager restarted it forever, even with `kv_ssd_budget_gb = 0`.

The directory is made unusable the way root cannot override either: `state_dir/kvcache` is a regular file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from provider.config import Settings, load_settings
from provider.doctor import ProblemCode, Severity, run_doctor
from provider.engine import ChatRequest, SamplingParams
from provider.runtime import KVCACHE_DIR, Runtime
from provider.telemetry import capture_redacted_logs

MESSAGES = [{"role": "user", "content": "the same prompt, twice"}]


def blocked_state_dir(tmp_path: Path) -> Path:
    state = tmp_path / "state"
    state.mkdir()
    (state / KVCACHE_DIR).write_bytes(b"not a directory")
    return state


@pytest.mark.parametrize("ssd_gb", [16.0, 0.0])
async def test_an_unusable_state_dir_starts_without_the_ssd_tier_and_says_why_once(tmp_path, tiny_model_path, ssd_gb):
    (tmp_path / "hub").mkdir()
    settings = Settings(state_dir=blocked_state_dir(tmp_path), hf_cache_dir=tmp_path / "hub",
                        model_aliases={"tiny": tiny_model_path}, memory_limit_gb=8.0, memory_reserve_gb=0.5,
                        kv_ssd_budget_gb=ssd_gb)
    with capture_redacted_logs() as logs:
        runtime = await Runtime.start(settings)
    try:
        for rid in ("r1", "r2"):  # the RAM tier still reuses prefixes
            prompt = await runtime.counter.count("tiny", MESSAGES)
            async with runtime.manager.serve(rid, "tiny", prompt, 2) as slot:
                await slot.submit(ChatRequest(rid, MESSAGES, SamplingParams(max_tokens=2, temperature=0))).collect()
        stats = runtime.prefix_cache.stats()
        assert stats.hits == 1 and stats.disk_bytes == 0
    finally:
        await runtime.aclose()
    warnings = [e for e in logs if e["event"] == "ssd_tier_unavailable"]
    assert len(warnings) == 1 and warnings[0]["level"] == "warning"
    assert warnings[0]["reason"] == "EEXIST" and warnings[0]["path"].endswith(KVCACHE_DIR)


def test_doctor_says_the_ssd_tier_is_unavailable_as_a_warning(tmp_path, tiny_model_path):
    (tmp_path / "hub").mkdir()
    settings = load_settings(env={"HOME": str(tmp_path)}, overrides={
        "state_dir": str(blocked_state_dir(tmp_path)), "hf_cache_dir": str(tmp_path / "hub"),
        "model_aliases": {"demo/tiny": str(tiny_model_path)}})
    report = run_doctor(settings, check_coordinator_url=False, machine_gb=24, env={})
    (problem,) = [p for p in report.problems if p.code is ProblemCode.SSD_TIER_UNAVAILABLE]
    assert problem.severity is Severity.WARNING and problem.subject == "EEXIST"
    assert KVCACHE_DIR in problem.detail and "without the SSD tier" in problem.explanation
    assert report.ok  # a warning: the agent starts

    fine = load_settings(env={"HOME": str(tmp_path)}, overrides={
        "state_dir": str(tmp_path / "fresh"), "hf_cache_dir": str(tmp_path / "hub"),
        "model_aliases": {"demo/tiny": str(tiny_model_path)}})
    report = run_doctor(fine, check_coordinator_url=False, machine_gb=24, env={})
    assert not [p for p in report.problems if p.code is ProblemCode.SSD_TIER_UNAVAILABLE]
