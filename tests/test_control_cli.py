"""`darkbloom-provider ps` and `unload MODEL` against a real `serve --local` subprocess,
found as `status` finds it: through the state directory's lock record (HOME is the test's folder)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cli_runner import clean_env
from local_server import MODEL, start_server


def cli(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env.update(HOME=str(tmp))
    # the configured port is the default one: the agent is found through its lock record, not the flag
    return subprocess.run([sys.executable, "-m", "provider.cli", *args], env=env, capture_output=True, text=True,
                          timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model_path):
    tmp = tmp_path_factory.mktemp("control")
    srv = start_server(tmp, tiny_model_path)
    yield tmp, srv
    srv.stop()


def test_ps_shows_nothing_then_the_loaded_model_and_unload_unloads_it(server):
    tmp, srv = server
    empty = cli(tmp, "ps")
    assert empty.returncode == 0 and empty.stdout.strip() == "no model is loaded"

    srv.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    shown = cli(tmp, "ps")
    assert shown.returncode == 0, shown.stderr
    header, row = shown.stdout.strip().splitlines()
    assert header.split() == ["MODEL", "STATE", "MEMORY", "REQUESTS", "IDLE"]
    assert row.split()[:2] == [MODEL, "loaded"] and row.split()[-1] == "s"  # "N s" idle, memory in bytes
    listed = cli(tmp, "ps", "--json")
    [entry] = __import__("json").loads(listed.stdout)
    assert entry["id"] == MODEL and entry["resident_bytes"] > 0 and entry["idle_s"] >= 0

    done = cli(tmp, "unload", MODEL)
    assert done.returncode == 0 and done.stdout.strip() == f"{MODEL} unloaded"
    assert cli(tmp, "ps").stdout.strip() == "no model is loaded"
    again = cli(tmp, "unload", MODEL)
    assert again.returncode == 1 and "is not loaded" in again.stderr
    unknown = cli(tmp, "unload", "org/nothing")
    assert unknown.returncode == 1 and "is not a model of this agent" in unknown.stderr


def test_the_unload_endpoint_refuses_a_web_page(server):
    _, srv = server
    answer = httpx.post(srv.base_url + "/control/unload", json={"model": MODEL},
                        headers={"Origin": "https://example.com"})
    assert answer.status_code == 403
    assert httpx.post(srv.base_url + "/control/unload", json={"nope": 1}).status_code == 400


def test_ps_without_an_agent_says_so(tmp_path):
    result = cli(tmp_path, "ps", "--local-port", "9")
    assert result.returncode == 1 and "no running agent answers" in result.stderr
