"""Plots of a run's metrics as small PNGs: one file per group of related metrics, several runs overlaid.

Input is `metrics.jsonl` (training and eval lines, SPEC §6 keys) plus `eval/step_N/results.json`; any subset of
keys works, unknown numeric keys land in an "other" group, and a group without data is skipped. Long noisy curves
are drawn faint with an EMA on top; sparse ones (evals) with markers. Per-position-chunk metrics become heat maps
(step × chunk index) when some metric has a second chunk, i.e. the run had responses longer than one chunk.

Uses matplotlib's object API on the Agg canvas: no pyplot, so no global backend switch, no GUI, no shared state.
Where the time goes: one more figure stacks each step's phases (`time/*`: rollout, waits, teacher, student, update)
per run, marks the seconds a step spent compiling and the warm-up before the first step (`compile/*`), and draws the
share of the step's wall time a GPU kernel ran (`gpu/busy_frac`) where it was recorded: a slow phase shows without a
profiler. A run with tools (`episode/*` keys) gets an Episodes figure: turns and tool calls per episode, tool errors
and sandbox refusals, tool seconds against the step's time, the student's and the environment's tokens.
Omitted: interactive plots (the report is static and self-contained), confidence bands across seeds (one curve per
run directory).
"""

from __future__ import annotations

import io
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from opd.io import atomic_path, name_step, read_json_object, read_step_records

DPI = 80  # small PNGs: the report embeds every one of them (sizes in docs/performance.md)
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
LINESTYLES = ["-", "--", ":", "-."]
SENTINEL = 1e300  # the metrics sink writes ±inf as ±1e308; such points are dropped, not plotted
CHUNK_RE = re.compile(r"^(.+)/chunk_(\d+)$")
EVAL_RE = re.compile(r"^eval/(.+)/([^/]+)$")
TEACHER_RE = re.compile(r"^teacher/([^/]+)/(.+)$")  # per-teacher step metrics: teacher/<name>/<metric>

Series = dict[str, tuple[np.ndarray, np.ndarray]]  # key -> (steps [N] int, values [N] float), sorted by step


# ------------------------------------------------------------------------------------------------- loading


@dataclass
class RunSeries:
    """One run's curves under a display name (the run directory's name); references: constant lines to draw with
    them, {"eval/<benchmark>/<metric>": the teacher's value} (`load_references`)."""

    name: str
    series: Series
    references: dict[str, float] = field(default_factory=dict)


def load_series(run_dir: str | Path) -> Series:
    """Every numeric metric of a run as (steps, values), from `metrics.jsonl` and the eval results files.

    A partial last line (a run still appending) is skipped; None, booleans, strings and ±inf sentinels are dropped;
    when a key repeats at one step the last value wins. Eval results files only fill (step, key) pairs that
    `metrics.jsonl` lacks."""
    points: dict[str, dict[int, float]] = {}
    path = Path(run_dir) / "metrics.jsonl"
    for _, record in read_step_records(path):  # a line that is not an object with a step number: one line
        for key, value in record.items():
            if key != "step" and _is_number(value):
                points.setdefault(key, {})[record["step"]] = float(value)
    for step, flat in _eval_results(Path(run_dir)):
        for key, value in flat.items():
            points.setdefault(key, {}).setdefault(step, value)
    return {key: _sorted_arrays(by_step) for key, by_step in points.items() if by_step}


def _is_number(value: object) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and abs(value) < SENTINEL
    )


def _sorted_arrays(by_step: dict[int, float]) -> tuple[np.ndarray, np.ndarray]:
    steps = sorted(by_step)
    return np.array(steps, dtype=np.int64), np.array([by_step[s] for s in steps], dtype=np.float64)


def _eval_results(run_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, {"eval/<benchmark>/<metric>": value}) from `eval/step_N/results.json` (or `eval/step_N.json`); the
    student before training is step 0 (`eval/step_0/`, or `eval/student_before/` of demo runs made before the
    trainers evaluated at step 0)."""
    out = []
    for path in sorted(run_dir.glob("eval/step_*/results.json")) + sorted(run_dir.glob("eval/step_*.json")):
        step = name_step(path.parent if path.name == "results.json" else path)  # absurd: one line naming it
        flat = _results_file(path)
        if step is not None and flat:
            out.append((step, flat))
    if not any(step == 0 for step, _ in out):
        before = _results_file(run_dir / "eval" / "student_before" / "results.json")
        if before:
            out.append((0, before))
    return out


def _results_file(path: Path) -> dict[str, float]:
    """{"eval/<benchmark>/<metric>": value} of an `opd eval` results.json; {} when absent. Written atomically,
    so a file that does not parse or has another shape is damaged or not ours: a ValueError naming it."""
    if not path.is_file():
        return {}
    data = read_json_object(path)  # written atomically: damaged or not ours is one line naming it
    benchmarks = data.get("benchmarks", data)
    if not isinstance(benchmarks, dict) or not all(isinstance(summary, dict) for summary in benchmarks.values()):
        raise ValueError(f'{path}: not eval results ({{benchmark: {{metric: value}}}} under "benchmarks")')
    return {
        f"eval/{bench}/{key}": float(value)
        for bench, summary in benchmarks.items()
        if isinstance(summary, dict)
        for key, value in summary.items()
        if _is_number(value)
    }


def load_references(run_dir: str | Path) -> dict[str, float]:
    """The teacher's eval numbers, where the run evaluated it (`eval/teacher/results.json`, as `opd demo` writes):
    {"eval/<benchmark>/<metric>": value}, drawn as reference lines on the accuracy plots."""
    return _results_file(Path(run_dir) / "eval" / "teacher" / "results.json")


# ------------------------------------------------------------------------------------------------- groups


@dataclass
class Panel:
    """One subplot: the metric keys drawn on it (those a run lacks are left out)."""

    title: str
    keys: list[str]
    ylabel: str = ""
    strip: str = ""  # prefix removed from keys in the legend
    logy: bool = False
    smooth: bool = True  # False for counters and schedules, where an EMA would invent a ramp
    strip_end: str = ""  # suffix removed from keys in the legend

    def label(self, key: str) -> str:
        key = key[len(self.strip) :] if self.strip and key.startswith(self.strip) else key
        return key[: -len(self.strip_end)] if self.strip_end and key.endswith(self.strip_end) else key


@dataclass
class Group:
    """One PNG: a title and a function from the available keys to the panels worth drawing."""

    name: str
    title: str
    panels: Callable[[set[str]], list[Panel]]
    caption: str = ""


@dataclass
class Plot:
    """A rendered group: where the PNG was written and its bytes (for embedding)."""

    name: str
    title: str
    path: Path
    png: bytes
    caption: str = ""
    keys: list[str] = field(default_factory=list)


def _static(*panels: Panel) -> Callable[[set[str]], list[Panel]]:
    """Fixed panels, each reduced to the keys that exist; empty panels dropped."""

    def build(available: set[str]) -> list[Panel]:
        kept = []
        for panel in panels:
            keys = [k for k in panel.keys if k in available]
            if keys:
                kept.append(
                    Panel(panel.title, keys, panel.ylabel, panel.strip, panel.logy, panel.smooth, panel.strip_end)
                )
        return kept

    return build


def _accuracy_panels(available: set[str]) -> list[Panel]:
    """One panel per eval benchmark (avg@n and pass@1), then the training rollouts' accuracy."""
    by_bench: dict[str, list[str]] = {}
    for key in sorted(available):
        match = EVAL_RE.match(key)
        if match and (match.group(2).startswith("avg@") or match.group(2) == "pass@1"):
            by_bench.setdefault(match.group(1), []).append(key)
    panels = [Panel(f"eval: {bench}", keys, "accuracy", strip=f"eval/{bench}/") for bench, keys in by_bench.items()]
    if "rollout_accuracy" in available:
        panels.append(Panel("training rollouts (graded)", ["rollout_accuracy"], "accuracy"))
    return panels


def _timing_panels(available: set[str]) -> list[Panel]:
    phases: list[str] = [k for k in ("time/rollout", "time/teacher", "time/student", "time/update") if k in available]
    phases += sorted(
        k for k in available if k.startswith("time/") and k not in phases and k != "time/step" and not CHUNK_RE.match(k)
    )
    panels = [Panel("time per phase of a step", phases, "seconds", strip="time/")] if phases else []
    if "time/step" in available:
        panels.append(Panel("time per step", ["time/step"], "seconds"))
    if "tokens_per_second" in available:
        panels.append(Panel("throughput", ["tokens_per_second"], "response tokens / s"))
    return panels


# the per-teacher metrics (opd.train.teachers.teacher_metrics) in this order, then any other; (title, y label)
TEACHER_METRICS = {
    "token_frac": ("share of the step's response tokens", "fraction"),
    "reward_mean": ("token reward over its tokens", "nats"),
    "rollout_accuracy": ("rollout accuracy of its prompts (graded)", "accuracy"),
}


def _teacher_panels(available: set[str]) -> list[Panel]:
    """One panel per per-teacher metric, one line per teacher (`teacher/<name>/<metric>`)."""
    by_metric: dict[str, list[str]] = {}
    for key in sorted(available):
        if match := TEACHER_RE.match(key):
            by_metric.setdefault(match.group(2), []).append(key)
    order = [m for m in TEACHER_METRICS if m in by_metric] + sorted(set(by_metric) - set(TEACHER_METRICS))
    panels = []
    for metric in order:
        title, ylabel = TEACHER_METRICS.get(metric, (metric, ""))
        panels.append(
            Panel(
                f"{metric}: {title}" if title != metric else metric,
                by_metric[metric],
                ylabel,
                "teacher/",
                strip_end=f"/{metric}",
            )
        )
    return panels


# the episode metrics (`opd.rollout.episodes.EpisodeOutput.metrics`, runs with rollout.tools) the Episodes panels draw;
# any other `episode/*` key gets a panel of its own there
EPISODE_PANELS = (
    Panel(
        "turns and tool calls per episode", ["episode/turns_mean", "episode/tool_calls_mean"], "per episode", "episode/"
    ),
    Panel(
        "tool errors and sandbox refusals (the step's episodes)",
        ["episode/tool_errors", "episode/sandbox_refusals"],
        "calls",
        "episode/",
        smooth=False,
    ),
    Panel(
        "tool seconds against the step's time",
        ["episode/tool_seconds", "episode/tool_wall_seconds", "time/rollout", "time/step"],
        "seconds",
    ),
    Panel(
        "student vs environment tokens per episode",
        ["episode/student_tokens_mean", "episode/env_tokens_mean"],
        "tokens",
        "episode/",
        strip_end="_mean",
    ),
    Panel(
        "context prefilled again at later turns (wasted: without continuation)",
        ["episode/repeated_prefill_tokens", "episode/wasted_prefill_tokens"],
        "tokens",
    ),
)
EPISODE_KEYS = frozenset(k for panel in EPISODE_PANELS for k in panel.keys if k.startswith("episode/"))


def _episode_panels(available: set[str]) -> list[Panel]:
    """The Episodes panels of a run with tools (some `episode/*` key logged; none otherwise, so the step times
    alone draw nothing here), then one per unknown `episode/*` key."""
    if not any(k.startswith("episode/") for k in available):
        return []
    panels = _static(*EPISODE_PANELS)(available)
    extra = sorted(k for k in available if k.startswith("episode/") and k not in EPISODE_KEYS)
    return panels + [Panel(key, [key]) for key in extra]


GROUPS: list[Group] = [
    Group(
        "accuracy",
        "Accuracy",
        _accuracy_panels,
        "Eval sets (avg@n, pass@1) at their steps, from step 0 (the student before training); dotted: the "
        "teacher, where the run evaluated it; training rollout accuracy every step.",
    ),
    Group(
        "overlap_ratio",
        "Top-k overlap ratio",
        _static(
            Panel("overlap ratio (mean over t, k of [S_t,k ∈ T_t])", ["overlap_ratio"], "fraction of student top-k")
        ),
        "How much of the student's top-k the teacher's top-k shares (SPEC §6).",
    ),
    Group(
        "shared_mass",
        "Shared probability mass",
        _static(
            Panel(
                "mass on the overlap I_t = S_t ∩ T_t",
                ["overlap_mass_student", "overlap_mass_teacher"],
                "probability",
                strip="overlap_mass_",
            ),
            Panel(
                "mass on each model's own top-k",
                ["topk_mass_student", "topk_mass_teacher"],
                "probability",
                strip="topk_mass_",
            ),
        ),
        "Probability each model puts on the shared top-k tokens; the paper reports 97–99% once aligned.",
    ),
    Group(
        "overlap_advantage",
        "Overlap advantage",
        _static(Panel("overlap advantage (≤ 0, → 0 as the student aligns)", ["overlap_advantage"], "nats")),
        "Mean over positions of −KL(p̄‖q̄)/|I_t| on the renormalised overlap.",
    ),
    Group(
        "entropy",
        "Entropies",
        _static(
            Panel("token entropy", ["entropy_student", "entropy_teacher"], "nats", strip="entropy_"),
            Panel("entropy gap mean |H_teacher − H_student|", ["entropy_gap"], "nats"),
        ),
        "Full-vocabulary entropies on the student's rollouts.",
    ),
    Group(
        "rewards",
        "Rewards and advantages",
        _static(
            Panel("token reward", ["reward_mean", "reward_abs_mean"], "nats", strip="reward_"),
            Panel("advantage", ["advantage_mean", "advantage_abs_mean"], "", strip="advantage_"),
            Panel("sequence reward mean_t (t − s)", ["seq_reward_mean"], "nats"),
            Panel("sequence-reward AUROC (correct vs wrong)", ["seq_reward_auroc"], "AUROC"),
            Panel("valid candidate slots per token", ["valid_slots_per_token"], "slots"),
        ),
        "Per-position rewards Σ_j r_t,j and advantages on valid tokens; AUROC needs verifiable answers.",
    ),
    Group(
        "optimisation",
        "Gradient norm, skipped steps, learning rate",
        _static(
            Panel("grad norm (before clipping)", ["grad_norm"], "L2 norm", logy=True),
            Panel("skipped steps (non-finite grads, cumulative)", ["skipped_steps"], "steps", smooth=False),
            Panel("learning rate", ["lr"], "lr", smooth=False),
        ),
        "",
    ),
    Group(
        "length",
        "Response length and truncation",
        _static(
            Panel("response length", ["response_length"], "tokens"),
            Panel("truncation rate (hit max_new_tokens)", ["truncation_rate"], "fraction"),
        ),
        "",
    ),
    Group(
        "episodes",
        "Episodes",
        _episode_panels,
        "Runs with tools (rollout.tools): turns and tool calls per episode (means over the step's episodes); the "
        "calls that failed (tool_errors, malformed calls included) and that the sandbox refused or stopped, summed "
        "over the step; the tools' seconds (summed over calls, and the wall time the batch waited for them) against "
        "the step's rollout phase and the whole step; the student's and the environment's tokens per episode (the "
        "environment's are out of the loss); the context tokens the engine prefilled again at later turns.",
    ),
    Group(
        "teachers",
        "Per-teacher metrics",
        _teacher_panels,
        "One line per teacher (teachers: routed by prompt): its share of each step's response tokens, the token reward "
        "over its tokens, the graded accuracy of the rollouts of its prompts.",
    ),
    Group("timing", "Phase timings and throughput", _timing_panels, "Wall-clock seconds per phase of one step."),
    Group(
        "loss",
        "Loss",
        _static(Panel("policy-gradient loss", ["pg_loss"], "loss"), Panel("loss", ["loss"], "loss")),
        "pg_loss for OPD/GRPO, loss (token-mean cross-entropy) for SFT.",
    ),
]
OTHER_MAX_PANELS = 12
CHUNK_GROUP = Group(
    "chunks",
    "Per-position chunks",
    lambda _: [],
    "Each metric per chunk of response positions (rows: chunk index, 0 = start of the response) "
    "over training steps; grey = no positions that far.",
)


# keys some fixed group above draws; any other numeric key (not eval/, time/, episode/, teacher/ or a chunk) goes to
# "other"
CLAIMED = frozenset(
    {
        "overlap_ratio",
        "overlap_mass_student",
        "overlap_mass_teacher",
        "topk_mass_student",
        "topk_mass_teacher",
        "overlap_advantage",
        "entropy_student",
        "entropy_teacher",
        "entropy_gap",
        "reward_mean",
        "reward_abs_mean",
        "advantage_mean",
        "advantage_abs_mean",
        "seq_reward_mean",
        "seq_reward_auroc",
        "valid_slots_per_token",
        "grad_norm",
        "skipped_steps",
        "lr",
        "response_length",
        "truncation_rate",
        "tokens_per_second",
        "pg_loss",
        "loss",
        "rollout_accuracy",
        "compile/warm_up_s",  # the phase chart's
        "compile/warm_up_graphs",
        "compile/cache_hits",
        "compile/cache_misses",
        "gpu/busy_frac",
    }
)


def _other_panels(available: set[str]) -> list[Panel]:
    keys = sorted(
        k
        for k in available
        if k not in CLAIMED
        and not k.startswith(("eval/", "time/", "episode/"))  # episode/*: the Episodes group draws them all
        and not TEACHER_RE.match(k)
        and not CHUNK_RE.match(k)
    )
    return [Panel(key, [key]) for key in keys[:OTHER_MAX_PANELS]]


# ------------------------------------------------------------------------------------------------- drawing


def render_plots(runs: list[RunSeries], out_dir: str | Path) -> list[Plot]:
    """Draw every group that has data into `out_dir/<group>.png` (written atomically); return them in order."""
    out_dir = Path(out_dir)
    available = set().union(*(run.series for run in runs)) if runs else set()
    groups = GROUPS + [Group("other", "Other metrics", _other_panels, "Numeric keys no group above claims.")]
    plots = []
    for group in groups:
        panels = group.panels(available)
        if panels:
            fig = _line_figure(group.title, panels, runs)
            plots.append(_save(fig, out_dir, group, [k for p in panels for k in p.keys]))
    if phases := phase_keys(available):
        keys = phases + [k for k in PHASE_EXTRAS if k in available]
        plots.append(_save(_phase_figure(runs), out_dir, PHASE_GROUP, keys))
    metrics = chunk_metrics(available)
    if metrics:
        plots.append(_save(_chunk_figure(metrics, runs), out_dir, CHUNK_GROUP, metrics))
    return plots


# ------------------------------------------------------------------------------------------ where the time goes

# a step's phases (`opd.train.step`'s `time/*`: they add up to `time/step`), bottom to top, with their colours
PHASES = {
    "time/rollout": "#1f77b4",
    "time/rollout_wait": "#aec7e8",
    "time/teacher": "#ff7f0e",
    "time/student": "#2ca02c",
    "time/update": "#d62728",
}
PHASE_GROUP = Group(
    "phases",
    "Where the time goes",
    lambda _: [],
    "Each step's wall time stacked by phase (time/*; rollout_wait: the step waiting for a rollout made in the "
    "background), the seconds of it spent compiling (black, compile/seconds; the warm-up before a process's first "
    "step in words, compile/warm_up_s), and the share of the step a GPU kernel ran (gpu/busy_frac, right axis) where "
    "recorded.",
)
# what the chart draws besides the phases
PHASE_EXTRAS = ("compile/seconds", "compile/warm_up_s", "compile/warm_up_graphs", "compile/cache_hits", "gpu/busy_frac")


def phase_keys(available: set[str]) -> list[str]:
    """The `time/*` phases present, in the stacking order: the known ones first, then any other (sorted)."""
    known = [k for k in PHASES if k in available]
    extra = sorted(
        k for k in available if k.startswith("time/") and k not in PHASES and k != "time/step" and not CHUNK_RE.match(k)
    )
    return known + extra


def step_compile_seconds(series: Series) -> tuple[np.ndarray, np.ndarray] | None:
    """Seconds each step spent compiling: the step-to-step rise of `compile/seconds` (torch's compile time since the
    process started). A process's first step is left out (its figure holds the warm-up, `compile/warm_up_s`), and so
    is the first after a fall (a resume: a new process). None where the run did not log it."""
    if "compile/seconds" not in series:
        return None
    steps, total = series["compile/seconds"]
    rises = np.diff(total)
    kept = rises >= 0
    return steps[1:][kept], rises[kept]


def _phase_figure(runs: list[RunSeries]) -> Figure:
    shown = [run for run in runs if phase_keys(set(run.series))]
    nrows, ncols = _grid(len(shown))
    width = 5.6 * ncols if ncols > 1 else 7.5
    fig = _figure(width, 3.3 * nrows + 0.4, PHASE_GROUP.title)
    fig.subplots_adjust(right=1 - 0.7 / width, wspace=0.45)  # room for the GPU-busy axis on the right
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, run in zip(axes, shown):
        _draw_phases(ax, run)
    for ax in axes[len(shown) :]:
        ax.set_visible(False)
    return fig


def _draw_phases(ax, run: RunSeries) -> None:
    """One run: its phases stacked per step (bars of one step's width), compiling and GPU busy over them."""
    keys = phase_keys(set(run.series))
    steps = np.unique(np.concatenate([run.series[k][0] for k in keys]))
    bottom = np.zeros(len(steps))
    for i, key in enumerate(keys):
        values = np.zeros(len(steps))
        key_steps, key_values = run.series[key]
        values[np.searchsorted(steps, key_steps)] = key_values
        color = PHASES.get(key, COLORS[(i + 5) % len(COLORS)])
        ax.fill_between(steps, bottom, bottom + values, step="mid", color=color, linewidth=0, label=key[5:])
        bottom = bottom + values
    compiles = step_compile_seconds(run.series)
    if compiles is not None and compiles[1].max(initial=0.0) > 0:
        ax.step(compiles[0], compiles[1], where="mid", color="black", linewidth=1.2, label="compiling")
    title = run.name if len(run.name) <= 60 else run.name[:57] + "…"
    if "compile/warm_up_s" in run.series:  # as words, not a bar: minutes of warm-up would flatten the steps
        title += "\n" + _warm_up_words(run.series)
    ax.set_title(title, fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)  # room for the legend above the bars
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if "gpu/busy_frac" in run.series:
        busy = ax.twinx()
        busy_steps, busy_frac = run.series["gpu/busy_frac"]
        (line,) = busy.plot(busy_steps, busy_frac, color="#9467bd", linestyle="--", linewidth=1.4, label="GPU busy")
        busy.set_ylim(0, 1.35)
        busy.set_yticks([0, 0.25, 0.5, 0.75, 1.0])
        busy.set_ylabel("GPU busy (fraction)")
        handles, labels = [*handles, line], [*labels, "GPU busy"]
    ax.legend(handles, labels, fontsize=7, loc="upper left", ncol=4)


def _warm_up_words(series: Series) -> str:
    """The warm-ups before a process's first step: "warm-up 95 s (60 graphs, 58 loaded from the compile cache)"
    for the last one, "+ N more" when the run resumed."""
    steps, seconds = series["compile/warm_up_s"]
    at = int(steps[-1])
    words = f"warm-up before step {at}: {seconds[-1]:.0f} s"
    counts = {k: _value_at(series, f"compile/{k}", at) for k in ("warm_up_graphs", "cache_hits", "cache_misses")}
    if counts["warm_up_graphs"] is not None:
        words += f" ({counts['warm_up_graphs']:.0f} graphs"
        if counts["cache_hits"] is not None and counts["cache_misses"] is not None:
            words += f"; inductor: {counts['cache_hits']:.0f} loaded, {counts['cache_misses']:.0f} compiled"
        words += ")"
    return words + (f"; {len(steps) - 1} earlier" if len(steps) > 1 else "")


def _value_at(series: Series, key: str, step: int) -> float | None:
    if key not in series:
        return None
    steps, values = series[key]
    hits = np.flatnonzero(steps == step)
    return float(values[hits[-1]]) if len(hits) else None


def _save(fig: Figure, out_dir: Path, group: Group, keys: list[str]) -> Plot:
    buffer = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buffer)
    png = buffer.getvalue()
    path = out_dir / f"{group.name}.png"
    with atomic_path(path, suffix=".png") as tmp:
        tmp.write_bytes(png)
    return Plot(group.name, group.title, path, png, group.caption, keys)


def _grid(count: int) -> tuple[int, int]:
    ncols = 1 if count == 1 else 2 if count in (2, 4) else 3
    return math.ceil(count / ncols), ncols


def _figure(width: float, height: float, title: str) -> Figure:
    """A figure with fixed margins in inches: matplotlib's constrained layout would double the drawing time."""
    fig = Figure(figsize=(width, height), dpi=DPI)
    fig.subplots_adjust(
        left=0.8 / width, right=1 - 0.25 / width, bottom=0.55 / height, top=1 - 0.7 / height, wspace=0.32, hspace=0.5
    )
    fig.suptitle(title, fontsize=13, fontweight="bold", y=1 - 0.12 / height, va="top")
    return fig


def _line_figure(title: str, panels: list[Panel], runs: list[RunSeries]) -> Figure:
    nrows, ncols = _grid(len(panels))
    fig = _figure(5.2 * ncols if ncols > 1 else 7.5, 3.3 * nrows + 0.4, title)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    for ax, panel in zip(axes, panels):
        _draw_panel(ax, panel, runs)
    for ax in axes[len(panels) :]:
        ax.set_visible(False)
    return fig


def _draw_panel(ax, panel: Panel, runs: list[RunSeries]) -> None:
    """Colour = run when comparing runs (line style = key), else colour = key."""
    multi = len(runs) > 1
    labelled = multi or len(panel.keys) > 1
    for r, run in enumerate(runs):
        for k, key in enumerate(panel.keys):
            if key not in run.series:
                continue
            steps, values = run.series[key]
            color = COLORS[(r if multi else k) % len(COLORS)]
            style = LINESTYLES[k % len(LINESTYLES)] if multi else "-"
            parts = ([run.name] if multi else []) + ([panel.label(key)] if len(panel.keys) > 1 else [])
            _plot_curve(ax, steps, values, color, style, ": ".join(parts) if labelled else None, panel.smooth)
    for r, run in enumerate(runs):
        for k, key in enumerate(panel.keys):
            if key in run.references:
                color = COLORS[(r if multi else k) % len(COLORS)]
                parts = ([run.name] if multi else []) + ([panel.label(key)] if len(panel.keys) > 1 else [])
                ax.axhline(
                    run.references[key], color=color, linestyle=":", linewidth=1.4, label=": ".join([*parts, "teacher"])
                )
                labelled = True
    if panel.logy and _positive_wide(panel.keys, runs):
        ax.set_yscale("log")
    else:
        ax.ticklabel_format(axis="y", useOffset=False)  # "900.4", not "0.4 + 9e2"
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if labelled:
        ax.legend(fontsize=8, loc="best", framealpha=0.7)


def _plot_curve(
    ax, steps: np.ndarray, values: np.ndarray, color: str, style: str, label: str | None, smooth: bool = True
) -> None:
    """Sparse curves (evals, short runs) with markers; long ones faint raw plus an EMA."""
    if len(steps) <= 30:
        ax.plot(steps, values, color=color, linestyle=style, marker="o", markersize=3.5, linewidth=1.5, label=label)
    elif len(steps) <= 80 or not smooth:
        ax.plot(steps, values, color=color, linestyle=style, linewidth=1.4, label=label)
    else:
        ax.plot(steps, values, color=color, linestyle="-", linewidth=0.8, alpha=0.25)
        ax.plot(
            steps,
            ema(values, span=min(50, max(2, len(values) // 25))),
            color=color,
            linestyle=style,
            linewidth=1.6,
            label=label,
        )


def ema(values: np.ndarray, span: int) -> np.ndarray:
    """Exponential moving average with weight 2/(span+1), started at the first value (no bias correction)."""
    alpha, out = 2.0 / (span + 1.0), np.empty_like(values)
    out[0] = values[0]
    for i in range(1, len(values)):
        out[i] = alpha * values[i] + (1 - alpha) * out[i - 1]
    return out


def _positive_wide(keys: list[str], runs: list[RunSeries]) -> bool:
    """Log scale only when all values are positive and span more than two decades."""
    values = np.concatenate([run.series[k][1] for run in runs for k in keys if k in run.series] or [np.zeros(0)])
    return bool(values.size and values.min() > 0 and values.max() / values.min() > 100)


# ------------------------------------------------------------------------------------------------- heat maps

CHUNK_ORDER = [
    "overlap_ratio",
    "overlap_mass_student",
    "overlap_mass_teacher",
    "overlap_advantage",
    "topk_mass_student",
    "topk_mass_teacher",
    "entropy_student",
    "entropy_teacher",
    "entropy_gap",
    "reward_mean",
    "reward_abs_mean",
]


def chunk_metrics(available: set[str]) -> list[str]:
    """Base names of metrics logged per position chunk, when some run has more than one chunk of them."""
    names = {m.group(1) for k in available if (m := CHUNK_RE.match(k)) and m.group(2) == "1"}
    return [n for n in CHUNK_ORDER if n in names] + sorted(names - set(CHUNK_ORDER))


def chunk_grid(series: Series, metric: str) -> tuple[np.ndarray, np.ndarray] | None:
    """(steps [S], values [C, S]) of `metric/chunk_c`; NaN where a step had no positions in chunk c."""
    chunks = sorted(int(m.group(2)) for k in series if (m := CHUNK_RE.match(k)) and m.group(1) == metric)
    if not chunks:
        return None
    steps = np.unique(np.concatenate([series[f"{metric}/chunk_{c}"][0] for c in chunks]))
    grid = np.full((chunks[-1] + 1, len(steps)), np.nan)
    for c in chunks:
        s, v = series[f"{metric}/chunk_{c}"]
        grid[c, np.searchsorted(steps, s)] = v
    return steps, grid


def _edges(centers: np.ndarray) -> np.ndarray:
    if len(centers) == 1:
        return np.array([centers[0] - 0.5, centers[0] + 0.5])
    mid = (centers[1:] + centers[:-1]) / 2
    return np.concatenate([[2 * centers[0] - mid[0]], mid, [2 * centers[-1] - mid[-1]]])


def _chunk_figure(metrics: list[str], runs: list[RunSeries]) -> Figure:
    """Single run: a grid of metrics. Several runs: one row per metric, one column per run, a shared colour scale."""
    multi = len(runs) > 1
    cells = [(m, run) for m in metrics for run in runs]
    nrows, ncols = (len(metrics), len(runs)) if multi else _grid(len(metrics))
    fig = _figure(4.8 * ncols, 2.8 * nrows + 0.5, "Per-position-chunk metrics (step × chunk)")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    scales = {m: _range([chunk_grid(run.series, m) for run in runs]) for m in metrics}
    for ax, (metric, run) in zip(axes, cells):
        _draw_heatmap(fig, ax, metric, run, scales[metric], multi)
    for ax in axes[len(cells) :]:
        ax.set_visible(False)
    return fig


def _range(grids: list) -> tuple[float, float]:
    values = np.concatenate([g[1][np.isfinite(g[1])] for g in grids if g is not None] or [np.zeros(1)])
    low, high = (float(values.min()), float(values.max())) if values.size else (0.0, 1.0)
    return (low, high) if high > low else (low - 0.5, high + 0.5)


def _draw_heatmap(fig: Figure, ax, metric: str, run: RunSeries, scale: tuple[float, float], multi: bool) -> None:
    ax.set_title(f"{metric} — {run.name}" if multi else metric, fontsize=10)
    ax.set_facecolor("#dddddd")
    found = chunk_grid(run.series, metric)
    if found is None:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
        return
    steps, grid = found
    mesh = ax.pcolormesh(
        _edges(steps.astype(float)),
        np.arange(grid.shape[0] + 1) - 0.5,
        np.ma.masked_invalid(grid),
        cmap="viridis",
        vmin=scale[0],
        vmax=scale[1],
        shading="flat",
    )
    fig.colorbar(mesh, ax=ax, pad=0.02, fraction=0.06)
    ax.set_xlabel("step")
    ax.set_ylabel("position chunk")
    if grid.shape[0] <= 12:
        ax.set_yticks(range(grid.shape[0]))
