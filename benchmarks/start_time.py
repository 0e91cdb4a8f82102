"""How long a run takes to reach its first step: the compile warm-up (`opd.train.step.warm_up`, as `opd distill` runs
it) and the first step, cold and warm. Each start is a fresh process of `opd_step.py` (the step assembled as `setup`
does, one timed step, no TRL) with torch's own caches in an empty folder of its own (`TORCHINDUCTOR_CACHE_DIR`,
`TRITON_CACHE_DIR`), so that a graph it loads can only come from the opd compile cache (`opd.compile_cache`):

    cold      the opd cache empty: every graph compiled, the artefacts saved
    warm      the same key again: the graphs loaded from the opd cache (a second start, a `--resume`)
    off       `OPD_COMPILE_CACHE=off`: compiled again, the alternative measured in the same run

    python benchmarks/start_time.py --shape qwen3-0.6b --teacher-shape qwen3-0.6b --prompts 8 --n 4 --new-tokens 128
    python benchmarks/start_time.py --shape tiny --teacher-shape tiny --device cpu --prompts 2 --n 2 --new-tokens 8 \\
        --compile on

Arguments other than --starts and --out go to `opd_step.py` as they are. Prints one row per start (warm-up seconds,
graphs traced, inductor graphs loaded / compiled, the first step's seconds) and writes JSON."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import markdown_table  # noqa: E402

HERE = Path(__file__).resolve().parent
COLUMNS = [  # (header, row key, format)
    ("start", "start", "s"),
    ("process s", "process_s", ".1f"),
    ("warm-up s", "warm_up_layouts_s", ".1f"),
    ("graphs", "warm_up_graphs", "d"),
    ("loaded", "cache_hits", "d"),
    ("compiled", "cache_misses", "d"),
    ("artefacts in", "cache_loaded", "d"),
    ("artefacts out", "cache_saved", "d"),
    ("first step s", "first_step_s", ".2f"),
]


def start(kind: str, cache: Path, scratch: Path, passed: list[str]) -> dict:
    """One start of `opd_step.py` in a fresh process; its row (the opd_step JSON's, plus the process's seconds)."""
    torch_caches = Path(tempfile.mkdtemp(prefix=f"torch-{kind}-", dir=scratch))
    out = scratch / f"{kind}.json"
    env = {
        **os.environ,
        "OPD_COMPILE_CACHE": "off" if kind == "off" else str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(torch_caches),
        "TRITON_CACHE_DIR": str(torch_caches / "triton"),
    }
    command = [sys.executable, str(HERE / "opd_step.py"), "--skip-trl", "--warmup", "0", "--repeat", "1"]
    clock = time.perf_counter()
    subprocess.run([*command, *passed, "--out", str(out)], env=env, check=True)
    seconds = time.perf_counter() - clock
    ours = next(row for row in json.loads(out.read_text())["rows"] if row["name"].startswith("opd_step"))
    if ours.get("error"):
        raise SystemExit(f"start {kind}: opd_step.py failed: {ours['error']}")
    return {**ours, "start": kind, "process_s": seconds, "first_step_s": ours["step_seconds"][0]}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", default="cold,warm,off", help="comma-separated: cold, warm, off (in this order)")
    parser.add_argument("--out", default="runs/benchmarks/start_time.json", help="JSON written after every start")
    args, passed = parser.parse_known_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="opd-start-time-"))
    cache = scratch / "opd-compile"
    result: dict = {"command": passed, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for kind in args.starts.split(","):
        result["rows"].append(start(kind, cache, scratch, passed))
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    print(markdown_table(result["rows"], COLUMNS))
    return result


if __name__ == "__main__":
    main()
