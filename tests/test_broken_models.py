"""A failed load is remembered: a model whose folder will not load is loaded once, not once per request.

Broken copies of the tiny model that discovery accepts (their files are all there and well formed) but
the loader refuses: a config whose sizes disagree with the weights, a vocabulary larger than the
embedding, a model type mlx-lm does not implement, and a weight file truncated or garbled after the
start. Each is asked ``ASKS`` times on the local server and on the coordinator's door of one `Runtime`
(in the test's process, two_doors.py): one load is attempted, every answer is the same non-retryable
one (local: 404 ``model_load_failed``, no Retry-After; coordinator: 404 ``model_unavailable`` /
``model_load``), the model leaves /v1/models and /status names it with its reason, and the other models
serve on. Fixing the folder makes the next request load it; without a change, only the backoff does
(a manager rig with its own clock). End to end, the agent stops advertising it to the coordinator double
(a ``models_update``), and `doctor` and `models` show it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import pytest_asyncio

from coordinator_double import DoubleConfig, ModelsUpdated
from double_fixtures import consumer_for, quick_config
from protocol.errors import Failure
from provider.slots import SlotRefused
from provider.slots.broken import FIRST_RETRY_S
from running_agent import chat_messages
from two_doors import JobAnswer, LocalAnswer, TwoDoors, model_loads, start_runtime

ASKS = 10
ROOMY = {"memory_limit_gb": 8.0, "memory_reserve_gb": 0.5}
LOAD_FAILED_LOCAL = LocalAnswer(404, "model_load_failed", "model_load", None)
LOAD_FAILED_JOB = JobAnswer(("inference_error",), 404, "model_unavailable", "model_load", None)


def chat(model: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 2}


def variant(base: Path, dest: Path, **config: object) -> Path:
    shutil.copytree(base, dest)
    path = dest / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return dest


def truncate(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def garble(folder: Path) -> None:
    """The same size, the safetensors header overwritten."""
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[8:72] = b"\xff" * 64
    weights.write_bytes(bytes(data))


def count_loads(engine) -> dict[str, int]:
    """Engine loads attempted per model (the real engine's, counted on the way in)."""
    counts: dict[str, int] = {}
    load = engine.load

    async def counted(model_id, *args, **kwargs):
        counts[model_id] = counts.get(model_id, 0) + 1
        return await load(model_id, *args, **kwargs)

    engine.load = counted
    return counts


# (case, its folder from the tiny model's, what breaks it after the start, the reason remembered)
CASES: list[tuple[str, dict, Callable[[Path], None] | None, str]] = [
    ("wrong-config", {"hidden_size": 128}, None, "load_failed"),
    ("wrong-vocabulary", {"vocab_size": 4096}, None, "load_failed"),
    ("unknown-model-type", {"model_type": "nosuchmodel"}, None, "unsupported_model_type"),
    ("truncated-after-start", {}, truncate, "corrupt_weights"),
    ("garbled-after-start", {}, garble, "corrupt_weights"),
]


class Rig:
    def __init__(self, doors: TwoDoors, folders: dict[str, Path]) -> None:
        self.doors = doors
        self.runtime = doors.runtime
        self.folders = folders
        self.loads = count_loads(doors.runtime.engine)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def rig(tmp_path_factory, tiny_model_path) -> AsyncIterator[Rig]:
    root = tmp_path_factory.mktemp("broken")
    folders = {name: variant(tiny_model_path, root / name, **config) for name, config, _, _ in CASES}
    folders["fixable"] = variant(tiny_model_path, root / "fixable", hidden_size=128)
    runtime = await start_runtime(root, {"tiny": tiny_model_path, **folders}, **ROOMY)
    try:
        async with TwoDoors(runtime) as doors:
            yield Rig(doors, folders)
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("case", "breaks", "reason"), [(c[0], c[2], c[3]) for c in CASES], ids=[c[0] for c in CASES])
async def test_a_broken_model_asked_ten_times_is_loaded_once_and_answered_the_same_every_time(rig, case, breaks, reason):
    doors, runtime = rig.doors, rig.runtime
    if breaks is not None:
        breaks(rig.folders[case])
    failed_before = model_loads(runtime, "failed")
    assert {await doors.local(chat(case)) for _ in range(ASKS)} == {LOAD_FAILED_LOCAL}
    assert {await doors.job(chat(case)) for _ in range(ASKS)} == {LOAD_FAILED_JOB}
    assert rig.loads[case] == 1
    assert model_loads(runtime, "failed") == failed_before + 1
    # Remembered with its reason, read from the folder; no longer offered; the words say why and what helps.
    status = await doors.client.get("/status")
    assert status.json()["models_broken"][case]["reason"] == reason
    assert case not in {m["id"] for m in (await doors.client.get("/v1/models")).json()["data"]}
    error = (await doors.local_reply(chat(case))).json()["error"]
    assert error["param"] == "model" and f"'{case}'" in error["message"] and "folder changes" in error["message"]
    # The others serve on.
    assert (await doors.local_reply(chat("tiny"))).status_code == 200
    assert rig.loads[case] == 1


@pytest.mark.asyncio(loop_scope="module")
async def test_a_fixed_folder_is_loaded_at_the_next_request(rig, tiny_model_path):
    doors = rig.doors
    assert await doors.local(chat("fixable")) == LOAD_FAILED_LOCAL
    assert await doors.local(chat("fixable")) == LOAD_FAILED_LOCAL
    assert rig.loads["fixable"] == 1
    shutil.copyfile(tiny_model_path / "config.json", rig.folders["fixable"] / "config.json")  # the operator's fix
    assert (await doors.local_reply(chat("fixable"))).status_code == 200
    assert rig.loads["fixable"] == 2
    assert "fixable" not in (await doors.client.get("/status")).json()["models_broken"]
    assert "fixable" in {m["id"] for m in (await doors.client.get("/v1/models")).json()["data"]}
    assert (await doors.job(chat("fixable"))).types[-1] == "inference_complete"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_without_a_change_only_the_backoff_lets_it_load_again_and_it_doubles(rigs, tmp_path, tiny_model_path):
    make, _ = rigs
    clock = Clock()
    rig = make({"broken": variant(tiny_model_path, tmp_path / "broken", hidden_size=128)}, 64 << 20, clock=clock)
    loads = count_loads(rig.engine)

    async def attempt() -> None:
        with pytest.raises(SlotRefused) as refused:
            await rig.manager.ensure_loaded("broken")
        assert refused.value.failure == Failure.model_load_failed()

    await attempt()
    await attempt()
    assert loads == {"broken": 1}
    clock.now += FIRST_RETRY_S  # the backoff passed: one more load, which fails again
    await attempt()
    await attempt()
    assert loads == {"broken": 2}
    assert rig.manager.broken("broken").failures == 2
    clock.now += FIRST_RETRY_S  # the second backoff is twice the first
    await attempt()
    assert loads == {"broken": 2}
    clock.now += FIRST_RETRY_S
    await attempt()
    assert loads == {"broken": 3}


def test_a_mark_holds_until_the_folder_changes_or_its_backoff_passes_and_the_backoff_doubles(tiny_model_path, tmp_path):
    """`BrokenModels` on its own: a real folder's fingerprint, the clock given."""
    from provider.models import inspect_model
    from provider.models.broken import LoadFault, folder_fingerprint
    from provider.slots.broken import MAX_RETRY_S, BrokenModels, backoff_s

    info = inspect_model(variant(tiny_model_path, tmp_path / "m", hidden_size=128), "m")
    clock = Clock()
    marks = BrokenModels(clock)
    first = marks.mark(info, LoadFault.LOAD_FAILED, folder_fingerprint(info))
    assert marks.holds(info) == first and first.failures == 1 and marks.holding([info]) == {"m"}
    clock.now += FIRST_RETRY_S - 1
    assert marks.holds(info) is not None
    clock.now += 1
    assert marks.holds(info) is None  # the backoff passed
    second = marks.mark(info, LoadFault.LOAD_FAILED, folder_fingerprint(info))  # failed again, same folder
    assert second.failures == 2 and second.retry_at == clock.now + 2 * FIRST_RETRY_S
    assert backoff_s(50) == MAX_RETRY_S
    (info.path / "config.json").write_text((tiny_model_path / "config.json").read_text())  # the folder changed
    assert marks.holds(info) is None and marks.as_json([info]) == {}
    third = marks.mark(info, LoadFault.LOAD_FAILED, folder_fingerprint(info))  # a new folder starts over
    assert third.failures == 1
    marks.loaded("m")
    assert marks.holds(info) is None


# --- end to end: the agent and the coordinator double ------------------------------------------------------


@pytest.fixture
def double_config() -> DoubleConfig:
    return quick_config(queue_timeout=0.5)  # a model nobody advertises fails at once


async def test_the_agent_stops_advertising_a_broken_model_and_doctor_and_models_say_why(
        coordinator_double, start_agent, tiny_model_path, tmp_path, capsys):
    from provider.cli import cmd_models
    from provider.doctor import render_table, report_json, run_doctor

    double = coordinator_double
    broken = variant(tiny_model_path, tmp_path / "broken-folder", hidden_size=128)
    provider = await start_agent(double.ws_url, models={"tiny": tiny_model_path, "broken": broken})
    await double.wait_routable(model="broken", timeout=15)
    loads = count_loads(provider.agent.runtime.engine)
    consumer = consumer_for(double)
    mark = double.mark()
    try:
        answers = []
        for _ in range(ASKS):
            try:
                await consumer.chat.completions.create(model="broken", messages=chat_messages(), max_tokens=2)
                answers.append(200)
            except Exception as exc:  # the double's answer: the provider's 404 first, then none to route to
                answers.append(getattr(exc, "status_code", None))
            if len(answers) == 1:
                await double.wait_for(lambda e: isinstance(e, ModelsUpdated) and "broken" in e.dropped,
                                      timeout=15, since=mark)
        assert answers[0] == 404 and 200 not in answers
        assert loads == {"broken": 1}
        assert not double.routable(model="broken") and double.routable(model="tiny")
        reply = await consumer.chat.completions.create(model="tiny", messages=chat_messages(), max_tokens=2)
        assert reply.choices
    finally:
        await consumer.close()
    report = await asyncio.to_thread(run_doctor, provider.settings, check_coordinator_url=False,
                                     explain_routing=False, guest=None)
    doc = report_json(report)
    assert {"code": "model_broken", "subject": "broken"}.items() <= next(
        p for p in doc["problems"] if p["code"] == "model_broken").items()
    assert next(m for m in doc["models"] if m["id"] == "broken")["broken"]["reason"] == "load_failed"
    assert next(m for m in doc["models"] if m["id"] == "tiny")["broken"] is None
    assert "broken: broken (the running agent's load failed)" in render_table(report) and not report.ok
    capsys.readouterr()
    await asyncio.to_thread(cmd_models, argparse.Namespace(json=False, hash=False), provider.settings)
    listed = capsys.readouterr().out
    assert "    broken: the loader could not build the model" in listed and listed.count("broken:") == 1
