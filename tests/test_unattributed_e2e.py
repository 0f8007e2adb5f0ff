"""End to end: memory the process holds outside MLX and the ledger is counted by admission and shown.

`serve --local` on an emulated small machine (`--memory-limit-gb`), two bursts of long prompts, then
/status: every figure comes from the OS and MLX (nothing faked), and what the ledger admits is the cap
less MLX's usage, the unattributed bytes, the reserve in force and what is booked.
"""

from __future__ import annotations

import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from local_server import MODEL, running_server

PROMPT = "the quick brown fox jumps over the lazy dog and " * 40  # ~1,300 tokens of the tiny model's 2,048


def status(base_url: str) -> dict:
    with urllib.request.urlopen(base_url + "/status", timeout=30) as reply:
        return json.loads(reply.read())


def test_after_bursts_of_long_prompts_memory_outside_mlx_is_counted_and_narrows_admission(tmp_path, tiny_model_path):
    with running_server(tmp_path, tiny_model_path, "--memory-limit-gb", "6", "--memory-reserve-gb", "0.5") as server:
        client = server.client()

        def ask(i: int) -> str:
            reply = client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0,
                                                   messages=[{"role": "user", "content": f"{i} {PROMPT}"}])
            return reply.choices[0].finish_reason

        with ThreadPoolExecutor(8) as pool:
            for _ in range(2):
                assert all(reason == "length" for reason in pool.map(ask, range(8)))
        body = status(server.base_url)
    memory, cap, ledger = body["memory"], body["cap"], body["ledger"]
    mlx_used = memory["mlx_active_bytes"] + memory["mlx_cache_bytes"]
    assert memory["unattributed_bytes"] > 0
    assert memory["unattributed_bytes"] == max(0, memory["rss_bytes"] - mlx_used - memory["host_booked_bytes"])
    assert memory["counted_bytes"] == mlx_used + memory["unattributed_bytes"]
    # Admission takes it off what it admits, as it takes MLX's own usage (one reading, /status's).
    booked = sum(ledger["bytes_by_kind"].values())
    room = min(cap["effective_cap_bytes"] - memory["counted_bytes"], memory["available_bytes"])
    assert memory["admits_bytes"] == max(0, room - cap["activation_reserve_bytes"] - booked)
    without = min(cap["effective_cap_bytes"] - mlx_used, memory["available_bytes"])
    assert memory["admits_bytes"] < max(0, without - cap["activation_reserve_bytes"] - booked)
    # ... and the pressure level counts it as used.
    assert body["pressure"]["utilization"] == memory["counted_bytes"] / memory["physical_bytes"]
