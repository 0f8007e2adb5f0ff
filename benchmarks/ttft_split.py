"""Where the time to first token went, from `serve --local`'s request lines (`log_level = "info"`).

    python benchmarks/ttft_split.py LOG [--every N]

Each `request_completed` line carries the time to first output split in four (telemetry.request_timings):
arrival to the engine thread (parsing, template, admission), waiting there for a place in the batch,
prefill to the first token, and that token's way to the client. Printed: the median and p90 of each
part over consecutive groups of N lines (a peer_bench cell's requests run together), and over all.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PARTS = ("ttft_ms", "to_engine_ms", "engine_queue_ms", "prefill_ms", "to_client_ms", "tokens_per_s")


def lines(path: Path) -> list[dict]:
    out = []
    for raw in path.read_text(errors="replace").splitlines():
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "request_completed" and "prefill_ms" in event:
            out.append(event)
    return out


def row(label: str, group: list[dict]) -> str:
    cells = []
    for part in PARTS:
        values = sorted(e[part] for e in group)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        cells.append(f"{statistics.median(values):.1f} / {p90:.1f}")
    return f"| {label} | {len(group)} | " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path)
    parser.add_argument("--every", type=int, default=0, help="lines per group (0: all in one)")
    args = parser.parse_args()
    found = lines(args.log)
    if not found:
        raise SystemExit("no request_completed lines with the engine's times (log_level info?)")
    print("| requests | n | " + " | ".join(f"{p} p50 / p90" for p in PARTS) + " |")
    print("|---|---|" + "---|" * len(PARTS))
    if args.every > 0:
        for at in range(0, len(found), args.every):
            print(row(f"{at + 1}-{min(len(found), at + args.every)}", found[at: at + args.every]))
    print(row("all", found))


if __name__ == "__main__":
    main()
