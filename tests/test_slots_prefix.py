"""The model manager with the prefix KV cache wired in, and the post-load KV check, on the tiny model.

Real engine, real ledger, real MLX counters on an emulated 4 GiB machine (`memory_limit_gb`):
the prefix cache's RAM entries are ledger reservations that give way to a live request's KV;
every unload purges the model's RAM and SSD state; after a load the manager sizes KV with the
larger of the config's and the engine's measured bytes per token.
"""

from __future__ import annotations

import dataclasses
import gc
from pathlib import Path

import mlx.core as mx
import pytest
from structlog.testing import capture_logs

from kvcache.disk import DiskBudget, startup_sweep
from kvcache.manager import KvCacheManager
from kvcache.ssd import SsdStore
from manager_rigs import mlx_bytes
from memory import GiB, Ledger, Probe, ReservationKind, compute_figures, resolve_settings
from provider.engine import ChatRequest, Engine, Finished, SamplingParams
from provider.models import Inventory, discover
from provider.slots import Admitted, ModelManager, kv_need

PROMPT = 32  # declared prompt tokens of the request whose KV is reserved
LONG = [{"role": "user", "content": " ".join(["unified memory holds the weights and the cache"] * 60)}]


class PrefixRig:
    def __init__(self, inventory: Inventory, root: Path) -> None:
        self.probe = Probe(memory_limit_gb=4.0, rss=mlx_bytes)  # a machine of MLX's bytes alone (manager_rigs.py)
        settings = resolve_settings({}, memory_reserve_gb=0.5, memory_limit_gb=4.0, activation_reserve_gb=0.25)
        self.figures = compute_figures(self.probe.machine_bytes, settings)
        self.ledger = Ledger(self.figures, sample=self.probe.snapshot)
        self.root = root
        startup_sweep(root)  # creates the 0700 root, as the runtime does at startup
        self.kv = KvCacheManager(self.ledger, ssd=SsdStore(root, budget=DiskBudget(root, GiB)),
                                 sample_snapshot=self.probe.snapshot)
        self.engine = Engine(prefix_cache=self.kv.get)

        async def weight_hash(model_id: str) -> str:
            return f"weights-of-{model_id}"

        self.manager = ModelManager(self.engine, inventory, self.ledger, self.figures, self.probe,
                                    idle_timeout_s=None, settle_timeout_s=2.0, prefix_cache=self.kv,
                                    weight_hash=weight_hash)

    def files(self) -> list[Path]:
        return sorted(p for p in self.root.rglob("*"))

    async def written(self) -> list[Path]:
        """The files once the engine has handed its pending SSD copies over: an idle worker does that
        before it takes its next command, so one command's round trip is enough (writes are inline here)."""
        await self.engine.memory_reading()
        return self.files()


@pytest.fixture
async def rig(tiny_model_path, tmp_path):
    gc.collect()
    mx.clear_cache()
    rigs: list[PrefixRig] = []

    def make(inventory: Inventory | None = None) -> PrefixRig:
        r = PrefixRig(inventory or discover(hf_cache=None, aliases={"tiny": tiny_model_path}), tmp_path / "kv")
        rigs.append(r)
        return r

    yield make
    for r in rigs:
        await r.manager.unload_all()
        assert len(r.ledger) == 0, r.ledger.snapshot()
        assert r.files() == []  # every unload purged the SSD tier
        await r.engine.aclose()


async def serve(manager: ModelManager, rid: str, messages, n: int = 4) -> Finished:
    async with manager.serve(rid, "tiny", PROMPT, n) as slot:
        _, fin = await slot.submit(ChatRequest(rid, messages, SamplingParams(max_tokens=n, temperature=0.0))).collect()
    assert isinstance(fin, Finished)
    return fin


def prefix_bytes(ledger: Ledger) -> int:
    return ledger.snapshot().bytes_by_kind[ReservationKind.PREFIX_CACHE]


async def test_prefix_entries_give_way_to_a_request_the_ledger_would_refuse(rig):
    r = rig()
    await serve(r.manager, "warm", LONG)
    held = r.kv.stats().ram_bytes
    assert held > 0 and held == prefix_bytes(r.ledger)
    assert await r.written() == [], "a sequence nothing has built on stays in RAM only"

    # Leave the ledger `short` bytes short of this request's KV, less than the prefix cache holds:
    # refused without eviction, admitted with it. MLX's own buffer cache is emptied first: it would
    # give way before the prefix entries do (memory/snapshot.py), and it is not what this test is about.
    await r.engine.reclaim()
    assert r.probe.snapshot().reclaimable_bytes == 0
    need = kv_need(r.figures, r.manager.info("tiny"), PROMPT, 4).nbytes
    short = min(held, need) // 2
    filler = r.ledger.available_bytes() - need + short
    assert r.ledger.reserve("media:filler", ReservationKind.MEDIA, filler).granted
    assert not r.ledger.reserve("kv:probe", ReservationKind.REQUEST_KV, need).granted

    admission = r.manager.admit("tiny", PROMPT, 4)  # read-only: counts the prefix bytes as room
    assert isinstance(admission, Admitted) and prefix_bytes(r.ledger) == held
    async with r.manager.serve("r2", "tiny", PROMPT, 4) as slot:
        assert r.ledger.bytes_of("kv:r2") == need
        assert prefix_bytes(r.ledger) <= held - short  # evicted (LRU) to make room
        _, fin = await slot.submit(ChatRequest("r2", [{"role": "user", "content": "hi"}],
                                               SamplingParams(max_tokens=4, temperature=0.0))).collect()
    assert isinstance(fin, Finished)
    r.ledger.release("media:filler")


async def test_unload_purges_ram_and_ssd_state(rig):
    r = rig()
    fin = await serve(r.manager, "a", LONG)
    await serve(r.manager, "b", [*LONG, {"role": "assistant", "content": "yes"}, {"role": "user", "content": "and?"}])
    assert fin.usage.prompt_tokens > 48  # the second turn reuses more than a template's first tokens
    assert r.kv.get("tiny") is not None and r.kv.stats().ram_bytes > 0 and await r.written()
    assert await r.manager.unload("tiny")
    assert r.kv.get("tiny") is None and prefix_bytes(r.ledger) == 0
    assert r.files() == []
    await serve(r.manager, "b", LONG)  # a reload attaches a fresh, empty cache
    stats = r.kv.stats("tiny")
    assert stats.hits == 0 and stats.entries == 1


async def test_red_pressure_relief_drops_the_ram_tier(rig):
    from memory import PressureLevel

    r = rig()
    await serve(r.manager, "a", LONG)
    assert prefix_bytes(r.ledger) > 0
    assert r.manager.prefix_cache.relieve(PressureLevel.YELLOW) == 0  # only RED or worse
    assert r.manager.prefix_cache.relieve(PressureLevel.RED) > 0
    assert prefix_bytes(r.ledger) == 0


def understated(info, bytes_per_token: int):
    return dataclasses.replace(info, kv=dataclasses.replace(info.kv, bytes_per_token=bytes_per_token, sliding=()))


async def test_post_load_check_keeps_the_measured_kv_when_the_config_understates_it(rig, tiny_model_path):
    real = discover(hf_cache=None, aliases={"tiny": tiny_model_path}).models[0]
    assert real.kv.max_bytes_per_token == 2048  # 2 layers x 2 kv heads x 64 dims x K+V x float32
    r = rig(Inventory(models=(understated(real, 100),), skipped=()))
    assert r.manager.info("tiny").kv.max_bytes_per_token == 100
    with capture_logs() as logs:
        await r.manager.ensure_loaded("tiny")
    assert r.manager.info("tiny").kv.max_bytes_per_token == 2048
    checked = [e for e in logs if e["event"] == "kv_bytes_per_token_checked"]
    assert checked and checked[0]["measured_bytes"] == 2048 and checked[0]["result"] == "measured"
    assert kv_need(r.figures, r.manager.info("tiny"), PROMPT, 4).nbytes == 256 * 2048


async def test_post_load_check_keeps_a_larger_config_estimate(rig, tiny_model_path):
    real = discover(hf_cache=None, aliases={"tiny": tiny_model_path}).models[0]
    r = rig(Inventory(models=(understated(real, 4096),), skipped=()))
    await r.manager.ensure_loaded("tiny")
    assert r.manager.info("tiny").kv.max_bytes_per_token == 4096
    assert await r.engine.kv_bytes_per_token("tiny") == 2048  # the measurement itself
