"""Extreme requests and request storms: admission before any big allocation.

Two rigs, both on real MLX with the suite's tiny models and a small machine emulated with
`memory_limit_gb`:

* `JobRig`: the agent's job path (`run_job`: decrypt → parse → count → admit → accept → serve) on
  the shared `Runtime`, frames captured as the coordinator would receive them;
* `serve --local` in a subprocess, so the process's own peak RSS (`VmHWM`) can be read.

The emulated small machine (`small_machine()`): `memory_limit_gb = 3.5` plus what the test process
already holds outside MLX (its interpreter, libraries and heap, which the cap counts too: more of it in a
worker that ran other tests before), `memory_reserve_gb = 0.5`, `DARKBLOOM_ACTIVATION_RESERVE_GB = 0.25`
→ hard cap = effective cap = 1.5 GiB for the agent's own work.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import json
import time
import tracemalloc
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from nacl.public import Box, PrivateKey, PublicKey

from local_server import start_server
from memory import GiB, Probe, ReservationKind
from protocol import EncryptedPayload, InferenceRequest
from protocol.crypto import ProviderIdentity
from provider.config import Settings
from provider.jobs import JobContext, JobOutcome, run_job
from provider.request.lanes import MAX_WAITING
from provider.request.tokens import INLINE_CHARS
from provider.runtime import Runtime


def small_machine() -> dict[str, float]:
    """The emulated small machine's settings (module docstring)."""
    return {"memory_limit_gb": 3.5 + Probe().snapshot().outside_mlx_bytes / GiB, "memory_reserve_gb": 0.5}

SMALL_ENV = {"DARKBLOOM_ACTIVATION_RESERVE_GB": "0.25"}
BIG_PROMPT_CHARS = 15 * 1024 * 1024
NO_EOS = frozenset({10**9})
STOP_SOON = ["e", "a", " ", "o"]  # random weights: one of these comes within a few tokens


def big_text(chars: int = BIG_PROMPT_CHARS) -> str:
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
    return (words * (chars // len(words) + 1))[:chars]


# --- the job rig ---------------------------------------------------------------------------------------


class JobRig:
    """The coordinator path: sealed requests in, frames out, on the agent's shared Runtime."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.identity = ProviderIdentity.generate()
        self.session = PrivateKey.generate()
        self.box = Box(self.session, PublicKey(base64.b64decode(self.identity.public_key_b64)))
        self.ctx = JobContext(identity=self.identity, manager=runtime.manager, counter=runtime.counter,
                              stats=runtime.stats, metrics=runtime.metrics)
        self.frames: list[tuple[float, dict]] = []
        self.accepted = asyncio.Event()

    def request(self, rid: str, body: dict) -> InferenceRequest:
        sealed = base64.b64encode(self.box.encrypt(json.dumps(body).encode())).decode()
        return InferenceRequest(request_id=rid, encrypted_body=EncryptedPayload(
            ephemeral_public_key=base64.b64encode(bytes(self.session.public_key)).decode(), ciphertext=sealed))

    def send(self, text: str) -> None:
        frame = json.loads(text)
        self.frames.append((time.monotonic(), frame))
        if frame["type"] == "inference_accepted":
            self.accepted.set()

    async def run(self, request: InferenceRequest) -> JobOutcome:
        return await run_job(request, self.ctx, self.send)

    def of(self, rid: str) -> list[dict]:
        return [f for _, f in self.frames if f.get("request_id") == rid]

    def types(self, rid: str) -> list[str]:
        return [f["type"] for f in self.of(rid)]

    def request_kv_bytes(self) -> int:
        return self.runtime.ledger.snapshot().bytes_by_kind[ReservationKind.REQUEST_KV]


@pytest.fixture
async def job_rig(tmp_path, monkeypatch) -> AsyncIterator:
    rigs: list[Runtime] = []

    async def make(models: dict[str, Path], env: dict[str, str] | None = None, **settings) -> JobRig:
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        (tmp_path / "hub").mkdir(exist_ok=True)
        no_eos = settings.pop("no_eos", False)
        runtime = await Runtime.start(Settings(**{
            "state_dir": tmp_path / f"state{len(rigs)}", "hf_cache_dir": tmp_path / "hub", "model_aliases": models,
            "idle_timeout_mins": 0, "kv_ssd_budget_gb": 0, **settings}),
            eos_token_ids=dict.fromkeys(models, NO_EOS) if no_eos else None)
        rigs.append(runtime)
        return JobRig(runtime)

    yield make
    for runtime in rigs:
        await runtime.aclose()
        assert len(runtime.ledger) == 0, "every reservation must be released after shutdown"


def chat(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


# --- one big prompt ------------------------------------------------------------------------------------


async def test_a_15_mib_prompt_is_refused_at_once_on_the_coordinator_path(job_rig, small_model_path, monkeypatch):
    """Refused by the size bound alone: the tokenizer never sees the 15 MiB (it needs seconds for
    it, and its memory); the tokenizer calls are counted where the prompt counter makes them."""
    import provider.request.tokens as tokens

    machine = small_machine()
    rig = await job_rig({"m": small_model_path}, env=SMALL_ENV, **machine)
    assert rig.runtime.ledger.figures.effective_cap_bytes == int(machine["memory_limit_gb"] * GiB) - 2 * GiB
    await rig.runtime.manager.ensure_loaded("m")
    small = rig.request("warm", chat("hello", max_tokens=2))
    assert await rig.run(small) is JobOutcome.COMPLETED
    tokenized: list[str] = []
    for name in ("_encode", "_surely_over"):
        real = getattr(tokens, name)
        monkeypatch.setattr(tokens, name, lambda *a, _real=real, _name=name, **k: tokenized.append(_name) or _real(*a, **k))
    for n in range(3):
        request = rig.request(f"big{n}", chat(big_text()))
        assert await rig.run(request) is JobOutcome.REJECTED
        (error,) = rig.of(f"big{n}")
        assert error["type"] == "inference_error" and error["status_code"] == 400
        assert error["error_reason"] == "request_exceeds_context"
        assert tokenized == []
        assert len(rig.runtime.ledger) == 0 or rig.request_kv_bytes() == 0
    again = rig.request("after", chat("hello again", max_tokens=2))
    assert await rig.run(again) is JobOutcome.COMPLETED
    assert tokenized == ["_encode"]  # the spies see real work: a small prompt is tokenized


@contextmanager
def traced_without_collection() -> Iterator:
    """Python's allocations traced from here (a function returns the bytes allocated and still held),
    with the garbage collector off: what a reference cycle keeps stays counted."""
    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        start = tracemalloc.get_traced_memory()[0]
        yield lambda: tracemalloc.get_traced_memory()[0] - start
    finally:
        tracemalloc.stop()
        gc.enable()


REFUSED_BODIES = {  # both refused in the bulk lane, where the 15 MiB body is read
    "over the context": chat(big_text()),
    "an invalid parameter": chat(big_text(), temperature="hot"),
}


@pytest.mark.parametrize("refused", list(REFUSED_BODIES))
async def test_a_refused_15_mib_body_is_freed_with_its_answer_on_both_doors(job_rig, tiny_model_path, refused):
    """A refused body (and what was parsed from it) is freed when its 400 is answered, not at the next
    full garbage collection: nothing it passed through keeps it in a reference cycle. Measured with the
    collector off, on the coordinator's door and on the local server's."""
    from provider.local.app import create_app
    from provider.local.backend import RuntimeBackend

    rig = await job_rig({"m": tiny_model_path})
    lane = rig.runtime.counter.lane
    body = REFUSED_BODIES[refused]
    sealed, raw = rig.request("sealed", body), json.dumps(body).encode()
    app = create_app(RuntimeBackend(rig.runtime), rig.runtime.metrics)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://local") as client:
        with traced_without_collection() as held:
            assert await rig.run(sealed) is JobOutcome.REJECTED
            assert rig.of("sealed")[-1]["status_code"] == 400
            await lane.run(int)  # the lane's thread has left the refused task (its frame held the failure)
            coordinator_door = held()
            reply = await client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 400
            del reply
            await lane.run(int)
            local_door = held() - coordinator_door
    assert coordinator_door < 2 * 2**20 and local_door < 2 * 2**20, (coordinator_door, local_door)


def _vm_hwm_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _reset_hwm(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets the peak RSS to the current RSS


def test_big_prompts_keep_the_process_under_the_cap_and_answer_at_once(tmp_path, small_model_path):
    """Huge prompts through `serve --local`: three 15 MiB prompts in a row, each refused fast with
    400 request_exceeds_context, the process's peak RSS never above the effective cap (2.5 GiB: the
    small machine's 1.5 GiB and room for the server process's own interpreter and libraries, which the
    cap counts too), the ledger empty afterwards."""
    server = start_server(tmp_path, small_model_path, "--memory-limit-gb", "4.5", "--memory-reserve-gb", "0.5",
                          env_extra=SMALL_ENV)
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            ok = client.post("/v1/chat/completions", json={**chat("hello", max_tokens=2), "model": "demo/tiny"})
            assert ok.status_code == 200
            status = client.get("/status").json()
            cap = status["cap"]["effective_cap_bytes"]
            assert cap == int(2.5 * GiB)
            _reset_hwm(server.proc.pid)
            payload = json.dumps({**chat(big_text()), "model": "demo/tiny"})
            for _ in range(3):
                r = client.post("/v1/chat/completions", content=payload, headers={"content-type": "application/json"})
                assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
                assert r.json()["error"]["reason"] == "request_exceeds_context"
            peak = _vm_hwm_bytes(server.proc.pid)
            assert peak <= cap, f"peak RSS {peak / GiB:.2f} GiB above the cap"
            # 13-30 s of tokenizing each before; now the size bound answers (the test above shows the
            # tokenizer is never called; how fast is benchmarks/storm_bench.py's business)
            ledger = client.get("/status").json()["ledger"]
            assert sum(ledger["bytes_by_kind"].values()) - ledger["bytes_by_kind"]["prefix_cache"] == 0
    finally:
        server.stop()


def _ask_small(client: httpx.Client, n: int) -> list[int]:
    codes = []
    for _ in range(n):
        with client.stream("POST", "/v1/chat/completions",
                           json={**chat("a short question", max_tokens=1, stream=True), "model": "demo/tiny"}) as r:
            codes.append(r.status_code)
            r.read()
    return codes


def test_small_requests_are_answered_while_big_prompts_are_sent_back_to_back(tmp_path, small_model_path):
    """20 small requests while 15 MiB prompts are sent back to back: every small one is served (before:
    each waited up to 14 s behind the tokenizer). How long they take alone and beside the flood is
    benchmarks/storm_bench.py's business; that they never wait for the bulk lane is the next test's."""
    import threading

    server = start_server(tmp_path, small_model_path)
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            assert _ask_small(client, 2) == [200, 200]  # load, tokenizer, first compile
            stop, answered = threading.Event(), threading.Event()
            big_codes: list[int] = []
            payload = json.dumps({**chat(big_text()), "model": "demo/tiny"})

            def flood() -> None:
                with httpx.Client(base_url=server.base_url, timeout=120) as big:
                    while not stop.is_set():
                        big_codes.append(big.post("/v1/chat/completions", content=payload,
                                                  headers={"content-type": "application/json"}).status_code)
                        answered.set()

            flooder = threading.Thread(target=flood)
            flooder.start()
            try:
                assert answered.wait(60)  # the flood is under way
                beside = _ask_small(client, 20)
            finally:
                stop.set()
                flooder.join()
        assert beside == [200] * 20
        assert len(big_codes) >= 2 and set(big_codes) == {400}  # each over the context by its size
    finally:
        server.stop()


async def test_small_requests_never_wait_for_the_bulk_lane(job_rig, tiny_model_path):
    """Deterministic: the bulk lane is held busy; a large request queues behind it; 30 small requests
    are all accepted, served and done while the lane still holds the large one."""
    import threading

    rig = await job_rig({"m": tiny_model_path}, memory_limit_gb=8.0, memory_reserve_gb=0.5)
    await rig.runtime.manager.ensure_loaded("m")
    gate = threading.Event()
    lane = rig.runtime.counter.lane
    held = asyncio.create_task(lane.run(gate.wait, 60))
    big = asyncio.create_task(rig.run(rig.request("big", chat("x " * 40_000, max_tokens=2))))
    while lane.busy < 2:  # the large body is queued behind the held task
        await asyncio.sleep(0.01)
    try:
        small = [rig.request(f"s{i}", chat(f"question {i}", max_tokens=2)) for i in range(30)]
        outcomes = await asyncio.gather(*(rig.run(r) for r in small))
        assert set(outcomes) == {JobOutcome.COMPLETED}
        assert not big.done() and rig.of("big") == []  # still waiting for the lane
    finally:
        gate.set()
    await held
    assert await big is JobOutcome.REJECTED  # 80 k chars: over the 2048-token window by its size
    assert rig.of("big")[0]["error_reason"] == "request_exceeds_context"


# --- a cold model and a storm ----------------------------------------------------------------------------


async def test_a_storm_on_a_cold_model_is_served_or_refused_before_the_accept(job_rig, small_model_path):
    """50 concurrent max-context requests for a model that is not loaded, on the small machine: the KV
    room after the load holds about 37 of them. Every request either completes or is refused
    before `inference_accepted`; none is accepted and then failed (before: 12 were)."""
    rig = await job_rig({"m": small_model_path}, env=SMALL_ENV, **small_machine())
    requests = [rig.request(f"r{i}", chat(f"question number {i}", stop=STOP_SOON)) for i in range(50)]
    outcomes = await asyncio.gather(*(rig.run(r) for r in requests))
    completed = [r.request_id for r, o in zip(requests, outcomes) if o is JobOutcome.COMPLETED]
    refused = [r.request_id for r, o in zip(requests, outcomes) if o is JobOutcome.REJECTED]
    assert len(completed) + len(refused) == 50, outcomes
    assert completed and refused  # the machine holds some but not all
    for rid in refused:
        (frame,) = rig.of(rid)  # one error frame, no accept before it
        assert frame["type"] == "inference_error" and frame["status_code"] == 503
    for rid in completed:
        assert rig.types(rid)[0] == "inference_accepted" and rig.types(rid)[-1] == "inference_complete"


async def test_admission_never_exceeds_what_the_engine_runs_at_once(job_rig, tiny_model_path):
    """More concurrent requests than the engine's batch: the ones admitted all run (tokens flow to each
    while the others are refused at once); the heartbeat advertises the same number."""
    rig = await job_rig({"m": tiny_model_path}, memory_limit_gb=8.0, memory_reserve_gb=0.5, no_eos=True)
    manager = rig.runtime.manager
    await manager.ensure_loaded("m")
    batch = manager.max_concurrency("m")
    assert batch >= 1
    n = batch + 8
    requests = [rig.request(f"s{i}", chat(f"storm {i}", max_tokens=40)) for i in range(n)]
    tasks = [asyncio.create_task(rig.run(r)) for r in requests]
    outcomes = await asyncio.gather(*tasks)
    accepted = [r.request_id for r in requests if "inference_accepted" in rig.types(r.request_id)]
    assert 0 < len(accepted) <= batch
    assert all(o in (JobOutcome.COMPLETED, JobOutcome.REJECTED) for o in outcomes)
    assert sum(o is JobOutcome.COMPLETED for o in outcomes) == len(accepted)
    refused = [r.request_id for r in requests if r.request_id not in accepted]
    assert all(rig.of(rid)[0]["status_code"] == 503 for rid in refused)
    (slot,) = manager.capacity().slots
    assert slot.max_concurrency <= batch


async def test_a_batch_of_prompts_counted_in_the_bulk_lane_is_served_whole(job_rig, tiny_model_path):
    """As many requests as the engine runs at once, all at once on an idle model, each a shared
    system prompt a little over INLINE_CHARS (so each is counted in the bulk lane) and a short
    question: every one is accepted and completed. Before, the lane took 16 of them and refused the
    others with 503 queue_full, the words of a full batch, while nothing ran."""
    rig = await job_rig({"m": tiny_model_path}, memory_limit_gb=8.0, memory_reserve_gb=0.5)
    manager = rig.runtime.manager
    await manager.ensure_loaded("m")
    batch = manager.max_concurrency("m")
    assert batch > 1 + MAX_WAITING
    words = "river mountain apple stream batch model token quiet room copper wire north wind paper "
    system = {"role": "system", "content": (words * (INLINE_CHARS // len(words) + 8))[: INLINE_CHARS + 300]}
    requests = [rig.request(f"q{i}", {"model": "m", "temperature": 0, "max_tokens": 2, "messages": [
        system, {"role": "user", "content": f"question {i}"}]}) for i in range(batch)]
    outcomes = await asyncio.gather(*(rig.run(r) for r in requests))
    refused = [rig.of(r.request_id)[0] for r, o in zip(requests, outcomes) if o is not JobOutcome.COMPLETED]
    assert refused == []


async def test_a_mass_disconnect_frees_the_room_for_the_next_wave(job_rig, small_model_path):
    """45 streams fill the KV room; all 45 are cancelled at once; 45 new ones arriving right away are
    admitted as the first were (before: refused in full while the releases lagged the cancels)."""
    rig = await job_rig({"m": small_model_path}, env=SMALL_ENV, no_eos=True, max_batch_size=48, **small_machine())
    manager = rig.runtime.manager
    await manager.ensure_loaded("m")
    per_token = manager.info("m").kv.max_bytes_per_token
    room = manager.capacity().available_bytes
    tokens = (room // 45) // per_token // 256 * 256 - 256  # whole blocks, a little under room / 45
    assert tokens >= 512

    async def wave(tag: str) -> tuple[list[str], list[asyncio.Task]]:
        requests = [rig.request(f"{tag}{i}", chat(f"{tag} {i}", max_tokens=tokens - 64)) for i in range(45)]
        return [r.request_id for r in requests], [asyncio.create_task(rig.run(r)) for r in requests]

    def streaming(rids: list[str]) -> bool:
        return all("inference_response_chunk" in rig.types(rid) for rid in rids)

    first, tasks = await wave("a")
    await wait_until(lambda: streaming(first) or any(t.done() for t in tasks), timeout=120)
    assert all(rig.types(rid)[0] == "inference_accepted" for rid in first)
    left = rig.runtime.ledger.figures.available_bytes(rig.runtime.probe.snapshot(),
                                                      rig.runtime.ledger.outstanding_bytes())
    # The room is spoken for: at most two more such requests fit. (Rounding leaves up to 512 tokens a
    # request, which the batch's first KV blocks mostly take; whether one or two more fit is decided
    # by MLX's buffer cache at this moment, which depends on how the prompts reached the engine.)
    assert left < 3 * tokens * per_token
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    second, tasks = await wave("b")
    await wait_until(lambda: all(rig.of(rid) for rid in second), timeout=60)
    try:
        assert [rid for rid in second if rig.types(rid)[0] != "inference_accepted"] == []
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def wait_until(condition, *, timeout: float) -> None:
    """Wait for a condition the job rig only exposes as state (frames arrive on the loop)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.01)


async def test_a_stream_that_fails_before_its_first_token_is_an_http_error_not_a_200(tmp_path, tiny_model_path):
    """`serve --local` sends the 200 with the first output, once the request really runs: a model whose
    load fails after admission booked it (its weights went bad on disk) is an HTTP error with the reason
    (404 `model_load_failed`: the failure is remembered, test_broken_models), never a 200 followed by an
    error event, and its booking is released."""
    import shutil

    from provider.local.app import create_app
    from provider.local.backend import RuntimeBackend

    model = tmp_path / "model"
    shutil.copytree(tiny_model_path, model)
    (tmp_path / "hub").mkdir()
    runtime = await Runtime.start(Settings(state_dir=tmp_path / "state", hf_cache_dir=tmp_path / "hub",
                                           model_aliases={"m": model}, memory_limit_gb=8.0, memory_reserve_gb=0.5,
                                           idle_timeout_mins=0, kv_ssd_budget_gb=0))
    try:
        for weights in model.glob("*.safetensors"):
            weights.write_bytes(b"not weights any more")
        app = create_app(RuntimeBackend(runtime), runtime.metrics)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://local") as client:
            reply = await client.post("/v1/chat/completions", json={**chat("hello", max_tokens=2), "stream": True})
        assert reply.status_code == 404 and reply.headers["content-type"].startswith("application/json")
        assert (reply.json()["error"]["code"], reply.json()["error"]["reason"]) == ("model_load_failed", "model_load")
        assert rig_request_kv(runtime) == 0
    finally:
        await runtime.aclose()
    assert len(runtime.ledger) == 0


def rig_request_kv(runtime: Runtime) -> int:
    return runtime.ledger.snapshot().bytes_by_kind[ReservationKind.REQUEST_KV]
