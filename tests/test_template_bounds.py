"""A model folder's chat template is bounded in time and memory and never runs on the event loop,
and a burst of renders is no queue.

Real parts: copies of the suite's tiny model with a `chat_template.jinja` of nested loops (within
jinja's range limits: hours to render), one that loops only for a message saying LOOP (so the
start-up check passes), and one that doubles a string past a gigabyte; `serve --local` and the
`models` / `doctor` commands as real processes, the agent in-process against the coordinator
double, the renderer's real child process.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from cli_runner import clean_env
from coordinator_double import CoordinatorDouble, Dispatched, ModelsUpdated, Rejected
from double_fixtures import consumer_for
from provider.agent import Agent
from provider.config import Settings
from provider.demo import free_port
from provider.models.template import (
    ChatTemplate,
    Lane,
    RendererUnavailable,
    TemplateBound,
    TemplateExceeded,
    TemplateFailed,
    TemplateRenderer,
    encode,
    render_ids,
    renderer,
)

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
NESTED = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"  # ~10^10 steps
HANGS = NESTED + CHATML


def trap(loop: str) -> str:
    """Renders like ChatML, except that a message saying LOOP sends it into `loop`."""
    return "{% for message in messages %}{% if 'LOOP' in message['content'] %}" + loop + "{% endif %}{% endfor %}" + CHATML


TRAP = trap(NESTED)
SHORT_TRAP = trap("{% for a in range(100000) %}{% for b in range(10000) %}{% endfor %}{% endfor %}")  # ~30 s
# Asks for a 4 GB string at once: past the renderer's 1 GiB bound.
HUNGRY = "{% set s = 'x' * 1000000 %}{% set t = s * 4000 %}" + CHATML
# Doubles a 1 MB string to 4 GiB: memory that grows while the template runs.
DOUBLING = "{% set ns = namespace(s='x' * 1000000) %}{% for i in range(12) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}" + CHATML
NO_EOS = frozenset({10**9})


def with_template(root: Path, name: str, source: Path, template: str) -> Path:
    """A copy of a tiny model folder with its own chat template."""
    folder = root / name
    if not folder.exists():
        shutil.copytree(source, folder)
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tiny_model_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("templates")
    return {"tiny": tiny_model_path, "hangs": with_template(root, "hangs", tiny_model_path, HANGS),
            "trap": with_template(root, "trap", tiny_model_path, TRAP),
            "short_trap": with_template(root, "short_trap", tiny_model_path, SHORT_TRAP),
            "hungry": with_template(root, "hungry", tiny_model_path, HUNGRY)}


def write_config(tmp: Path, aliases: dict[str, Path], **settings: object) -> Path:
    (tmp / "hub").mkdir(exist_ok=True)
    lines = [f"hf_cache_dir = {json.dumps(str(tmp / 'hub'))}", f"state_dir = {json.dumps(str(tmp / 'state'))}",
             'log_format = "json"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in settings.items()]
    lines += ["[model_aliases]"] + [f"{json.dumps(k)} = {json.dumps(str(v))}" for k, v in aliases.items()]
    config = tmp / "provider.toml"
    config.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return config


def cli_env(tmp: Path) -> dict[str, str]:
    env = clean_env()
    env["HOME"] = str(tmp)
    return env


def renderer_children(pid: int) -> list[psutil.Process]:
    """The server's template renderer processes."""
    found = []
    for child in psutil.Process(pid).children():
        try:
            if any(part.endswith("_template_child.py") for part in child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.05)  # a poll across processes: nothing else signals it
    raise AssertionError(f"{what} within {timeout_s:g} s")


def healthz(base: str) -> int | None:
    try:
        return httpx.get(base + "/healthz", timeout=1).status_code
    except httpx.HTTPError:
        return None


class Served:
    def __init__(self, tmp: Path, config: Path) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "provider.cli", "--config", str(config), "serve", "--local",
                 "--local-port", str(self.port)], env=cli_env(tmp), stdout=out, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        wait_until(lambda: self.proc.poll() is None and healthz(self.base) == 200, timeout_s, "serve --local ready")
        return time.monotonic() - started

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[callable]:
    running: list[Served] = []

    def start(aliases: dict[str, Path], **settings: object) -> Served:
        server = Served(tmp_path, write_config(tmp_path, aliases, **settings))
        running.append(server)
        return server

    yield start
    for server in running:
        server.close()


def chat(base: str, model: str, content: str = "hello", timeout: float = 60) -> httpx.Response:
    return httpx.post(base + "/v1/chat/completions", timeout=timeout,
                      json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2})


# --- (a) start-up: the agent comes up, serves the rest, says which model and why ------------------


def test_a_template_that_loops_at_start_up_leaves_the_agent_serving_the_rest(served, folders, tmp_path):
    """Before: the tokenizer warm-up rendered the looping template on a thread and never returned:
    no /healthz, no model served. Now: up within seconds, the bad model dropped with its reason."""
    server = served({"tiny": folders["tiny"], "hangs": folders["hangs"]})
    took = server.wait_ready(40)
    assert took < 30, took  # a cold start of the tiny model, plus one 2 s render bound
    assert [m["id"] for m in httpx.get(server.base + "/v1/models").json()["data"]] == ["tiny"]
    assert chat(server.base, "tiny").status_code == 200
    refused = chat(server.base, "hangs")
    assert refused.status_code == 404, refused.text
    events = [json.loads(line) for line in server.log.read_text().splitlines() if line.startswith("{")]
    skipped = [e for e in events if e.get("event") == "model_skipped" and e.get("model") == "hangs"]
    assert skipped and skipped[0]["reason"] == "chat_template_timeout" and skipped[0]["level"] == "warning"
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=15) == 0
    assert time.monotonic() - started < 10


def test_models_and_doctor_name_the_unservable_models_and_why(folders, tmp_path):
    config = write_config(tmp_path, {"tiny": folders["tiny"], "hangs": folders["hangs"], "hungry": folders["hungry"]},
                          template_timeout_s=1)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "provider.cli", "--config", str(config), *args],
                              env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)

    expected = {"hangs": "chat_template_timeout", "hungry": "chat_template_memory"}
    models = run("models", "--json")
    assert models.returncode == 0, models.stderr
    doc = json.loads(models.stdout)
    assert [m["id"] for m in doc["models"]] == ["tiny"]
    assert {s["id"]: s["reason"] for s in doc["skipped"]} == expected
    doctor = run("doctor", "--json", "--no-coordinator")
    report = json.loads(doctor.stdout)  # (the text forms print the same inventory's skipped lines)
    assert {s["id"]: s["reason"] for s in report["skipped"]} == expected
    problems = {p["subject"]: p for p in report["problems"] if p["code"] == "model_skipped"}
    assert set(problems) == set(expected) and all(p["severity"] == "warning" for p in problems.values())


# --- (b) at request time: that request fails, everything else goes on -----------------------------


async def test_a_request_whose_render_loops_fails_alone_while_the_agent_serves_on(
        coordinator_double: CoordinatorDouble, folders, tmp_path):
    """Before: the short prompt was rendered on the event loop: no heartbeat, no other request, for as
    long as the template ran. Now: the render is bounded off the loop; the healthy model answers and
    heartbeats flow meanwhile, that request fails, and the model is dropped with its reason."""
    aliases = {"tiny": folders["tiny"], "trap": folders["short_trap"]}
    settings = Settings(coordinator_url=coordinator_double.ws_url, dev_posture=True, state_dir=tmp_path / "state",
                        hf_cache_dir=tmp_path / "hub", model_aliases=aliases, memory_limit_gb=8.0,
                        memory_reserve_gb=0.5, heartbeat_interval_s=0.25, idle_timeout_mins=0, template_timeout_s=8.0,
                        local_port=free_port())
    agent = await Agent.start(settings, harden=False, eos_token_ids=dict.fromkeys(aliases, NO_EOS))
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    client = consumer_for(coordinator_double, timeout=60)
    try:
        [view] = await coordinator_double.wait_routable(1, model="trap", timeout=30)
        assert set(view.models) == {"tiny", "trap"}  # the start-up check passed: it loops only on LOOP
        hello = [{"role": "user", "content": "hello"}]
        await client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)  # loaded and warm
        [child] = [psutil.Process(pid) for pid in renderer(Lane.INTERACTIVE).pids()]
        spent = child.cpu_times().user
        mark = coordinator_double.mark()
        trapped = asyncio.create_task(client.chat.completions.create(
            model="trap", messages=[{"role": "user", "content": "LOOP"}], max_tokens=2))
        await _until(lambda: child.cpu_times().user > spent + 0.3, 10)  # the renderer is in the loops
        beats = coordinator_double.provider(view.provider_id).heartbeat_count
        # One at a time: the double gives this 8 GB machine 2 requests at once, one the trap's. The first
        # answer comes while the template still loops (its bound is 8 s away, under the double's 10 s
        # first-response timeout: on a machine at load 9 a tiny request took more than 5 s); the others
        # may come after it failed, and nothing here depends on which.
        for i in range(4):
            answer = await client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
            assert answer.choices[0].message.content is not None
            if i == 0:
                assert not trapped.done()  # the healthy model answered while the template was looping
        with pytest.raises(openai.APIStatusError):
            await trapped
        assert coordinator_double.provider(view.provider_id).heartbeat_count >= beats + 8  # seconds of 0.25 s beats
        [answer] = [e for e in coordinator_double.events.of(Rejected, since=mark) if e.provider_id == view.provider_id]
        assert (answer.status_code, answer.failure_code) == (422, "template_render")
        assert agent.runtime.counter.unservable() == {"trap": TemplateBound.TIMEOUT}
        assert agent.runtime.manager.gone == {"trap": "chat_template_timeout"}  # not in the next register
        assert "trap" not in agent.runtime.servable_now()
        # Withdrawn at once (a models_update, not the next register): the coordinator has no provider for
        # it, and never sends this one a request for it again.
        await coordinator_double.wait_for(lambda e: isinstance(e, ModelsUpdated) and e.dropped == ("trap",),
                                          timeout=10)
        mark = coordinator_double.mark()
        with pytest.raises(openai.APIStatusError):
            await client.chat.completions.create(model="trap", messages=hello, max_tokens=2)
        assert not coordinator_double.events.of(Dispatched, since=mark)
        again = await client.chat.completions.create(model="tiny", messages=hello, max_tokens=2)
        assert again.choices[0].message.content is not None
    finally:
        await client.close()
        stop.set()
        assert await asyncio.wait_for(task, 30) == 0


def test_a_model_dropped_on_a_request_is_named_by_models_while_the_server_runs(served, folders, tmp_path):
    """The local front door: the looping request gets 422, the model leaves /v1/models and is a 404
    from then on, and `models --json` (asking the running server) names it with its reason."""
    server = served({"tiny": folders["tiny"], "trap": folders["trap"]}, template_timeout_s=1)
    server.wait_ready(40)
    assert chat(server.base, "trap").status_code == 200  # renders fine without the word
    looping = chat(server.base, "trap", "LOOP")
    assert looping.status_code == 422 and looping.json()["error"]["code"] == "template_render", looping.text
    assert [m["id"] for m in httpx.get(server.base + "/v1/models").json()["data"]] == ["tiny"]
    assert chat(server.base, "trap").status_code == 404
    assert chat(server.base, "tiny").status_code == 200
    assert httpx.get(server.base + "/status").json()["models_gone"] == {"trap": "chat_template_timeout"}
    # It was resident (the first request loaded it): unloaded once idle, and out of the inventory.
    wait_until(lambda: "trap" not in [m["id"] for m in httpx.get(server.base + "/status").json()["models"]], 10,
               "the resident model unloaded and dropped")
    models = subprocess.run([sys.executable, "-m", "provider.cli", "--config", str(tmp_path / "provider.toml"),
                             "models", "--json"], env=cli_env(tmp_path), capture_output=True, text=True, timeout=120)
    doc = json.loads(models.stdout)
    assert [m["id"] for m in doc["models"]] == ["tiny"]
    assert {s["id"]: s["reason"] for s in doc["skipped"]} == {"trap": "chat_template_timeout"}


async def _until(condition, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)  # a poll with a deadline


async def test_the_engine_threads_render_is_bounded_too(folders):
    """The engine renders on its own thread when a request comes without prompt ids: a looping
    template fails that request (invalid_request) within the bound, and the engine serves on."""
    from provider.engine import ChatRequest, Engine, Failed, Finished, SamplingParams
    from provider.engine.types import EngineFailure

    async with Engine() as engine:
        await engine.load("trap", folders["trap"], eos_token_ids=NO_EOS)
        started = time.monotonic()
        stream = engine.submit("trap", ChatRequest("r1", [{"role": "user", "content": "LOOP"}],
                                                   SamplingParams(max_tokens=2, temperature=0)))
        _, failed = await stream.collect()
        assert isinstance(failed, Failed) and failed.code is EngineFailure.INVALID_REQUEST
        assert time.monotonic() - started < 10  # the 2 s bound, and a renderer's start on a busy machine
        stream = engine.submit("trap", ChatRequest("r2", [{"role": "user", "content": "hello"}],
                                                   SamplingParams(max_tokens=2, temperature=0)))
        _, finished = await stream.collect()
        assert isinstance(finished, Finished)


# --- (c) SIGTERM while a render hangs -------------------------------------------------------------


def test_sigterm_while_a_render_hangs_stops_the_server_promptly(served, folders):
    """A render bound far away (120 s) and a request stuck in it: SIGTERM stops the process within
    seconds, and the renderer process goes with it (before: the render ran on the event loop and the
    process ignored SIGTERM until it was done)."""
    server = served({"trap": folders["trap"]}, template_timeout_s=120, drain_timeout_s=1)
    server.wait_ready(40)
    stuck = threading.Thread(target=lambda: _swallow(lambda: chat(server.base, "trap", "LOOP", timeout=60)))
    stuck.start()
    try:
        def spinning() -> bool:
            return any(c.cpu_times().user > 1.0 for c in renderer_children(server.proc.pid))

        wait_until(spinning, 20, "the renderer busy with the looping template")
        assert healthz(server.base) == 200  # the loop is free meanwhile
        children = renderer_children(server.proc.pid)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(timeout=20)
        assert time.monotonic() - started < 10
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive  # no orphan left spinning
    finally:
        stuck.join(timeout=70)


def _swallow(call) -> None:
    try:
        call()
    except httpx.HTTPError:
        pass


# --- (d) memory ----------------------------------------------------------------------------------------


MESSAGES = [{"role": "user", "content": "hello"}]


@pytest.mark.parametrize("address_limit", [True, False], ids=["address-space-limit", "resident-memory-watch"])
def test_a_memory_hungry_template_is_stopped_by_the_memory_bound(address_limit):
    """Stopped by the child's address-space limit (Linux), or by the parent watching its resident
    memory (macOS enforces no RLIMIT_AS); the next render gets a fresh process and works."""
    renderer = TemplateRenderer(memory_bytes=256 << 20, limit_address_space=address_limit)
    try:
        plain = ChatTemplate(CHATML)
        assert renderer.render(plain, MESSAGES, add_generation_prompt=True).startswith("<|im_start|>user")
        [pid] = renderer.pids()
        started = time.monotonic()
        with pytest.raises(TemplateExceeded) as exceeded:
            renderer.render(ChatTemplate(DOUBLING), MESSAGES, add_generation_prompt=True, timeout_s=30)
        assert exceeded.value.bound is TemplateBound.MEMORY
        assert time.monotonic() - started < 10
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert renderer.render(plain, MESSAGES, add_generation_prompt=True).startswith("<|im_start|>user")
    finally:
        renderer.close()


def test_a_rendered_prompt_far_longer_than_what_was_sent_is_refused():
    renderer = TemplateRenderer()
    try:
        blowup = ChatTemplate("{% for i in range(100000) %}{{ messages[0]['content'] * 100 }}{% endfor %}")
        with pytest.raises(TemplateExceeded) as exceeded:
            renderer.render(blowup, MESSAGES, add_generation_prompt=True)
        assert exceeded.value.bound is TemplateBound.MEMORY
    finally:
        renderer.close()


def test_a_render_past_its_time_is_killed_and_the_next_one_is_served():
    renderer = TemplateRenderer()
    try:
        renderer.render(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=True)  # started and warm
        started = time.monotonic()
        with pytest.raises(TemplateExceeded) as exceeded:
            renderer.render(ChatTemplate(HANGS), MESSAGES, add_generation_prompt=True, timeout_s=0.5)
        assert exceeded.value.bound is TemplateBound.TIMEOUT
        assert time.monotonic() - started < 20  # bounded (the template loops for ever), on a busy machine too
        assert renderer.replaced == 1
        with pytest.raises(TemplateFailed):  # the template's own error stays a client error
            renderer.render(ChatTemplate("{{ raise_exception('no') }}"), MESSAGES, add_generation_prompt=True)
        assert renderer.render(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=False) == \
            "<|im_start|>user\nhello<|im_end|>\n"
    finally:
        renderer.close()


# --- (f) a burst is not a queue ---------------------------------------------------------------------


def _chatml(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def _one(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


async def test_a_burst_is_rendered_by_one_process_and_each_caller_gets_its_own_text():
    """64 renders awaited at once on the loop and 4 threads rendering meanwhile: each caller gets the
    text of its own messages (the answers, pipelined, are matched to their requests), and one process
    serves them all (none was stuck, so no second one was started)."""
    renderer = TemplateRenderer(processes=2)
    try:
        plain = ChatTemplate(CHATML)
        from_threads: dict[str, str] = {}

        def render_in_thread(name: str) -> None:
            for i in range(8):
                content = f"{name}-{i}"
                from_threads[content] = renderer.render(plain, _one(content), add_generation_prompt=True)

        threads = [threading.Thread(target=render_in_thread, args=(f"thread{t}",)) for t in range(4)]
        for thread in threads:
            thread.start()
        contents = [f"loop-{i}" for i in range(64)]
        texts = await asyncio.gather(*(renderer.arender(plain, _one(c), add_generation_prompt=True)
                                       for c in contents))
        for thread in threads:
            thread.join(timeout=60)
        assert texts == [_chatml(c) for c in contents]
        assert len(from_threads) == 32 and all(text == _chatml(c) for c, text in from_threads.items())
        assert len(renderer.pids()) == 1 and renderer.replaced == 0
    finally:
        renderer.close()


async def test_a_render_queued_behind_a_stuck_one_is_served_by_a_second_process():
    """Both sent to the one process; the first loops (its bound far away): the second is sent to a
    second process once the first has run for the spare delay, and answered while the first still runs."""
    renderer = TemplateRenderer(processes=2)
    try:
        assert await renderer.arender(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=True)  # up and warm
        stuck = asyncio.ensure_future(renderer.arender(ChatTemplate(HANGS), MESSAGES, add_generation_prompt=True,
                                                       timeout_s=60))
        behind = asyncio.ensure_future(renderer.arender(ChatTemplate(CHATML), _one("behind"),
                                                        add_generation_prompt=True))
        assert await asyncio.wait_for(behind, 30) == _chatml("behind")
        assert not stuck.done() and len(renderer.pids()) == 2
    finally:
        renderer.close()
    with pytest.raises(RendererUnavailable):  # closed under it
        await stuck


@pytest.mark.parametrize("template, bound", [(HANGS, TemplateBound.TIMEOUT), (DOUBLING, TemplateBound.MEMORY)],
                         ids=["timeout", "memory"])
async def test_with_one_process_the_renders_behind_one_that_passes_a_bound_are_sent_again(template, bound):
    """One process, and a render that passes a bound ahead of two others in its pipe: it fails with
    that bound, the process is replaced, and the two behind it are answered by the next one."""
    renderer = TemplateRenderer(processes=1, memory_bytes=256 << 20)
    try:
        assert await renderer.arender(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=True)
        [first] = renderer.pids()
        bad = asyncio.ensure_future(renderer.arender(ChatTemplate(template), MESSAGES, add_generation_prompt=True,
                                                     timeout_s=0.5 if bound is TemplateBound.TIMEOUT else 30))
        behind = [asyncio.ensure_future(renderer.arender(ChatTemplate(CHATML), _one(f"behind {i}"),
                                                         add_generation_prompt=True)) for i in range(2)]
        with pytest.raises(TemplateExceeded) as exceeded:
            await asyncio.wait_for(bad, 30)
        assert exceeded.value.bound is bound
        assert await asyncio.wait_for(asyncio.gather(*behind), 30) == [_chatml("behind 0"), _chatml("behind 1")]
        assert renderer.replaced == 1 and first not in renderer.pids()
    finally:
        renderer.close()


async def test_closing_fails_every_render_sent_or_waiting_and_refuses_new_ones():
    renderer = TemplateRenderer(processes=1)
    assert await renderer.arender(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=True)
    [pid] = renderer.pids()
    spent = psutil.Process(pid).cpu_times().user
    sent = [asyncio.ensure_future(renderer.arender(ChatTemplate(t), MESSAGES, add_generation_prompt=True,
                                                   timeout_s=60)) for t in (HANGS, CHATML)]
    await _until(lambda: psutil.Process(pid).cpu_times().user > spent + 0.3, 20)  # in the loops
    renderer.close()
    for render in sent:
        with pytest.raises(RendererUnavailable):
            await render
    assert renderer.pids() == []
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(RendererUnavailable):
        renderer.render(ChatTemplate(CHATML), MESSAGES, add_generation_prompt=True)


# --- (e) the same tokens as mlx-lm ---------------------------------------------------------------------


SHAPES = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2+2?"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
     {"role": "user", "content": "tell me about the sea, in a few words  \n with spaces"}],
    [{"role": "user", "content": "unicode: é 日本語 😀 <|im_end|> and a control token"}],
]
# Uses the special tokens and mlx-lm's thinking switch as variables, and a None value dropped.
WITH_VARIABLES = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                  "{% if m.name is defined %}({{ m.name }}){% endif %}{{ eos_token }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n"
                  "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def variables_model(tmp_path_factory, tiny_model_path: Path) -> Path:
    return with_template(tmp_path_factory.mktemp("variables"), "variables", tiny_model_path, WITH_VARIABLES)


@pytest.mark.parametrize("model", ["tiny", "variables"])
async def test_the_tokens_are_mlx_lms_own(model, tiny_model_path, variables_model):
    """The bounded render, tokenized here, gives the ids of mlx-lm's `tokenizer.apply_chat_template`:
    the counter inline, the counter's bulk lane, and the engine thread's `render_ids`."""
    from mlx_lm.utils import load_tokenizer

    from provider.request import PromptCounter, PromptError
    from provider.request.tokens import INLINE_CHARS

    path = tiny_model_path if model == "tiny" else variables_model
    tokenizer = load_tokenizer(path)
    counter = PromptCounter({model: path})
    try:
        long = [{"role": "user", "content": "word " * (INLINE_CHARS // 4)}]
        with_none = [{"role": "user", "content": "hi", "name": None}]
        for messages in [*SHAPES, long, with_none]:
            expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            assert await counter.prompt_ids(model, messages) == expected
            assert render_ids(tokenizer, messages, add_generation_prompt=True) == expected
            assert render_ids(tokenizer, messages, add_generation_prompt=False) == \
                tokenizer.apply_chat_template(messages, add_generation_prompt=False)
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            assert encode(tokenizer, text) == expected
        lone_surrogate = [{"role": "user", "content": "a\ud800b"}]  # valid JSON; mlx-lm raises TypeError
        with pytest.raises(TypeError):
            tokenizer.apply_chat_template(lone_surrogate, add_generation_prompt=True)
        with pytest.raises(PromptError):  # a client error, as it was in-process
            await counter.prompt_ids(model, lone_surrogate)
    finally:
        counter.lane.close()


async def test_a_short_prompt_its_template_makes_long_is_counted_in_the_lane(tmp_path, tiny_model_path):
    """A short prompt is counted on the loop only when its rendered text is short too: a template that
    repeats it (here 100 times: 100 KB) has it counted in the bulk lane, to the same ids."""
    from mlx_lm.utils import load_tokenizer

    from provider.request import PromptCounter

    repeats = with_template(tmp_path, "repeats", tiny_model_path,
                            "{% for m in messages %}{% for i in range(100) %}{{ m['content'] }}{% endfor %}{% endfor %}")
    counter = PromptCounter({"m": repeats})
    in_lane = []

    async def run(fn, *args, size=None):
        in_lane.append(fn.__name__)
        return await counter.lane.run(fn, *args, size=size)

    try:
        messages = [{"role": "user", "content": "a few words " * 85}]  # 1,020 characters
        ids = await counter.prompt_ids("m", messages, run=run)
        assert ids == load_tokenizer(repeats).apply_chat_template(messages, add_generation_prompt=True)
        assert in_lane == ["_counted"]
    finally:
        counter.lane.close()


@pytest.mark.parametrize("loader", ["load_processor", "load"])
def test_the_vision_prompt_is_mlx_vlms_own(tiny_vlm_path, loader):
    """The VLM's prompt text through the bounded renderer equals mlx-vlm's own rendering, with the
    processor the counter loads (it has the template) and the one the engine loads (its tokenizer has it)."""
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template
    from mlx_vlm.utils import load_config, load_processor

    from provider.engine.vlm import render_prompt, template_messages

    if loader == "load":
        _, processor = load(str(tiny_vlm_path), lazy=True)
    else:
        processor = load_processor(tiny_vlm_path, add_detokenizer=False)
    config = load_config(tiny_vlm_path)
    for messages in [
        [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url"}]}],
        [{"role": "system", "content": "be brief"},
         {"role": "user", "content": [{"type": "image_url"}, {"type": "text", "text": "and this"}, {"type": "image_url"}]}],
        [{"role": "user", "content": "no image"}],
    ]:
        msgs, images = template_messages(messages)
        assert render_prompt(processor, config, messages) == (
            apply_chat_template(processor, config, msgs, num_images=images), images)
