"""The MOPD replicate of issue 25 on the lab (CPU): the shipped student distilled from the two shipped specialists
(`specialist_add`: accurate only on problems whose first operation is + or -; `specialist_mul`: only on those that
start with *; see assets/manifest.json) under four routings of configs/lab_mopd.yaml's two entries, over several
seeds, then evaluated on the union test set and per domain.

    routed       add prompts -> specialist_add, mul prompts -> specialist_mul (the shipped config)
    add_only     every prompt -> specialist_add (both entries point at it)
    mul_only     every prompt -> specialist_mul
    misrouted    add prompts -> specialist_mul, mul prompts -> specialist_add

Every condition is the same config and budget; only the `path` of each entry changes, so the per-teacher metrics
(`teacher/add/*`, `teacher/mul/*`: the entry that scored the prompts of that route) exist in all four. The student
before training is measured once (`student/`). Finished runs are reused. Everything in summary.json / summary.md is
read back from the runs (eval/step_N/samples.jsonl, metrics.jsonl, the wall time each run's wall.json records).

    PYTHONPATH=src python scripts/lab_mopd_replicate.py --out /tmp/mopd/replicate200 --seeds 0,1,2 --steps 200

200 steps is lab_demo's (and lab_mopd's) own budget: ~100 s per run on one CPU thread, ~20 minutes for all twelve.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "lab_mopd.yaml"
DOMAINS = ("add", "mul")
SPECIALISTS = {d: f"src/opd/lab/assets/specialist_{d}" for d in DOMAINS}
CONDITIONS = {  # condition -> (teacher of the add route, teacher of the mul route)
    "routed": ("add", "mul"),
    "add_only": ("add", "add"),
    "mul_only": ("mul", "mul"),
    "misrouted": ("mul", "add"),
}


def teachers_override(condition: str) -> str:
    import yaml

    entries = yaml.safe_load(CONFIG.read_text())["teachers"]
    paths = dict(zip(DOMAINS, CONDITIONS[condition]))
    out = [dict(e, path=SPECIALISTS[paths[e["name"]]]) for e in entries]
    return "teachers=" + json.dumps(out)


def run_one(out: Path, condition: str, seed: int, steps: int) -> Path:
    from opd.config import DistillConfig, build_config
    from opd.recipes.distill import distill

    name = f"{condition}_s{seed}"
    run_dir = out / name
    if (run_dir / "wall.json").is_file():
        return run_dir
    overrides = [
        teachers_override(condition),
        f"run.seed={seed}",
        f"run.steps={steps}",
        "run.eval_every=0",  # one eval, after the last step
        "run.eval_at_start=false",  # the student before training: measured once, below
        f"run.out_dir={out}",
        f"run.name={name}",
        "run.overwrite=true",
    ]
    config = build_config(DistillConfig, config_file=CONFIG, overrides=overrides)
    start = time.perf_counter()
    run_dir = distill(config)
    (run_dir / "wall.json").write_text(json.dumps({"wall_s": round(time.perf_counter() - start, 1)}) + "\n")
    return run_dir


def student_before(out: Path) -> Path:
    from opd.lab import student_path
    from opd.recipes.lab import measure

    eval_dir = out / "student"
    if not (eval_dir / "samples.jsonl").is_file():
        measure(student_path(), eval_dir)
    return eval_dir


def _accuracy(eval_dir: Path) -> dict[str, float]:
    from opd.io import read_jsonl
    from opd.lab.build import domain_accuracy

    rows = read_jsonl(eval_dir / "samples.jsonl")
    per = domain_accuracy(eval_dir)
    return {"union": sum(r["correct"] for r in rows) / len(rows), **{d: per[d] for d in DOMAINS}}


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def summarize(out: Path, seeds: list[int], steps: int) -> dict:
    from opd.io import read_jsonl

    summary: dict = {"steps": steps, "seeds": seeds, "student_before": _accuracy(out / "student"), "conditions": {}}
    for condition, (add_teacher, mul_teacher) in CONDITIONS.items():
        runs = {}
        for seed in seeds:
            run_dir = out / f"{condition}_s{seed}"
            if not (run_dir / "wall.json").is_file():
                continue
            rows = read_jsonl(run_dir / "metrics.jsonl")
            metrics = [m for m in rows if "teacher/add/token_frac" in m]  # the training steps (not the eval's rows)
            per_teacher = {
                name: {
                    key: statistics.fmean(m[f"teacher/{name}/{key}"] for m in metrics)
                    for key in ("token_frac", "reward_mean", "rollout_accuracy")
                }
                for name in DOMAINS
            }
            table = json.loads((run_dir / "teachers.json").read_text())
            runs[seed] = {
                "accuracy": _accuracy(run_dir / "eval" / f"step_{metrics[-1]['step']}"),
                "teachers": per_teacher,
                "routing_table": {r["name"]: {"prompts": r["prompts"], "model": r["model"]} for r in table["teachers"]},
                "wall_s": json.loads((run_dir / "wall.json").read_text())["wall_s"],
                "steps": metrics[-1]["step"],
            }
        if not runs:
            continue
        summary["conditions"][condition] = {
            "add_route": f"specialist_{add_teacher}",
            "mul_route": f"specialist_{mul_teacher}",
            "runs": runs,
            **{part: _stats([r["accuracy"][part] for r in runs.values()]) for part in ("union", *DOMAINS)},
            "teachers": {
                name: {
                    key: statistics.fmean(r["teachers"][name][key] for r in runs.values())
                    for key in ("token_frac", "reward_mean", "rollout_accuracy")
                }
                for name in DOMAINS
            },
            "wall_s": sum(r["wall_s"] for r in runs.values()),
        }
    return summary


def markdown(summary: dict) -> str:
    def pct(s: dict) -> str:
        return f"{100 * s['mean']:.1f} ± {100 * s['std']:.1f} [{100 * s['min']:.1f}, {100 * s['max']:.1f}]"

    before = summary["student_before"]
    lines = [
        f"MOPD on the lab: {summary['steps']} steps, seeds {summary['seeds']}; test accuracy (greedy, %) as mean ± "
        f"std [min, max] over seeds. Student before: union {100 * before['union']:.1f}, add "
        f"{100 * before['add']:.1f}, mul {100 * before['mul']:.1f}.",
        "",
        "| condition | add route → | mul route → | union | add (starts + or -) | mul (starts *) | "
        "token_frac add/mul | reward_mean add/mul | wall s (all seeds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for condition, c in summary["conditions"].items():
        t = c["teachers"]
        lines.append(
            f"| {condition} | {c['add_route']} | {c['mul_route']} | {pct(c['union'])} | {pct(c['add'])} | "
            f"{pct(c['mul'])} | {t['add']['token_frac']:.3f} / {t['mul']['token_frac']:.3f} | "
            f"{t['add']['reward_mean']:.3f} / {t['mul']['reward_mean']:.3f} | {c['wall_s']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/mopd/replicate"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--conditions", default=",".join(CONDITIONS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--summary-only", action="store_true", help="Summarize the finished runs; train nothing.")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    os.chdir(ROOT)  # the config's paths are relative to the repo root
    seeds = [int(s) for s in args.seeds.split(",")]
    conditions = args.conditions.split(",")
    unknown = [c for c in conditions if c not in CONDITIONS]
    if unknown:
        parser.error(f"unknown condition(s) {unknown}; choose from {', '.join(CONDITIONS)}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    student_before(out)
    if not args.summary_only:
        for seed in seeds:  # seed-major: a cut-short replicate still has every condition at the first seeds
            for condition in conditions:
                run_one(out, condition, seed, args.steps)
    summary = summarize(out, seeds, args.steps)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=lambda x: None if math.isnan(x) else x))
    (out / "summary.md").write_text(markdown(summary))
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
