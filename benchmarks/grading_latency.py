"""Wall time of `opd.eval.grading.grade` in the cases where grading is slow, against math-verify used directly.

Ours: `grade(response, gold)` with its default 5 s budget (the whole call, imports and worker start-up included),
verdicts and timeouts cached per pair, a worker pool for callers outside the main thread.
Against: `math_verify.verify(parse(gold), parse(pred))` with its defaults (`signal.alarm` timeouts of 5 s for each
parse and the verify; main thread only, so there is no threaded column for it).

    PYTHONPATH=src python benchmarks/grading_latency.py [--out runs/benchmarks/grading_latency.json]

Each row runs once, in this order, in one fresh process: "first" rows measure one-time costs (imports, worker
start-up), so the script must not be imported by another benchmark. Prints a Markdown table and writes JSON.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import time
from pathlib import Path

PATHOLOGICAL = "2^{2^{2^{2^{10}}}}"  # sympy tries to evaluate the power tower and never finishes unless interrupted
EASY = ("\\sqrt{2}/2", "\\frac{\\sqrt2}{2}")  # needs the symbolic stage


def _timed(fn) -> tuple[float, str]:
    start = time.perf_counter()
    reason = fn()
    return time.perf_counter() - start, reason


def _ours(answer: str, gold: str):
    from opd.eval.grading import grade

    return lambda: grade(f"\\boxed{{{answer}}}", gold).reason


def _theirs(answer: str, gold: str):
    def run() -> str:
        from math_verify import parse, verify

        return str(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{answer}}}")))

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/benchmarks/grading_latency.json")
    args = parser.parse_args()
    rows: list[dict] = []

    def row(case: str, ours, theirs=None) -> None:
        seconds, reason = _timed(ours)
        entry = {"case": case, "ours_s": round(seconds, 3), "ours_reason": reason}
        if theirs is not None:
            t_seconds, t_result = _timed(theirs)
            entry |= {"math_verify_s": round(t_seconds, 3), "math_verify_result": t_result}
        rows.append(entry)
        print(entry, flush=True)

    row("main thread, first call in the process (symbolic pair)", _ours(*EASY), _theirs(*EASY))
    row("main thread, pathological pair", _ours(PATHOLOGICAL, "1"), _theirs(PATHOLOGICAL, "1"))
    row("main thread, the same pathological pair again", _ours(PATHOLOGICAL, "1"), _theirs(PATHOLOGICAL, "1"))
    with concurrent.futures.ThreadPoolExecutor(2) as ex:
        thread = lambda fn: lambda: ex.submit(fn).result()  # noqa: E731
        row("thread, first call (starts the worker)", thread(_ours("\\sqrt{3}/3", "\\frac{1}{\\sqrt3}")))
        row("thread, pathological pair", thread(_ours(PATHOLOGICAL, "2")))
        row("thread, the same pathological pair again", thread(_ours(PATHOLOGICAL, "2")))
        row("thread, symbolic pair after a killed worker", thread(_ours("\\sqrt{8}", "2\\sqrt{2}")))

        def two_at_once() -> str:
            futures = [ex.submit(_ours(PATHOLOGICAL, str(10 + k))) for k in range(2)]
            return ",".join(f.result() for f in futures)

        row("2 threads at once, 2 new pathological pairs", two_at_once)

    from opd.eval.grading import grade

    start = time.perf_counter()
    for i in range(4000):
        grade(f"so \\boxed{{{i}}}", str(i + i % 2))
    integer_rate = 4000 / (time.perf_counter() - start)

    print("\n| case | ours (s) | ours: reason | math-verify (s) | math-verify: result |")
    print("| --- | ---: | --- | ---: | --- |")
    for r in rows:
        print(
            f"| {r['case']} | {r['ours_s']:.2f} | {r['ours_reason']} | "
            f"{r.get('math_verify_s', float('nan')):.2f} | {r.get('math_verify_result', 'n/a (main thread only)')} |"
        )
    print(
        f"\ninteger answers (stages 1-2 only): {integer_rate:,.0f} grades/s; cpu_count={os.cpu_count()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps({"rows": rows, "integer_grades_per_s": integer_rate, "loadavg_1m": os.getloadavg()[0]}, indent=2)
        + "\n"
    )


if __name__ == "__main__":
    main()
