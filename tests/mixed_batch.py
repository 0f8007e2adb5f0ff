"""Mixed batches through `serve --local`: forty constrained requests at concurrency 8, in
the same batch as plain greedy ones, each plain answer the same as that prompt's answer alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai

PLAIN = ["hello", "a river of copper wire", "seven green lamps", "north wind over the salt stone"]


def plain_request(client: openai.OpenAI, model: str, content: str) -> Any:
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                          max_tokens=16, temperature=0)


def beside_plain(client: openai.OpenAI, model: str, constrained: Callable[[openai.OpenAI, int], Any],
                 count: int = 40) -> list[Any]:
    """`constrained(client, i)` for i < count, shuffled with each PLAIN prompt twice, 8 at a time;
    asserts every plain answer is the one that prompt gets alone (greedy: the same tokens) and returns
    the constrained results in order of i."""
    alone = {p: plain_request(client, model, p).choices[0].message.content for p in PLAIN}
    jobs: list[tuple[str, Any]] = [("constrained", i) for i in range(count)] + [("plain", p) for p in PLAIN * 2]
    random.Random(31).shuffle(jobs)
    with ThreadPoolExecutor(8) as pool:
        futures = [(kind, arg, pool.submit(constrained, client, arg) if kind == "constrained"
                    else pool.submit(plain_request, client, model, arg)) for kind, arg in jobs]
        results = [(kind, arg, f.result()) for kind, arg, f in futures]
    for kind, arg, result in results:
        if kind == "plain":
            assert result.choices[0].message.content == alone[arg]
    return [result for _, _, result in sorted((r for r in results if r[0] == "constrained"), key=lambda r: r[1])]
