"""`opd report`: synthetic run directories in, a self-contained report.html with decodable, non-blank plots out."""

from __future__ import annotations

import base64
import io
import json
import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from features.test_distill_tools import _config as tool_run_config
from features.test_distill_tools import tool_world  # noqa: F401  (the fixture: a student that calls the calculator)
from helpers import distill_config, one_line, run_in_process, string_console
from opd.io import read_jsonl
from opd.recipes.distill import setup, train
from opd.report import write_report
from opd.report.plots import RunSeries, chunk_grid, load_series, phase_keys, render_plots, step_compile_seconds

GROUPS = [
    "accuracy",
    "overlap_ratio",
    "shared_mass",
    "overlap_advantage",
    "entropy",
    "rewards",
    "optimisation",
    "length",
    "timing",
    "loss",
    "phases",
    "chunks",
]


def make_run_dir(
    path: Path, *, steps: int = 20, seed: int = 0, chunks: int = 3, eval_every: int = 5, lr: float = 1e-6
) -> Path:
    """A fake `opd distill` run: config.yaml, metrics.jsonl (training lines + eval lines), eval results, samples."""
    rng = random.Random(seed)
    path.mkdir(parents=True)
    config = {
        "run": {"name": path.name, "steps": steps, "seed": seed},
        "objective": {"top_k": 16, "strategy": "only_stu"},
        "optim": {"lr": lr},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    lines = []
    for step in range(1, steps + 1):
        p = step / steps
        m = {
            "step": step,
            "grad_norm": 1 + rng.random(),
            "lr": lr,
            "skipped_steps": int(step > 15),
            "pg_loss": -0.1 * p,
            "reward_mean": -0.5 + 0.4 * p,
            "reward_abs_mean": 0.6 - 0.3 * p,
            "advantage_mean": 0.01 * rng.random(),
            "advantage_abs_mean": 0.2,
            "overlap_mass_student": 0.8 + 0.15 * p,
            "overlap_mass_teacher": 0.85 + 0.1 * p,
            "overlap_advantage": -0.3 * (1 - p),
            "entropy_student": 1.2 - 0.4 * p,
            "entropy_teacher": 0.9,
            "entropy_gap": 0.3 * (1 - p),
            "seq_reward_mean": -0.4 + 0.3 * p,
            "seq_reward_auroc": 0.5 + 0.3 * p,
            "response_length": 300 + 10 * step,
            "truncation_rate": 0.1,
            "rollout_accuracy": 0.2 + 0.5 * p,
            "time/rollout": 1.0,
            "time/teacher": 0.4,
            "time/student": 0.3,
            "time/update": 0.8,
            "time/step": 2.5,
            "tokens_per_second": 900 + rng.random(),
            "overlap_ratio": 0.5 + 0.4 * p,
            "unknown_key": "text",
            "missing": None,
            "valid_slots_per_token": 16.0,
        }
        for c in range(chunks if step % 4 else chunks - 1):  # some steps have shorter responses: fewer chunks
            m[f"overlap_ratio/chunk_{c}"] = 0.5 + 0.4 * p - 0.05 * c
            m[f"entropy_gap/chunk_{c}"] = 0.3 * (1 - p) + 0.02 * c
        lines.append(json.dumps(m))
        if step % eval_every == 0:
            evals = {
                "eval/lab/avg@4": 0.3 + 0.5 * p,
                "eval/lab/pass@1": 0.3 + 0.5 * p,
                "eval/math500/avg@4": 0.2 + 0.3 * p,
            }
            lines.append(json.dumps({"step": step, **evals}))
            results = {"model": "x", "benchmarks": {"lab": {"avg@4": evals["eval/lab/avg@4"], "n_problems": 8}}}
            (path / "eval" / f"step_{step}").mkdir(parents=True)
            (path / "eval" / f"step_{step}" / "results.json").write_text(json.dumps(results))
    (path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (path / "samples").mkdir()
    sample = {
        "step": steps,
        "prompt": "What is 2+2? <b>",
        "response": "4 \\boxed{4}",
        "correct": True,
        "tokens": ["4"],
        "token_rewards": [-0.1],
    }
    (path / "samples" / f"step_{steps}.jsonl").write_text(json.dumps(sample) + "\n")
    return path


def embedded_images(html: str) -> dict[str, Image.Image]:
    """group name → decoded PNG of every embedded plot."""
    found = re.findall(r'data-group="([\w-]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    return {name: Image.open(io.BytesIO(base64.b64decode(data))) for name, data in found}


def is_blank(image: Image.Image) -> bool:
    low, high = image.convert("L").getextrema()
    return low == high


@pytest.mark.slow
def test_single_run_report_has_every_group(tmp_path):
    run = make_run_dir(tmp_path / "opd-run")
    path = write_report([run])
    assert path == run / "report.html"
    html = path.read_text()
    images = embedded_images(html)
    assert sorted(images) == sorted(GROUPS)
    for name, image in images.items():
        image.load()
        assert image.format == "PNG" and not is_blank(image), name
        assert (run / "plots" / f"{name}.png").is_file()
        assert (run / "plots" / f"{name}.png").stat().st_size < 300_000
    assert "<details><summary>opd-run: config.yaml</summary>" in html and "strategy: only_stu" in html
    final = html[html.index('<table class="final">') :]
    final = final[: final.index("</table>")]
    for key in ("eval/lab/avg@4", "eval/math500/avg@4", "rollout_accuracy", "overlap_ratio", "pg_loss"):
        assert key in final
    assert "0.8<span" in final  # last eval of lab avg@4 is 0.3 + 0.5 = 0.8
    assert "step 20 of 20 (finished)" in html
    assert "&lt;b&gt;" in html and "<b>\n" not in html  # sample text is escaped
    assert 'src="http' not in html and 'href="http' not in html  # self-contained


@pytest.mark.slow
def test_two_runs_compare_overlaid(tmp_path):
    a = make_run_dir(tmp_path / "baseline", seed=1)
    b = make_run_dir(tmp_path / "ablation", seed=2, lr=2e-6)
    path = write_report([a, b])
    assert path == a / "compare" / "report.html"
    html = path.read_text()
    assert "baseline vs ablation" in html
    assert html.count("<th>baseline</th>") >= 1 and html.count("<th>ablation</th>") >= 1
    assert "optim.lr" in html  # differing config keys listed
    images = embedded_images(html)
    assert set(GROUPS) <= set(images) and not any(is_blank(i) for i in images.values())
    assert (a / "compare" / "plots" / "overlap_ratio.png").is_file()
    assert not (a / "report.html").exists()  # the single run's report is left alone


def test_a_report_replaces_only_a_report(tmp_path):
    """Rerunning a report replaces it (and its plots); another program's HTML file, or a plots/ directory no report
    owns beside an --out path, is refused in one line and left as it was."""
    run = make_run_dir(tmp_path / "run")
    first = write_report([run])
    assert write_report([run]) == first  # a rerun regenerates its own report
    page = tmp_path / "site" / "index.html"
    page.parent.mkdir()
    page.write_text("<html>my page</html>")
    with pytest.raises(ValueError, match=r"index.html: exists and is not an opd report; choose another --out"):
        write_report([run], page)
    assert page.read_text() == "<html>my page</html>"
    (tmp_path / "pics" / "plots").mkdir(parents=True)
    (tmp_path / "pics" / "plots" / "loss.png").write_bytes(b"mine")
    with pytest.raises(ValueError, match=r"pics/plots: exists beside new.html and no opd report there owns it"):
        write_report([run], tmp_path / "pics" / "new.html")
    assert (tmp_path / "pics" / "plots" / "loss.png").read_bytes() == b"mine"
    mine = write_report([run], tmp_path / "cmp" / "a.html")
    assert write_report([run], tmp_path / "cmp" / "b.html").parent == mine.parent  # the plots are a report's


def test_few_keys_sft_like_run(tmp_path):
    run = tmp_path / "sft"
    run.mkdir()
    records = [
        {"step": s, "loss": 2.0 / s, "lr": 1e-5, "grad_norm": None, "tokens_per_second": 1000, "custom": s}
        for s in range(1, 6)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    html = write_report([run]).read_text()
    images = embedded_images(html)
    assert write_report([run], out=tmp_path / "elsewhere") == tmp_path / "elsewhere" / "report.html"
    assert (tmp_path / "elsewhere" / "plots" / "loss.png").is_file()
    assert {"loss", "timing", "optimisation", "other"} <= set(images)
    assert not {"accuracy", "chunks", "overlap_ratio", "entropy"} & set(images)
    assert "no config.yaml" in html


@pytest.mark.slow
def test_partial_last_line_and_empty_run(tmp_path):
    run = make_run_dir(tmp_path / "live", steps=8)
    with open(run / "metrics.jsonl", "a") as handle:
        handle.write('{"step": 9, "overlap_ratio": 0.')  # an append in progress
    html = write_report([run]).read_text()
    assert "step 8 of 8" in html
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    assert "No metrics logged yet" in write_report([empty]).read_text()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        write_report([tmp_path / "missing"])


def test_series_drop_non_numbers_and_sentinels(tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    lines = [
        {"step": 1, "grad_norm": 1e308, "x": True, "y": "s"},
        {"step": 2, "grad_norm": 2.0},
        {"step": 2, "eval/lab/avg@4": 0.5},
        {"step": 3, "overlap_ratio/chunk_2": 0.1},
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (run / "eval" / "step_4").mkdir(parents=True)
    (run / "eval" / "step_4" / "results.json").write_text(json.dumps({"benchmarks": {"aime": {"avg@4": 0.25}}}))
    (run / "eval" / "step_2.json").write_text(json.dumps({"benchmarks": {"lab": {"avg@4": 0.9}}}))
    series = load_series(run)
    assert series["eval/aime/avg@4"][0].tolist() == [4]
    assert series["eval/lab/avg@4"][1].tolist() == [0.5]  # metrics.jsonl wins over a results file
    assert series["grad_norm"][0].tolist() == [2] and "x" not in series and "y" not in series
    steps, grid = chunk_grid(series, "overlap_ratio")
    assert steps.tolist() == [3] and grid.shape == (3, 1) and math.isnan(grid[0, 0]) and grid[2, 0] == 0.1


@pytest.mark.slow
def test_accuracy_starts_at_step_0_with_the_teacher_as_reference(tmp_path):
    """The student before training (eval/step_0, or a demo's eval/student_before) is the first accuracy point, the
    teacher's eval (eval/teacher) a dotted reference line, and the final table reads before → after (teacher)."""
    from opd.report.plots import RunSeries, _accuracy_panels, _line_figure, load_references

    run = make_run_dir(tmp_path / "demo-like")
    for name, value in (("student_before", 0.25), ("teacher", 0.95)):
        (run / "eval" / name).mkdir(parents=True)
        (run / "eval" / name / "results.json").write_text(json.dumps({"benchmarks": {"lab": {"avg@4": value}}}))
    series = load_series(run)
    assert series["eval/lab/avg@4"][0][0] == 0 and series["eval/lab/avg@4"][1][0] == 0.25
    references = load_references(run)
    assert references == {"eval/lab/avg@4": 0.95}
    figure = _line_figure("Accuracy", _accuracy_panels(set(series)), [RunSeries("demo-like", series, references)])
    lab = next(ax for ax in figure.axes if ax.get_title() == "eval: lab")
    teacher = [line for line in lab.get_lines() if line.get_label().endswith("teacher")]
    assert len(teacher) == 1 and list(teacher[0].get_ydata()) == [0.95, 0.95]
    assert lab.get_lines()[0].get_xdata()[0] == 0
    html = write_report([run]).read_text()
    final = html[html.index('<table class="final">') :]
    final = final[: final.index("</table>")]
    assert '0.25<span class="step">@0</span> → 0.8<span class="step">@20</span>' in final
    assert "(teacher 0.95)" in final
    (run / "eval" / "step_0").mkdir()  # a trainer's own step-0 eval wins over the demo's file
    (run / "eval" / "step_0" / "results.json").write_text(json.dumps({"benchmarks": {"lab": {"avg@4": 0.3}}}))
    assert load_series(run)["eval/lab/avg@4"][1][0] == 0.3


def add_teachers(run: Path, names=("math", "code"), counts=(6, 2)) -> None:
    """What `opd distill` with `teachers:` adds to a run: teachers.json and the teacher/<name>/... step metrics."""
    total = sum(counts)
    rows = [
        {
            "name": name,
            "route": f"data_source in ['{name}']",
            "placement": f"local /models/{name} on device cuda:0",
            "model": f"/models/{name}",
            "prompts": count,
            "fraction": count / total,
        }
        for name, count in zip(names, counts)
    ]
    (run / "teachers.json").write_text(json.dumps({"prompts": total, "teachers": rows}))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "grad_norm" in record:  # a training line
            for name, count in zip(names, counts):
                record[f"teacher/{name}/token_frac"] = count / total
                record[f"teacher/{name}/reward_mean"] = -0.1 * record["step"] / count
                record[f"teacher/{name}/rollout_accuracy"] = 0.5
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_routing_table_and_per_teacher_panels(tmp_path):
    """teachers.json becomes a table (teacher, route, placement, model, prompts, share); the teacher/<name>/...
    metrics one plot, a panel per metric with a line per teacher, and none of them lands in "other"."""
    from opd.report.plots import RunSeries, _line_figure, _teacher_panels

    run = make_run_dir(tmp_path / "mopd", steps=6, chunks=1, eval_every=3)
    add_teachers(run)
    html = write_report([run]).read_text()
    routing = html[html.index("<h2>Teachers</h2>") : html.index("<h2>Config</h2>")]
    assert routing.count("<tr>") == 3  # the header and one row per teacher
    assert '<td class="key">math</td><td class="key">data_source in [&#x27;math&#x27;]</td>' in routing
    assert '<td class="key">local /models/code on device cuda:0</td><td class="key">/models/code</td>' in routing
    assert "<td>6</td><td>75.0%</td>" in routing and "<td>2</td><td>25.0%</td>" in routing
    images = embedded_images(html)
    assert "teachers" in images and not is_blank(images["teachers"]) and "other" not in images
    series = load_series(run)
    panels = _teacher_panels(set(series))
    assert [p.title.split(":")[0] for p in panels] == ["token_frac", "reward_mean", "rollout_accuracy"]
    assert panels[1].keys == ["teacher/code/reward_mean", "teacher/math/reward_mean"]
    figure = _line_figure("Per-teacher metrics", panels, [RunSeries("mopd", series)])
    legend = [t.get_text() for t in figure.axes[1].get_legend().get_texts()]
    assert legend == ["code", "math"]  # each line named by its teacher

    plain = make_run_dir(tmp_path / "plain", steps=6, chunks=1, eval_every=3)
    html = write_report([plain]).read_text()
    assert "<h2>Teachers</h2>" not in html and "teachers" not in embedded_images(html)
    both = write_report([run, plain]).read_text()
    assert "<h3>mopd</h3>" in both and both.count('<table class="teachers">') == 1


# --- every file `opd report` reads back from a run directory, damaged: one line naming it, exit 2, no traceback

DAMAGED_FILES = [  # (label, file, content, what the line says besides the file)
    ("metrics line a list", "metrics.jsonl", '{"step": 1, "loss": 1.0}\n[1, 2]\n{"step": 3}\n', "metrics.jsonl:2"),
    ("metrics line a number", "metrics.jsonl", '7\n{"step": 1, "loss": 1.0}\n', "metrics.jsonl:1"),
    ("metrics line a string", "metrics.jsonl", '"step"\n{"step": 1}\n', "not a JSON object"),
    ("metrics step absurd", "metrics.jsonl", '{"step": 1e300, "loss": 1.0}\n', "step"),
    ("metrics step huge int", "metrics.jsonl", '{"step": 99999999999999999999999, "loss": 1}\n', "step"),
    ("metrics step negative", "metrics.jsonl", '{"step": -3, "loss": 1.0}\n', "step -3"),
    ("metrics step a string", "metrics.jsonl", '{"step": "two", "loss": 1.0}\n', "'two'"),
    ("samples line a list", "samples/step_20.jsonl", '[1]\n{"response": "x"}\n', "step_20.jsonl:1"),
    (
        "samples rewards a number",
        "samples/step_20.jsonl",
        '{"response": "x", "token_rewards": 5}\n',
        ":1: 'token_rewards' is 5",
    ),
    ("samples rewards strings", "samples/step_20.jsonl", '{"token_rewards": ["a"]}\n', "a list of numbers"),
    ("samples response a list", "samples/step_20.jsonl", '{"response": [1]}\n', ":1: 'response' is [1]"),
    ("samples correct a string", "samples/step_20.jsonl", '{"correct": "yes"}\n', "true, false or null"),
    ("eval results a list", "eval/step_5/results.json", "[1, 2]", "not a JSON object"),
    ("eval results benchmarks a list", "eval/step_5/results.json", '{"benchmarks": [1]}', "not eval results"),
    ("eval results summary a number", "eval/step_5/results.json", '{"benchmarks": {"a": 3}}', "not eval results"),
    ("eval results unparsable", "eval/step_5/results.json", '{"benchmarks": ', "not valid JSON"),
    ("teacher results a string", "eval/teacher/results.json", '"x"', "not a JSON object"),
    ("config.yaml unparsable", "config.yaml", "run: [1, 2\nsteps: 3\n", "not valid YAML"),
    ("config.yaml a list", "config.yaml", "- 1\n- 2\n", "not a mapping"),
    ("config.yaml a string", "config.yaml", "just words\n", "not a mapping"),
    ("teachers.json a list", "teachers.json", "[1]", "not a JSON object"),
    ("teachers.json unparsable", "teachers.json", '{"teachers": [', "not valid JSON"),
    ("teachers.json rows a number", "teachers.json", '{"teachers": 3}', "not a routing table"),
    ("teachers.json row without name", "teachers.json", '{"teachers": [{"prompts": 3}]}', "not a routing table"),
]


@pytest.mark.parametrize("label, name, content, says", DAMAGED_FILES, ids=[c[0] for c in DAMAGED_FILES])
def test_report_damaged_run_file_is_one_line_naming_it(label, name, content, says, tmp_path, monkeypatch, capfd):
    run = make_run_dir(tmp_path / "run", steps=20)
    path = run / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    capfd.readouterr()
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, err, escaped = run_in_process(["report", str(run), "--out", str(tmp_path / "r.html")], monkeypatch, capfd)
    assert escaped is None, escaped
    if says is None:  # a value the report can do without: reported, not fatal
        assert code == 0 and (tmp_path / "r.html").is_file()
        return
    line = one_line(code, err)
    assert str(path) in line and says in line, line


@pytest.mark.slow
def test_a_real_runs_report_draws_where_the_time_goes(world, tmp_path):
    """A real two-step run's metrics.jsonl: the report has the phase chart, stacking the phases the trainer timed."""
    cfg = distill_config(world, tmp_path)
    train(setup(cfg, tmp_path / "run", console=string_console()), console=string_console())
    logged = {key for row in read_jsonl(tmp_path / "run" / "metrics.jsonl") for key in row}
    assert {"time/rollout", "time/teacher", "time/student", "time/update"} <= logged
    images = embedded_images(write_report([tmp_path / "run"]).read_text())
    assert "phases" in images and not is_blank(images["phases"])
    assert (tmp_path / "run" / "plots" / "phases.png").is_file()


@pytest.mark.slow
def test_the_phase_chart_stacks_phases_compiles_and_gpu_busy(tmp_path):
    series = {
        "time/update": _points([3.0, 3.0, 3.0]),
        "time/rollout": _points([1.0, 1.0, 1.0]),
        "time/rollout_wait": _points([0.5, 0.0, 0.0]),
        "time/extra_phase": _points([0.2, 0.2, 0.2]),
        "time/step": _points([4.7, 4.2, 4.2]),
        "compile/seconds": _points([10.0, 12.0, 12.0]),
        "compile/warm_up_s": (np.array([1]), np.array([95.0])),
        "compile/warm_up_graphs": (np.array([1]), np.array([60.0])),
        "gpu/busy_frac": _points([0.4, 0.9, 0.9]),
    }
    assert phase_keys(set(series)) == ["time/rollout", "time/rollout_wait", "time/update", "time/extra_phase"]
    plots = render_plots([RunSeries("a", series), RunSeries("b", {"lr": _points([1.0, 1.0, 1.0])})], tmp_path)
    phases = next(plot for plot in plots if plot.name == "phases")
    drawn = ["compile/seconds", "compile/warm_up_s", "compile/warm_up_graphs", "gpu/busy_frac"]
    assert phases.keys == [*phase_keys(set(series)), *drawn]
    assert "gpu/busy_frac" not in {key for plot in plots if plot.name == "other" for key in plot.keys}


def test_a_run_without_timings_has_no_phase_chart(tmp_path):
    plots = render_plots([RunSeries("sft", {"loss": _points([2.0, 1.0]), "lr": _points([1.0, 1.0])})], tmp_path)
    assert "phases" not in {plot.name for plot in plots}


def test_compile_seconds_per_step_restart_at_a_resume():
    steps = np.array([1, 2, 3, 4, 5])
    totals = np.array([30.0, 30.0, 32.0, 5.0, 5.0])
    steps_kept, per_step = step_compile_seconds({"compile/seconds": (steps, totals)}) or ((), ())
    assert list(steps_kept) == [2, 3, 5] and list(per_step) == [0.0, 2.0, 0.0]  # steps 1 and 4: a process's first
    assert step_compile_seconds({"time/step": (steps, steps * 1.0)}) is None


def _points(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(1, len(values) + 1), np.array(values)


# --- runs with tools: the Episodes figure

EPISODE_KEYS = {
    "episode/turns_mean",
    "episode/tool_calls_mean",
    "episode/tool_errors",
    "episode/sandbox_refusals",
    "episode/tool_seconds",
    "episode/tool_wall_seconds",
    "episode/student_tokens_mean",
    "episode/env_tokens_mean",
    "episode/repeated_prefill_tokens",
}


def add_episodes(run: Path) -> None:
    """What `opd distill rollout.tools=...` adds to each training line: the episode/* metrics (and a key a later
    version might add)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if "grad_norm" in record:  # a training line
            step = record["step"]
            record.update(
                {
                    "episode/turns_mean": 1.5 + 0.1 * step,
                    "episode/tool_calls_mean": 0.5 + 0.1 * step,
                    "episode/tool_errors": float(step % 3 == 0),
                    "episode/sandbox_refusals": float(step == 2),
                    "episode/tool_seconds": 0.2,
                    "episode/tool_wall_seconds": 0.1,
                    "episode/student_tokens_mean": 40.0,
                    "episode/env_tokens_mean": 12.0,
                    "episode/repeated_prefill_tokens": 300.0,
                    "episode/future_metric": 1.0,
                }
            )
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_with_tools_has_the_episodes_figure_and_no_episode_key_in_other(tmp_path):
    """The episode/* metrics become the Episodes figure (turns and calls, errors and refusals, tool seconds against
    the step's time, student vs environment tokens), none of them lands in "Other metrics", and the final table
    shows the episodes' figures, tool errors and refusals summed over the run too; a run without tools has none."""
    from opd.report.plots import _episode_panels

    run = make_run_dir(tmp_path / "tools", steps=6, chunks=1, eval_every=3)
    add_episodes(run)
    plots = render_plots([RunSeries("tools", load_series(run))], tmp_path / "plots")
    episodes = next(plot for plot in plots if plot.name == "episodes")
    assert EPISODE_KEYS | {"episode/future_metric", "time/rollout", "time/step"} == set(episodes.keys)
    other = {key for plot in plots if plot.name == "other" for key in plot.keys}
    assert not {k for k in other if k.startswith("episode/")}, other
    titles = [panel.title for panel in _episode_panels(set(load_series(run)))]
    assert titles[:4] == [
        "turns and tool calls per episode",
        "tool errors and sandbox refusals (the step's episodes)",
        "tool seconds against the step's time",
        "student vs environment tokens per episode",
    ]
    html = write_report([run]).read_text()
    images = embedded_images(html)
    assert "episodes" in images and not is_blank(images["episodes"])
    assert '<a href="#plot-episodes">Episodes</a>' in html
    final = html[html.index('<table class="final">') :]
    final = final[: final.index("</table>")]
    for key in ("episode/turns_mean", "episode/tool_calls_mean", "episode/env_tokens_mean"):
        assert f'<td class="key">{key}</td>' in final
    assert '<td class="key">episode/tool_errors</td><td>1<span class="step">@6</span>' in final
    assert "(2 over the run)</span>" in final  # errors at steps 3 and 6
    assert "(1 over the run)</span>" in final  # the refusal at step 2

    plain = make_run_dir(tmp_path / "plain", steps=6, chunks=1, eval_every=3)
    html = write_report([plain]).read_text()
    assert "episodes" not in embedded_images(html) and "episode/" not in html
    timing_only = {"time/rollout": _points([1.0, 1.0]), "time/step": _points([2.0, 2.0])}
    assert _episode_panels(set(timing_only)) == []  # the step's times alone are not an Episodes figure


@pytest.mark.slow
def test_a_real_tool_runs_report_shows_turns_and_tool_use(tool_world, tmp_path):  # noqa: F811 (the fixture)
    """A real step of `opd distill rollout.tools=calculator` with a student that calls the calculator: its
    metrics.jsonl has the episode metrics, and its report draws them in the Episodes figure, not in "other"."""
    from opd.recipes.distill import distill

    run = distill(tool_run_config(tool_world, tmp_path, student="tool_user", steps=1))
    logged = {key for row in read_jsonl(run / "metrics.jsonl") for key in row}
    assert EPISODE_KEYS <= logged
    images = embedded_images(write_report([run]).read_text())
    assert "episodes" in images and not is_blank(images["episodes"])
    plots = render_plots([RunSeries("run", load_series(run))], tmp_path / "plots")
    assert EPISODE_KEYS <= set(next(plot for plot in plots if plot.name == "episodes").keys)
    assert not [k for plot in plots if plot.name == "other" for k in plot.keys if k.startswith("episode/")]
