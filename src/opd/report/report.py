"""`opd report RUN_DIR [RUN_DIR…]`: one self-contained `report.html` per run (or per comparison of runs).

The page holds, top to bottom: the run name(s) and their progress, a table of final numbers (last value of each
headline metric; per benchmark the first eval → the last, i.e. before → after training, and the teacher's number
where the run evaluated it; a run with tools adds its episodes' turns, tool calls, errors and refusals, and tokens),
the routing table of a run with `teachers:` (its `teachers.json`: prompts per teacher,
route, placement, model), the config (collapsible YAML; for several runs also the keys whose
values differ), the plot groups of `opd.report.plots` embedded as base64 PNG data URIs, and a few decoded rollouts of
the newest `samples/step_N.jsonl`. The PNGs are also written to `plots/` beside the report. Everything is written
atomically, and a run that is still appending to `metrics.jsonl` can be reported at any time.

Omitted: JavaScript and external assets (the file must open anywhere, offline, and in a headless screenshot), per-token
reward colouring of samples (tokens are tokenizer pieces, not text), and aggregation across seeds.
"""

from __future__ import annotations

import base64
import html
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from opd.io import atomic_write_text, name_step, read_json_object, read_jsonl_objects, read_yaml_mapping
from opd.report.plots import EVAL_RE, Plot, RunSeries, Series, load_references, load_series, render_plots

# rows of the final-numbers table after the eval metrics, in this order, when any run logged them
HEADLINE = [
    "rollout_accuracy",
    "reward_mean",
    "reward_abs_mean",
    "overlap_ratio",
    "overlap_mass_student",
    "overlap_mass_teacher",
    "overlap_advantage",
    "entropy_student",
    "entropy_teacher",
    "entropy_gap",
    "seq_reward_auroc",
    "pg_loss",
    "loss",
    "grad_norm",
    "skipped_steps",
    "response_length",
    "truncation_rate",
    "episode/turns_mean",  # runs with tools (rollout.tools)
    "episode/tool_calls_mean",
    "episode/tool_errors",
    "episode/sandbox_refusals",
    "episode/student_tokens_mean",
    "episode/env_tokens_mean",
    "time/step",
    "tokens_per_second",
    "lr",
]
# per-step counts whose sum over the run the table shows beside the last step's (a refusal at step 3 stays in sight)
RUN_TOTALS = ("episode/tool_errors", "episode/sandbox_refusals")
SAMPLES_SHOWN = 3
SAMPLE_CHARS = 3000


@dataclass
class RunData:
    """What the report reads from one run directory."""

    path: Path
    name: str
    series: Series
    config_text: str | None
    config: dict | None
    samples_step: int | None
    samples: list[dict]
    references: dict[str, float]  # the teacher's eval numbers, where the run evaluated it (`load_references`)
    teachers: list[dict] | None = None  # the routing table (`teachers.json`), for a run with `teachers:`


def write_report(run_dirs: list[Path], out: Path | None = None) -> Path:
    """Write `report.html` and `plots/*.png` for one run or a comparison of several; return the HTML path.

    Default location: the run directory for one run, `<first run dir>/compare/` for several. `out` is a directory,
    or a path ending in `.html` (plots then go to `plots/` beside it)."""
    run_dirs = [Path(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("opd report needs at least one run directory")
    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            raise FileNotFoundError(f"{run_dir}: no metrics.jsonl here; pass a run directory of opd distill or opd sft")
    html_path = _report_path(run_dirs, None if out is None else Path(out))
    _check_report_target(html_path, explicit=out is not None)
    runs = [load_run(path, name) for path, name in zip(run_dirs, run_names(run_dirs))]
    plots = render_plots([RunSeries(run.name, run.series, run.references) for run in runs], html_path.parent / "plots")
    atomic_write_text(html_path, render_html(runs, plots))
    return html_path


_TITLE = "<title>opd report — "  # the head of every report this module writes (`render_html`), and wrote before


def _is_report(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return _TITLE in handle.read(4096)
    except OSError:
        return False


def _check_report_target(html_path: Path, *, explicit: bool) -> None:
    """A report replaces only a report: an existing HTML file at its path that is not one (another program's page) is
    refused. At a path given with --out, so is a `plots/` beside it that no report in that directory owns: its PNGs
    (loss.png, …) would replace files of the same names."""
    if html_path.is_dir():
        raise ValueError(f"{html_path}: is a directory; give a directory for --out, or a path ending in .html")
    if html_path.exists() and not _is_report(html_path):
        raise ValueError(f"{html_path}: exists and is not an opd report; choose another --out (it is never replaced)")
    plots = html_path.parent / "plots"
    if explicit and plots.exists() and not any(_is_report(p) for p in html_path.parent.glob("*.html")):
        raise ValueError(
            f"{plots}: exists beside {html_path.name} and no opd report there owns it (its PNGs would be replaced); "
            "choose another --out directory"
        )


def _report_path(run_dirs: list[Path], out: Path | None) -> Path:
    if out is None:
        return (run_dirs[0] if len(run_dirs) == 1 else run_dirs[0] / "compare") / "report.html"
    return out if out.suffix == ".html" else out / "report.html"


def run_names(run_dirs: list[Path]) -> list[str]:
    """Directory names; parent/name where two runs share a name; an index if that still collides."""
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) < len(names):
        names = [f"{d.resolve().parent.name}/{d.resolve().name}" for d in run_dirs]
    if len(set(names)) < len(names):
        names = [f"{n} [{i}]" for i, n in enumerate(names)]
    return names


# ------------------------------------------------------------------------------------------------- loading


def load_run(run_dir: Path, name: str) -> RunData:
    config_text, config = _read_config(run_dir / "config.yaml")
    samples_step, samples = _newest_samples(run_dir)
    return RunData(
        run_dir,
        name,
        load_series(run_dir),
        config_text,
        config,
        samples_step,
        samples,
        load_references(run_dir),
        _read_teachers(run_dir / "teachers.json"),
    )


def check_run_files(run_dir: Path) -> None:
    """Read what the end-of-run report reads back and a resumed run keeps (metrics.jsonl, eval results, the newest
    samples, config.yaml): damage is a one-line ValueError naming the file now, before a `--resume` does its work,
    not after it. (teachers.json is left out: the run rewrites it before the report.)"""
    load_series(run_dir)
    load_references(run_dir)
    _newest_samples(run_dir)
    _read_config(run_dir / "config.yaml")


def _read_teachers(path: Path) -> list[dict] | None:
    """The rows of `teachers.json` (opd distill's routing table); None when the run has none. Written atomically,
    so another shape is damaged or not ours: a ValueError naming it."""
    if not path.is_file():
        return None
    rows = read_json_object(path).get("teachers")
    if not isinstance(rows, list) or not all(isinstance(row, dict) and "name" in row for row in rows):
        raise ValueError(f'{path}: not a routing table (a list of teachers, each with a "name", under "teachers")')
    return rows


def _read_config(path: Path) -> tuple[str | None, dict | None]:
    if not path.exists():  # a directory in its place is damage (one line naming it), not a run without a config
        return None, None
    return read_yaml_mapping(path)  # unparsable or not a mapping: one line naming the file


def _newest_samples(run_dir: Path) -> tuple[int | None, list[dict]]:
    steps = {p: name_step(p) for p in run_dir.glob("samples/step_*.jsonl")}  # an absurd step: one line naming it
    files = {step: p for p, step in steps.items() if step is not None}
    if not files:
        return None, []
    step = max(files)
    records = read_jsonl_objects(files[step])
    for line, record in records:
        _check_sample(files[step], line, record)
    return step, [record for _, record in records][:SAMPLES_SHOWN]


# the fields of a sample record (opd.train.step writes them) and what each must be where present
_SAMPLE_FIELDS: dict[str, tuple[str, Callable[[object], bool]]] = {
    "prompt": ("a string", lambda v: isinstance(v, str)),
    "response": ("a string", lambda v: isinstance(v, str)),
    "correct": ("true, false or null", lambda v: v is None or isinstance(v, bool)),
    "tokens": ("a list of strings", lambda v: isinstance(v, list) and all(isinstance(t, str) for t in v)),
    "token_rewards": (
        "a list of numbers",
        lambda v: isinstance(v, list) and all(isinstance(r, (int, float)) and not isinstance(r, bool) for r in v),
    ),
}


def _check_sample(path: Path, line: int, record: dict) -> None:
    """A sample record whose fields have other types was not written by a run: a ValueError naming the file, the
    line and the field (never a report that quietly drops the field)."""
    for key, (expected, valid) in _SAMPLE_FIELDS.items():
        if key in record and not valid(record[key]):
            value = record[key]
            shown = repr(value) if len(repr(value)) <= 40 else f"{type(value).__name__} {repr(value)[:37]}..."
            raise ValueError(f"{path}:{line}: {key!r} is {shown}, expected {expected} (not a sample opd wrote)")


def first_value(series: Series, key: str) -> tuple[int, float] | None:
    """(step, value) of the oldest point of `key` (for an eval: step 0, the model before training), or None."""
    if key not in series:
        return None
    steps, values = series[key]
    return int(steps[0]), float(values[0])


def last_value(series: Series, key: str) -> tuple[int, float] | None:
    """(step, value) of the newest point of `key`, or None."""
    if key not in series:
        return None
    steps, values = series[key]
    return int(steps[-1]), float(values[-1])


def final_rows(runs: list[RunData]) -> list[str]:
    """Keys of the final-numbers table: eval accuracies (avg@/pass@/maj@) by benchmark, then the headline metrics."""
    keys = set().union(*(run.series for run in runs))
    evals = sorted(k for k in keys if (m := EVAL_RE.match(k)) and m.group(2).startswith(("avg@", "pass@", "maj@")))
    return evals + [k for k in HEADLINE if k in keys]


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested config → {"dotted.key": value as JSON}."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = json.dumps(value, ensure_ascii=False)
    return flat


def config_differences(runs: list[RunData]) -> dict[str, list[str]]:
    """Dotted keys whose values differ between runs (missing shows as '—')."""
    flats = [flatten(run.config) if run.config else {} for run in runs]
    keys = sorted(set().union(*flats))
    return {k: [f.get(k, "—") for f in flats] for k in keys if len({f.get(k, "—") for f in flats}) > 1}


# ------------------------------------------------------------------------------------------------- HTML

CSS = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1300px;
       padding: 0 16px; color: #222; line-height: 1.4; }
h1 { font-size: 26px; margin-bottom: 4px; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 4px; margin-top: 32px; }
h3 { margin: 18px 0 4px; } .meta { color: #555; font-size: 14px; } .meta code { font-size: 13px; }
table { border-collapse: collapse; font-size: 14px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 4px 10px; text-align: right; } th { background: #f3f3f3; }
td.key, th.key { text-align: left; font-family: monospace; } tr:nth-child(even) td { background: #fafafa; }
.step { color: #888; font-size: 11px; margin-left: 4px; }
details { margin: 6px 0; } summary { cursor: pointer; font-weight: 600; }
pre { background: #f6f8fa; border: 1px solid #e1e4e8; padding: 10px; overflow-x: auto; font-size: 12px;
      white-space: pre-wrap; word-break: break-word; }
figure { margin: 8px 0 24px; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 13px; } nav a { margin-right: 12px; font-size: 14px; }
.ok { color: #2a7d2a; } .bad { color: #b22; } .ref { color: #666; font-size: 12px; }
"""


def render_html(runs: list[RunData], plots: list[Plot]) -> str:
    """The whole page as one string (no external references)."""
    names = " vs ".join(run.name for run in runs)
    body = [
        f"<h1>opd report — {_e(names)}</h1>",
        _header(runs),
        _plot_nav(plots),
        "<h2>Final numbers</h2>",
        _final_table(runs),
        _teachers_section(runs, plots),
        "<h2>Config</h2>",
        _config_section(runs),
        "<h2>Plots</h2>",
        _plots_section(plots),
    ]
    body.append(_samples_section(runs))
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"{_TITLE}{_e(names)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


def _e(text: object) -> str:
    return html.escape(str(text))


def _fmt(value: float) -> str:
    return f"{value:.4g}" if value != 0 else "0"  # not "-0"


def _header(runs: list[RunData]) -> str:
    lines = [f'<div class="meta">generated {time.strftime("%Y-%m-%d %H:%M:%S")}</div>']
    for run in runs:
        where = f"<code>{_e(run.path)}</code> — {_e(_progress(run))}"
        lines.append(f'<div class="meta"><b>{_e(run.name)}</b>: {where}</div>')
    return "\n".join(lines)


def _progress(run: RunData) -> str:
    """'step 12 of 100 (metrics.jsonl updated 14:03:05)' — the run may still be going."""
    last = max((int(steps[-1]) for steps, _ in run.series.values()), default=None)
    section = (run.config or {}).get("run")
    planned = section.get("steps") if isinstance(section, dict) else None
    where = "no steps logged yet" if last is None else f"step {last}" + (f" of {planned}" if planned else "")
    if planned and last is not None and last >= planned:
        where += " (finished)"
    updated = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((run.path / "metrics.jsonl").stat().st_mtime))
    return f"{where}; metrics.jsonl updated {updated}"


def _plot_nav(plots: list[Plot]) -> str:
    links = " ".join(f'<a href="#plot-{p.name}">{_e(p.title)}</a>' for p in plots)
    return f"<nav>{links}</nav>" if links else ""


def _final_table(runs: list[RunData]) -> str:
    rows = final_rows(runs)
    if not rows:
        return "<p>No metrics logged yet.</p>"
    head = '<tr><th class="key">metric</th>' + "".join(f"<th>{_e(r.name)}</th>" for r in runs) + "</tr>"
    lines = [head]
    for key in rows:
        cells = []
        for run in runs:
            cells.append(_final_cell(run, key))
        lines.append(f'<tr><td class="key">{_e(key)}</td>{"".join(cells)}</tr>')
    note = (
        '<div class="meta">last logged value of each metric (@ the step it was logged at); evals: before → '
        "after, the first eval (step 0: the model before training) → the last, and the teacher where the run "
        "evaluated it; tool errors and sandbox refusals: the last step's, and their sum over the run.</div>"
    )
    return f'<table class="final">{"".join(lines)}</table>{note}'


def _final_cell(run: RunData, key: str) -> str:
    """A metric's last value; an eval's first → last value (before → after) and the teacher's."""
    last = last_value(run.series, key)
    if last is None:
        return "<td>—</td>"
    text = f'{_fmt(last[1])}<span class="step">@{last[0]}</span>'
    first = first_value(run.series, key) if EVAL_RE.match(key) else None
    if first is not None and first[0] != last[0]:
        text = f'{_fmt(first[1])}<span class="step">@{first[0]}</span> → {text}'
    if key in run.references:
        text += f' <span class="ref">(teacher {_fmt(run.references[key])})</span>'
    if key in RUN_TOTALS:
        text += f' <span class="ref">({_fmt(float(run.series[key][1].sum()))} over the run)</span>'
    return f"<td>{text}</td>"


def _teachers_section(runs: list[RunData], plots: list[Plot]) -> str:
    """Per run with teachers: its routing table, one row per teacher."""
    parts = []
    for run in runs:
        if not run.teachers:
            continue
        head = '<th class="key">teacher</th><th class="key">route</th><th class="key">placement</th>'
        head += '<th class="key">model</th><th>prompts</th><th>share</th>'
        rows = []
        for row in run.teachers:
            count, fraction = row.get("prompts"), row.get("fraction")
            share = f"{fraction:.1%}" if isinstance(fraction, (int, float)) else "—"
            cells = [row.get("name"), row.get("route", "—"), row.get("placement", "—"), row.get("model", "—")]
            rows.append(
                "<tr>"
                + "".join(f'<td class="key">{_e(c)}</td>' for c in cells)
                + f"<td>{_e(count if count is not None else '—')}</td><td>{_e(share)}</td></tr>"
            )
        title = f"<h3>{_e(run.name)}</h3>" if len(runs) > 1 else ""
        parts.append(f'{title}<table class="teachers"><tr>{head}</tr>{"".join(rows)}</table>')
    if not parts:
        return ""
    curves = any(plot.name == "teachers" for plot in plots)
    note = (
        '<div class="meta">which teacher scores which prompts (teachers.json, written when the run started): the '
        "prompts routed to each over the whole prompt set, its route, where it runs and its model"
        + ('; their curves: <a href="#plot-teachers">per-teacher metrics</a>' if curves else "")
        + ".</div>"
    )
    return "<h2>Teachers</h2>\n" + "\n".join(parts) + note


def _config_section(runs: list[RunData]) -> str:
    parts = []
    if len(runs) > 1:
        diffs = config_differences(runs)
        if diffs:
            head = '<tr><th class="key">config key</th>' + "".join(f"<th>{_e(r.name)}</th>" for r in runs) + "</tr>"
            rows = "".join(
                f'<tr><td class="key">{_e(k)}</td>' + "".join(f'<td class="key">{_e(v)}</td>' for v in vals) + "</tr>"
                for k, vals in diffs.items()
            )
            parts.append(f"<h3>Differences between runs</h3><table>{head}{rows}</table>")
    for run in runs:
        text = run.config_text if run.config_text is not None else "(no config.yaml in this run directory)"
        parts.append(f"<details><summary>{_e(run.name)}: config.yaml</summary><pre>{_e(text)}</pre></details>")
    return "\n".join(parts)


def _plots_section(plots: list[Plot]) -> str:
    if not plots:
        return "<p>Nothing to plot yet.</p>"
    figures = []
    for plot in plots:
        data = base64.b64encode(plot.png).decode("ascii")
        caption = f"<figcaption>{_e(plot.caption)} <i>({_e(plot.path.name)})</i></figcaption>"
        figures.append(
            f'<h3 id="plot-{plot.name}">{_e(plot.title)}</h3><figure>'
            f'<img alt="{_e(plot.title)}" data-group="{plot.name}" src="data:image/png;base64,{data}">'
            f"{caption}</figure>"
        )
    return "\n".join(figures)


def _samples_section(runs: list[RunData]) -> str:
    parts = []
    for run in runs:
        if not run.samples:
            continue
        parts.append(f"<h3>{_e(run.name)}: samples of step {run.samples_step}</h3>")
        parts.extend(_sample_details(i, sample) for i, sample in enumerate(run.samples))
    return "<h2>Latest samples</h2>\n" + "\n".join(parts) if parts else ""


def _sample_details(index: int, sample: dict) -> str:
    correct = sample.get("correct")
    verdict = (
        '<span class="ok">correct</span>'
        if correct is True
        else '<span class="bad">wrong</span>'
        if correct is False
        else "not graded"
    )
    token_rewards = sample.get("token_rewards")
    rewards = [r for r in token_rewards if isinstance(r, (int, float))] if isinstance(token_rewards, list) else []
    reward = f"; mean token reward {_fmt(sum(rewards) / len(rewards))}" if rewards else ""
    response = str(sample.get("response", ""))
    shown = response if len(response) <= SAMPLE_CHARS else response[:SAMPLE_CHARS] + f"\n… ({len(response)} chars)"
    prompt = str(sample.get("prompt", ""))[-800:]
    return (
        f"<details><summary>sample {index} — {verdict}{_e(reward)}</summary>"
        f'<div class="meta">prompt (end)</div><pre>{_e(prompt)}</pre>'
        f'<div class="meta">response</div><pre>{_e(shown)}</pre></details>'
    )
