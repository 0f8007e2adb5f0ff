"""Tools on the engine's side, on the real engine and the tiny tool-calling model:
wherever the worker renders a prompt itself (no `prompt_ids`, and the next turn it prepares while
idle), the request's tools are rendered with the messages as the chat template renders them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from mlx_lm.utils import load_tokenizer

from kvcache.manager import KvCacheManager
from memory.ledger import Ledger
from memory.policy import GiB, figures
from memory.snapshot import MemorySnapshot
from next_turn import NextTurnTrace
from provider.engine import ChatRequest, Engine, Finished, SamplingParams

IDLE = MemorySnapshot(physical_bytes=16 * GiB, available_bytes=15 * GiB)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CONVERSATION = [{"role": "user", "content": "the weather in the blue mountain"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "mountain"}}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "seven and green"}]


def templated(path: Path, messages, tools, *, generation: bool = True) -> list[int]:
    return list(load_tokenizer(path).apply_chat_template(messages, tools=tools, add_generation_prompt=generation))


async def test_without_prompt_ids_the_worker_renders_the_tools(tiny_tools_model_path):
    async with Engine() as engine:
        await engine.load("m", tiny_tools_model_path)
        _, bare = await engine.submit("m", ChatRequest("a", CONVERSATION, PARAMS)).collect()
        _, fin = await engine.submit("m", ChatRequest("b", CONVERSATION, PARAMS, tools=(WEATHER,))).collect()
    assert isinstance(fin, Finished) and isinstance(bare, Finished)
    assert fin.usage.prompt_tokens == len(templated(tiny_tools_model_path, CONVERSATION, [WEATHER]))
    assert fin.usage.prompt_tokens > bare.usage.prompt_tokens


async def test_the_next_turn_is_prepared_with_the_tools(tiny_tools_model_path):
    ledger = Ledger(figures(16 * GiB, env={}), sample=lambda: IDLE)
    manager = KvCacheManager(ledger)
    trace = NextTurnTrace()
    tools = (WEATHER,)
    async with Engine(prefix_cache=manager.get, trace=trace, next_turn_scratch_bytes=GiB) as engine:
        await engine.load("m", tiny_tools_model_path)
        manager.attach("m", "weights")
        prompt = templated(tiny_tools_model_path, CONVERSATION, list(tools))
        request = ChatRequest("t", CONVERSATION, PARAMS, prompt_ids=prompt, tools=tools, prepare_next_turn=True)
        text, fin = await engine.submit("m", request).collect()
        assert isinstance(fin, Finished)
        assert await asyncio.wait_for(trace.stored.get(), 60) == "stored"
        history = [*CONVERSATION, {"role": "assistant", "content": text}]
        prepared = templated(tiny_tools_model_path, history, list(tools), generation=False)
        hit = manager.get("m").ram.fetch(prepared + [0])
        assert hit is not None and hit.matched == len(prepared)  # the conversation, tools and all
        await engine.unload("m")
        manager.purge("m")
    assert len(ledger) == 0
