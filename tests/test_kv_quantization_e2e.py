"""kv_quantization through the real agent: `serve --local --kv-quantization q8` serves the tiny model with
its KV kept at 8 bits, and what it reports and reserves per token is the quantized figure."""

from __future__ import annotations

import httpx
from openai import OpenAI

from local_server import MODEL, start_server


def test_a_q8_agent_serves_and_counts_quantized_bytes(tmp_path, tiny_model_path):
    server = start_server(tmp_path, tiny_model_path, "--kv-quantization", "q8")
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="x")
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "seven apples"}],
                                               max_tokens=6, temperature=0)
        assert reply.usage.completion_tokens >= 1
        [model] = [m for m in httpx.get(server.base_url + "/status").json()["models"] if m["id"] == MODEL]
        # The tiny model: 2 layers x (K, V) x 2 KV heads x 64 float32 = 2,048 bytes a token; at 8 bits in
        # groups of 32, 64 bytes of packed values and a 4-byte scale and bias per group, a head-row: 640.
        assert model["kv_bits"] == {"keys": 8, "values": 8, "group_size": 32}
        assert (model["kv_bytes_per_token"], model["state"]) == (640, "loaded")
    finally:
        server.stop()
