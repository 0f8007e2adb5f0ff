"""peer_bench's numbers: the per-cell summary, the two tables it prints, and its JSON file.

Works on peer_bench's `Run` / `Request` objects (duck-typed: no import of the driver). Ratios are
medians of per-repeat ratios; per-side values are medians over the repeats of a run's value.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

OURS, PEER, BARE = "ours", "mlx_lm.server", "bare"
SIDES = (OURS, PEER, BARE)
TURNS = 6


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(len(ordered) * q / 100) - 1))]


def med(values) -> float:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(values) if values else float("nan")


def ratio(runs: dict, side: str, base: str, key) -> float:
    pairs = [(runs[(side, r)], runs[(base, r)]) for (s, r) in runs if s == side and (base, r) in runs]
    return med([key(x) / key(y) if key(y) else float("nan") for x, y in pairs])


def _side_med(cell: dict, side: str, key) -> float:
    return med([key(run) for (s, _), run in cell.items() if s == side])


def summarize(runs: dict) -> list[dict]:
    """One row per (workload, c): the values both tables print, as numbers (NaN: not measured)."""
    rows = []
    for (workload, c), cell in runs.items():
        row = {
            "workload": workload, "concurrency": c,
            "repeats": {s: sum(1 for (x, _) in cell if x == s) for s in SIDES},
            "tok_s": {s: _side_med(cell, s, lambda r: r.tps) for s in SIDES},
            "ours_over_bare_tok_s": ratio(cell, OURS, BARE, lambda r: r.tps),
            "server_over_bare_tok_s": ratio(cell, PEER, BARE, lambda r: r.tps),
            "ours_over_server_tok_s": ratio(cell, OURS, PEER, lambda r: r.tps),
            "ours_over_server_ttft_p50": ratio(cell, OURS, PEER, lambda r: r.ttft_p50()),
            "ttft_p50_s": {s: _side_med(cell, s, lambda r: r.ttft_p50()) for s in SIDES},
            "ttft_p99_s": {s: _side_med(cell, s, lambda r: r.ttft_p99()) for s in SIDES},
            "cpu_s": {s: _side_med(cell, s, lambda r: r.side_cpu_s) for s in SIDES},
            "cpu_ms_per_token": {s: _side_med(cell, s, lambda r: 1000 * r.side_cpu_s / r.tokens if r.tokens else None)
                                 for s in SIDES},
            "reuse": {s: _side_med(cell, s, lambda r: r.reuse) for s in (OURS, PEER)},
            "failed_requests": {s: sum(run.errors for (x, _), run in cell.items() if x == s) for s in SIDES},
            "short_completions": {s: sum(run.short for (x, _), run in cell.items() if x == s) for s in SIDES},
        }
        if workload == "chat":
            row["ours_over_server_ttft_p50_t1"] = ratio(cell, OURS, PEER, lambda r: r.ttft_p50(range(1, 2)))
            row["ours_over_server_ttft_p50_t2_6"] = ratio(cell, OURS, PEER, lambda r: r.ttft_p50(range(2, TURNS + 1)))
        rows.append(row)
    return rows


def print_tables(header: str, runs: dict, log: list, stopped: str | None) -> None:
    print(f"\n{header}\n")
    print("| workload | c | ours tok/s | server tok/s | bare tok/s | ours ÷ bare tok/s | server ÷ bare | "
          "ours ÷ server tok/s | ours ÷ server TTFT p50 | reuse ours / server |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = summarize(runs)
    for row in rows:
        tps = row["tok_s"]
        bare_cols = (f"{tps[BARE]:.1f} | {row['ours_over_bare_tok_s']:.3f} | {row['server_over_bare_tok_s']:.3f}"
                     if row["repeats"][BARE] else "— | — | —")
        if row["workload"] == "chat":
            ttft = (f"t1 {row['ours_over_server_ttft_p50_t1']:.2f}, "
                    f"t2-6 **{row['ours_over_server_ttft_p50_t2_6']:.2f}**")
        else:
            ttft = f"{row['ours_over_server_ttft_p50']:.2f}"
        reuse = f"{row['reuse'][OURS]:.2f} / {row['reuse'][PEER]:.2f}"
        print(f"| {row['workload']} | {row['concurrency']} | {tps[OURS]:.1f} | {tps[PEER]:.1f} | {bare_cols} | "
              f"{row['ours_over_server_tok_s']:.3f} | {ttft} | {reuse} |")

    print("\nlatency and CPU per side (medians over the repeats; TTFT over every request or turn; CPU: the "
          "side's processes during the run)\n")
    print("| workload | c | side | tok/s | TTFT p50 ms | TTFT p99 ms | CPU s | CPU ms/token | failed | short |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        for side in SIDES:
            if not row["repeats"][side]:
                continue
            print(f"| {row['workload']} | {row['concurrency']} | {side} | {row['tok_s'][side]:.1f} | "
                  f"{row['ttft_p50_s'][side] * 1000:.0f} | {row['ttft_p99_s'][side] * 1000:.0f} | "
                  f"{row['cpu_s'][side]:.2f} | {row['cpu_ms_per_token'][side]:.2f} | "
                  f"{row['failed_requests'][side]} | {row['short_completions'][side]} |")
    print("\nfailed: requests that got an error (e.g. a 503); short: requests that ended before max_tokens "
          "(an EOS, or the context full)")
    if stopped:
        print(f"\nSTOPPED EARLY: {stopped}")

    print("\nper run (noise): side workload c repeat | wall s | tok/s | TTFT p50 ms | load1 | other processes' CPU s")
    for run in log:
        print(f"  {run.side:<14} {run.workload:<4} {run.c} r{run.repeat} | {run.wall:7.2f} | {run.tps:7.1f} | "
              f"{run.ttft_p50() * 1000:8.0f} | {run.load1:5.2f} | {run.others_cpu_s:6.1f}")


def _clean(value):
    """JSON without NaN: not measured is null."""
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def run_record(run) -> dict:
    return {"side": run.side, "workload": run.workload, "concurrency": run.c, "repeat": run.repeat,
            "wall_s": run.wall, "requests": len(run.requests), "completion_tokens": run.tokens,
            "tok_s": run.tps, "ttft_p50_s": run.ttft_p50(), "ttft_p99_s": run.ttft_p99(),
            "side_cpu_s": run.side_cpu_s, "others_cpu_s": run.others_cpu_s, "load1": run.load1,
            "reused_tokens": run.reused_tokens, "failed_requests": run.errors, "short_completions": run.short}


def request_records(run) -> list[dict]:
    return [{"side": run.side, "workload": run.workload, "concurrency": run.c, "repeat": run.repeat,
             "turn": r.turn, "start_s": r.start, "ttft_s": r.ttft, "end_s": r.end,
             "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
             "cached_tokens": r.cached_tokens, "max_tokens": r.max_tokens, "error": r.error}
            for r in run.requests]


def write_json(path: Path, meta: dict, runs: dict, log: list) -> None:
    """Replace `path` atomically: a reader (or a run cut short) sees the last complete file."""
    doc = {"meta": meta, "summary": summarize(runs), "runs": [run_record(r) for r in log],
           "requests": [rec for run in log for rec in request_records(run)]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_clean(doc), indent=1) + "\n")
    os.replace(tmp, path)
