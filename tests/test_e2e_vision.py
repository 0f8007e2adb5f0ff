"""End to end through the coordinator double: a consumer's PNG + JPEG chat reaches the agent over a
real WebSocket (encrypted, as the coordinator dispatches it) and streams back mlx-vlm's own answer;
the agent advertises the model as a vision model; nothing stays reserved."""

from __future__ import annotations

from pathlib import Path

from coordinator_double import JOB_HEADER, Completed, FrameReceived
from engine_arithmetic import mlx_vlm_greedy
from running_agent import no_request_reservations
from vision_images import data_uri, detokenized, image_part, jpeg_bytes, png_bytes

PNG = data_uri(png_bytes(40, 30, (220, 30, 30)))
JPEG = data_uri(jpeg_bytes(96, 64, (20, 40, 200)), "image/jpeg")
MESSAGES = [{"role": "user", "content": [{"type": "text", "text": "compare"}, image_part(PNG),
                                         {"type": "text", "text": "and"}, image_part(JPEG)]}]
EOS = {1, 4}


def mlx_vlm_reference(model_path: Path, max_tokens: int):
    from mlx_vlm import load
    from mlx_vlm.prompt_utils import apply_chat_template

    model, processor = load(str(model_path))
    prompt = apply_chat_template(processor, model.config, MESSAGES, num_images=2)
    return mlx_vlm_greedy(model, processor, prompt, [PNG, JPEG], max_tokens)


async def test_png_and_jpeg_chat_through_the_coordinator_double(coordinator_double, openai_consumer, start_agent,
                                                                tiny_vlm_path):
    double = coordinator_double
    provider = await start_agent(double.ws_url, models={"vlm": tiny_vlm_path})
    await double.wait_routable(model="vlm", timeout=30)
    register = next(e.message for e in double.events.of(FrameReceived) if e.message.type == "register")
    assert [m.is_vision for m in register.models] == [True]

    ref = mlx_vlm_reference(tiny_vlm_path, 24)
    assert not EOS & set(ref.token_ids) and len(ref.token_ids) == 24  # the agent runs without EOS: same length

    raw = await openai_consumer.chat.completions.with_raw_response.create(
        model="vlm", messages=MESSAGES, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True})
    parts, usage = [], None
    async for chunk in raw.parse():
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        usage = chunk.usage or usage
    assert "".join(parts) == detokenized(tiny_vlm_path, ref.token_ids)  # the same 24 greedy tokens
    assert (usage.prompt_tokens, usage.completion_tokens) == (ref.prompt_tokens, 24)
    request_id = raw.headers[JOB_HEADER]
    done = await double.wait_for(lambda e: isinstance(e, Completed) and e.request_id == request_id, timeout=10)
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (ref.prompt_tokens, 24)
    assert no_request_reservations(provider.agent.ledger)
