"""protocol/ hot paths against json.dumps of the same object, measured in the same run.

    .venv/bin/python benchmarks/protocol_bench.py [--repeat 200] [--number 100]

Rows: one streamed chunk (build the chat.completion.chunk, frame it as one SSE event, seal it, encode the
inference_response_chunk) and one incoming request (decode the inference_request frame, open its body,
parse the body JSON). Each figure is the median over ``repeat`` batches of ``number`` calls, in µs per call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import timeit
from collections.abc import Callable

from protocol import decode, encode
from protocol.crypto import ProviderIdentity
from protocol.sse import ChunkFactory, event
from protocol.to_provider import InferenceRequest

MODEL = "mlx-community/Qwen3.5-9B-Instruct-4bit"


def _median_us(func: Callable[[], object], repeat: int, number: int) -> float:
    return statistics.median(timeit.repeat(func, repeat=repeat, number=number)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    parser.add_argument("--number", type=int, default=100)
    args = parser.parse_args()

    provider, session = ProviderIdentity.generate(), ProviderIdentity.generate()
    stream = ChunkFactory("chatcmpl-7b1d4c3e5f604a8b", 1777777777, MODEL)

    # A typical request: a short system prompt and a few turns (~1.5 KB of JSON).
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are a helpful assistant. Answer concisely. " * 4},
                {"role": "user", "content": "Explain how a NaCl box differs from a sealed box. " * 6},
                {"role": "assistant", "content": "A box authenticates the sender; a sealed box does not. " * 6},
                {"role": "user", "content": "And which one does Darkbloom use for responses?"},
            ],
            "stream": True,
            "max_tokens": 512,
            "temperature": 0.7,
        }
    ).encode()
    request = InferenceRequest(
        request_id="7b1d4c3e-5f60-4a8b-9c2d-1e0f3a4b5c6d",
        encrypted_body=session.box_for(provider.public_key_b64).seal(body),
    )
    request_frame = encode(request)
    request_dict = json.loads(request_frame)

    box, _ = provider.open_request(request.encrypted_body)
    chunk = stream.content(" token")
    sse_event = event(chunk)
    chunk_frame = box.seal_chunk(request.request_id, sse_event)
    chunk_dict = json.loads(encode(chunk_frame))
    chunk_payload = chunk.model_dump(mode="json")

    def stream_one_chunk() -> str:
        return encode(box.seal_chunk(request.request_id, event(stream.content(" token"))))

    def receive_one_request() -> object:
        message = decode(request_frame)
        _, plaintext = provider.open_request(message.encrypted_body)
        return json.loads(plaintext)

    rows: list[tuple[str, Callable[[], object], Callable[[], object]]] = [
        ("chunk: build + SSE + seal + encode", stream_one_chunk, lambda: json.dumps(chunk_dict)),
        ("  sse.event(chunk)", lambda: event(chunk), lambda: json.dumps(chunk_payload)),
        ("  box.seal_chunk(event)", lambda: box.seal_chunk(request.request_id, sse_event), lambda: json.dumps(chunk_dict)),
        ("  encode(frame)", lambda: encode(chunk_frame), lambda: json.dumps(chunk_dict)),
        ("request: decode + open + parse body", receive_one_request, lambda: json.dumps(request_dict)),
        ("  decode(frame)", lambda: decode(request_frame), lambda: json.dumps(request_dict)),
        ("  open_request(body)", lambda: provider.open_request(request.encrypted_body), lambda: json.dumps(request_dict)),
    ]
    print(f"SSE event {len(sse_event)} B, chunk frame {len(encode(chunk_frame))} B; "
          f"request body {len(body)} B, request frame {len(request_frame)} B")
    print(f"median of {args.repeat} batches x {args.number} calls\n")
    print(f"{'operation':<38} {'µs/op':>8} {'json.dumps µs':>14} {'ratio':>7}")
    print("-" * 70)
    for name, func, baseline in rows:
        ours = _median_us(func, args.repeat, args.number)
        base = _median_us(baseline, args.repeat, args.number)
        print(f"{name:<38} {ours:>8.2f} {base:>14.2f} {ours / base:>6.1f}x")


if __name__ == "__main__":
    main()
