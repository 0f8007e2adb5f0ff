"""Models the coordinator asks for: the agent (real engine on the tiny MLX models, real
model manager and ledger) against the coordinator double over a real WebSocket; the double sends the [N]
frames (coordinator_double/directed.py) and records the answers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator_double import CoordinatorDouble, FrameReceived, ModelStatus, ModelsUpdated
from coordinator_double.directed import desired_models, load_model, prefetch_model
from double_fixtures import consumer_for, quick_config
from protocol import DesiredModels
from protocol.to_provider import DesiredModel
from provider.agent import Agent
from provider.directed import DesiredBuilds
from provider.models.hashing import weight_hash_sync
from provider.slots import ModelState
from running_agent import Agents, agent_settings


@pytest.fixture
async def start_agent(tmp_path: Path) -> AsyncIterator[Callable[..., object]]:
    agents = Agents()

    async def start(url: str, models: dict[str, Path], no_eos: tuple[str, ...] = (), **overrides) -> Agent:
        settings = agent_settings(url, tmp_path / "state", models, **{"heartbeat_interval_s": 30.0, **overrides})
        return (await agents.start(settings, no_eos=no_eos)).agent

    yield start
    await agents.stop_all()


def statuses(double: CoordinatorDouble, model_id: str) -> list[tuple[str, str]]:
    return [(e.status, e.error) for e in double.events.of(ModelStatus)
            if e.kind == "load_model_status" and e.model_id == model_id]


async def test_load_model_of_a_cold_model_starts_succeeds_and_the_next_heartbeat_shows_it_running(
        coordinator_double, start_agent, tiny_model_path):
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    assert agent.manager.state("tiny") is ModelState.NOT_LOADED
    mark = double.mark()
    await double.send_frame(0, load_model("tiny"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    assert statuses(double, "tiny") == [("started", ""), ("succeeded", "")]
    assert agent.manager.state("tiny") is ModelState.LOADED
    # The heartbeat interval is 30 s: the one that shows the slot went out because the load changed capacity.
    beat = await double.wait_for(
        lambda e: isinstance(e, FrameReceived) and e.message.type == "heartbeat" and e.message.backend_capacity
        and any(s.model == "tiny" and s.state == "running" for s in e.message.backend_capacity.slots),
        since=mark, timeout=10)
    assert list(beat.message.warm_models) == ["tiny"]
    assert double.anomalies() == []


async def test_load_model_of_a_model_too_large_fails_with_the_reason_and_loads_nothing(
        coordinator_double, start_agent, tiny_model_path, medium_model_path):
    double = coordinator_double
    # A cap of 2.2 GiB: a load needs its padded weights + its activation reserve + 1 GiB of KV: the tiny
    # model (~1.1 GiB with its config's estimate) fits, the ~380 MB one (~2.24 GiB: its reserve at its
    # 4,096 tokens of context is ~0.8 GiB) never does.
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path, "medium": medium_model_path},
                              memory_limit_gb=4.2, memory_reserve_gb=0.0)
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, load_model("medium"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    [(first, _), (last, reason)] = statuses(double, "medium")
    assert (first, last) == ("started", "failed")
    assert reason == "request_exceeds_node"
    assert agent.manager.state("medium") is ModelState.NOT_LOADED
    assert agent.manager.warm_models() == []
    assert len(agent.ledger) == 0


async def test_load_model_of_a_model_it_does_not_have_fails_as_unavailable(coordinator_double, start_agent,
                                                                           tiny_model_path):
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, load_model("org/not-here"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status != "started", since=mark, timeout=30)
    assert statuses(double, "org/not-here") == [("started", ""), ("failed", "model_unavailable")]
    assert agent.manager.warm_models() == []


# --- prefetch_model -------------------------------------------------------------------------------------


@pytest.fixture
def double_config(tiny_model_path):
    return quick_config(catalog_weight_hashes=(("org/tiny", weight_hash_sync(tiny_model_path)),))


def prefetch_statuses(double: CoordinatorDouble, model_id: str) -> list[ModelStatus]:
    return [e for e in double.events.of(ModelStatus) if e.kind == "prefetch_model_status" and e.model_id == model_id]


async def test_prefetch_model_downloads_verifies_and_advertises_and_the_model_then_serves(
        coordinator_double, start_agent, hub, tiny_model_path, tmp_path):
    double = coordinator_double
    cache = tmp_path / "hf"
    # The downloaded build never stops early either: the completion below has exactly max_tokens.
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path}, no_eos=("org/tiny",), hf_cache_dir=cache)
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, prefetch_model("org/tiny"))
    updated = await double.wait_for(lambda e: isinstance(e, ModelsUpdated), since=mark, timeout=60)
    frames = prefetch_statuses(double, "org/tiny")
    assert [f.status for f in frames][0] == "started" and frames[-1].status == "verified"
    progress = [f for f in frames if f.status == "downloading"]
    total = sum(p.stat().st_size for p in tiny_model_path.iterdir() if p.is_file())
    assert progress and progress[-1].bytes_done == progress[-1].bytes_total == total
    assert all(a.bytes_done <= b.bytes_done for a, b in zip(progress, progress[1:]))
    assert updated.merged == ("org/tiny",) and updated.dropped == ()
    [advertised] = [m for m in double._session(0).register.models if m.id == "org/tiny"]
    assert advertised.weight_hash == weight_hash_sync(tiny_model_path)
    assert agent.manager.state("org/tiny") is ModelState.NOT_LOADED  # downloaded and verified, not loaded
    # Routable for the new build at once, and it serves.
    await double.wait_routable(model="org/tiny", timeout=10)
    async with consumer_for(double) as client:
        reply = await client.chat.completions.create(model="org/tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
    assert double.anomalies() == []


async def test_prefetch_of_a_corrupted_file_fails_and_nothing_is_advertised(coordinator_double, start_agent, hub,
                                                                            tiny_model_path, tmp_path):
    double = coordinator_double
    hub.corrupt("org/tiny", "model.safetensors")
    cache = tmp_path / "hf"
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path}, hf_cache_dir=cache)
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, prefetch_model("org/tiny"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status in ("failed", "verified"),
                          since=mark, timeout=60)
    last = prefetch_statuses(double, "org/tiny")[-1]
    assert (last.status, last.error) == ("failed", "weight_hash_mismatch")
    assert double.events.of(ModelsUpdated) == []
    assert agent.manager.info("org/tiny") is None
    assert not (cache / "models--org--tiny").exists()  # nothing a later start would find


async def test_prefetch_without_a_catalog_hash_fails_before_any_download(coordinator_double, start_agent, hub,
                                                                         tiny_model_path, tmp_path):
    double = coordinator_double
    await start_agent(double.ws_url, {"tiny": tiny_model_path}, hf_cache_dir=tmp_path / "hf")
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, prefetch_model("org/other"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status == "failed", since=mark, timeout=30)
    assert [(f.status, f.error) for f in prefetch_statuses(double, "org/other")] == \
        [("started", ""), ("failed", "no_expected_hash")]
    assert hub.gets == {}


# --- desired_models -------------------------------------------------------------------------------------


async def test_desired_models_maps_a_public_name_to_the_build_it_runs(coordinator_double, start_agent,
                                                                       tiny_model_path, quantized_model_path):
    """The consumer names the public model "tiny"; the double dispatches on the name ([A] routes on what
    the provider advertises, and "tiny" is advertised); the agent runs the build desired_models names."""
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path, "q4": quantized_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, desired_models({"tiny": "q4"}))
    # A barrier: model frames are handled in the order they came, so once a later load_model is
    # answered the map is in place.
    await double.send_frame(0, load_model("org/barrier"))
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status == "failed", since=mark, timeout=10)
    async with consumer_for(double) as client:
        reply = await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                     max_tokens=2)
    assert reply.usage.completion_tokens == 2
    # The build that ran is the one loaded (the double's consumer answer names the model asked for).
    assert agent.manager.state("q4") is ModelState.LOADED and agent.manager.state("tiny") is ModelState.NOT_LOADED


@given(st.dictionaries(st.sampled_from("abcdef"), st.tuples(st.sampled_from("pqrs"), st.sampled_from(["", "p", "x"]))),
       st.sampled_from("abcdefg"))
def test_desired_builds_run_the_desired_then_the_previous_build_then_the_name(builds, name):
    here = {"p", "q", "a"}
    desired = DesiredBuilds(here.__contains__)
    desired.update(DesiredModels(models=tuple(DesiredModel(model_name=n, desired_build=d, previous_build=p)
                                              for n, (d, p) in builds.items())))
    got = desired.resolve(name)
    if name not in builds:
        assert got == name
    else:
        d, p = builds[name]
        assert got == (d if d in here else p if p in here else name)


@pytest.mark.parametrize("double_config", [quick_config(desired_models=(("tiny", "q4"),))])
async def test_the_build_map_the_coordinator_sends_after_register_is_used(coordinator_double, start_agent,
                                                                          tiny_model_path, quantized_model_path):
    double = coordinator_double
    agent = await start_agent(double.ws_url, {"tiny": tiny_model_path, "q4": quantized_model_path})
    await double.wait_routable(model="tiny", timeout=15)
    mark = double.mark()
    await double.send_frame(0, load_model("org/barrier"))  # answered after the map (frames keep their order)
    await double.wait_for(lambda e: isinstance(e, ModelStatus) and e.status == "failed", since=mark, timeout=10)
    async with consumer_for(double) as client:
        await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert agent.manager.state("q4") is ModelState.LOADED and agent.manager.state("tiny") is ModelState.NOT_LOADED
