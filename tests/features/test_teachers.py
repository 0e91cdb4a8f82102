"""`teachers:` a list of routed teachers (issue 25): one teacher in the list is today's single teacher bit for bit,
a route split over two copies of one teacher is that teacher, every prompt is scored by its own teacher, unrouted
prompts fail before compute, and checkpoints refuse another teacher on resume."""

import json
import re
import shutil

import pytest
import torch

from helpers import (
    CHAT_TEMPLATE,
    cli,
    distill_config,
    make_tiny_model,
    make_tiny_tokenizer,
    one_line,
    run_in_process,
    server_in_thread,
)
from opd.io import read_jsonl
from opd.recipes.distill import distill
from opd.teacher.local import LocalScorer
from opd.train.checkpoint import latest_checkpoint, load_trainer_state

# prompts of two domains: data_source "add" for even i, "mul" for odd, and a `level` column
ROWS = [
    {"prompt": f"{i}+{i}=", "answer": str(2 * i), "data_source": "add" if i % 2 == 0 else "mul", "level": i // 3}
    for i in range(6)
]


@pytest.fixture(scope="module")
def routed_world(world, tmp_path_factory):
    """The `world` fixture's student and teacher, two more copies of the teacher (a, b), and prompts with domains."""
    root = tmp_path_factory.mktemp("routed")
    for name in ("a", "b"):
        shutil.copytree(world / "teacher", root / name)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


def _config(world, routed_world, out, *overrides, teachers=None, steps=2):
    options = [f"data.path={routed_world / 'prompts.jsonl'}", *overrides]
    if teachers is not None:
        options.append(f"teachers={json.dumps(teachers)}")
    return distill_config(world, out, *options, teacher=teachers is None, steps=steps)


def _split(routed_world, key="data_source"):
    if key == "data_source":
        routes = [{"data_source": ["add"]}, {"data_source": ["mul"]}]
    else:
        routes = [{"route_key": "level", "values": [0]}, {"route_key": "level", "values": [1]}]
    return [{"name": n, "path": str(routed_world / n), "route": r} for n, r in zip("ab", routes)]


def _numbers(run_dir):
    """metrics.jsonl without wall-clock values and without the per-teacher keys."""
    return [
        {k: v for k, v in m.items() if not k.startswith(("time/", "teacher/")) and k != "tokens_per_second"}
        for m in read_jsonl(run_dir / "metrics.jsonl")
    ]


def test_one_teacher_in_the_list_is_the_single_teacher_bit_for_bit(world, routed_world, tmp_path):
    single = distill(_config(world, routed_world, tmp_path / "single"))
    listed = distill(
        _config(world, routed_world, tmp_path / "list", teachers=[{"name": "t", "path": str(world / "teacher")}])
    )
    assert _numbers(single) == _numbers(listed)
    # no per-teacher keys (teacher/<name>/…); teacher/bytes_per_token is the run's answer size, in both runs
    assert not any(k.startswith("teacher/") and k.count("/") > 1 for k in read_jsonl(listed / "metrics.jsonl")[-1])
    for run_dir, name in ((single, "teacher"), (listed, "t")):  # one row: every prompt
        (row,) = json.loads((run_dir / "teachers.json").read_text())["teachers"]
        assert (row["name"], row["prompts"], row["fraction"], row["route"]) == (name, len(ROWS), 1.0, "default")
        assert row["model"] == str(world / "teacher") and row["placement"].startswith("local ")


@pytest.mark.parametrize("key", ["data_source", "level"])
def test_two_copies_of_a_teacher_split_by_route_are_that_teacher(world, routed_world, tmp_path, key):
    single = _numbers(distill(_config(world, routed_world, tmp_path / "single", "prompts_per_step=4")))
    run_dir = distill(
        _config(world, routed_world, tmp_path / "two", "prompts_per_step=4", teachers=_split(routed_world, key))
    )
    split = _numbers(run_dir)
    assert [m.keys() for m in single] == [m.keys() for m in split]
    for one, two in zip(single, split):
        for k in one:
            if isinstance(one[k], float):
                assert two[k] == pytest.approx(one[k], abs=1e-6, rel=1e-6), k
    last = read_jsonl(run_dir / "metrics.jsonl")[-1]
    assert last["teacher/a/token_frac"] + last["teacher/b/token_frac"] == pytest.approx(1.0)
    assert {"teacher/a/reward_mean", "teacher/b/reward_mean", "teacher/a/rollout_accuracy"} <= last.keys()


def test_the_routing_table_is_written_at_startup_reported_and_kept_on_resume(world, routed_world, tmp_path):
    """teachers.json: per teacher the prompts routed to it over the whole set (as the route splits them), its route,
    placement and model; report.html shows it and one panel per per-teacher metric; a resume writes it again."""
    from opd.report.plots import _teacher_panels, load_series

    options = ("prompts_per_step=4", "data.limit=5", "run.save_every=2", "run.report=true")
    run_dir = distill(_config(world, routed_world, tmp_path, *options, teachers=_split(routed_world)))
    written = (run_dir / "teachers.json").read_bytes()
    table = json.loads(written)
    sources = [r["data_source"] for r in ROWS[:5]]
    assert table["prompts"] == 5 == sum(row["prompts"] for row in table["teachers"])
    assert [(t["name"], t["prompts"], t["route"]) for t in table["teachers"]] == [
        ("a", sources.count("add"), "data_source in ['add']"),
        ("b", sources.count("mul"), "data_source in ['mul']"),
    ]
    assert [t["fraction"] for t in table["teachers"]] == [sources.count("add") / 5, sources.count("mul") / 5]
    assert [t["model"] for t in table["teachers"]] == [str(routed_world / "a"), str(routed_world / "b")]
    assert all(t["placement"] == f"local {t['model']} on device auto" for t in table["teachers"])

    html = (run_dir / "report.html").read_text()
    routing = html[html.index('<table class="teachers">') :]
    routing = routing[: routing.index("</table>")]
    for row in table["teachers"]:
        assert f'<td class="key">{row["name"]}</td>' in routing and row["model"] in routing
        assert f"<td>{row['prompts']}</td><td>{row['fraction']:.1%}</td>" in routing
    assert 'data-group="teachers"' in html and 'href="#plot-teachers"' in html
    panels = {p.title.split(":")[0]: p.keys for p in _teacher_panels(set(load_series(run_dir)))}
    assert panels["token_frac"] == ["teacher/a/token_frac", "teacher/b/token_frac"]
    assert {"reward_mean", "rollout_accuracy"} <= panels.keys()

    resumed = distill(
        _config(world, routed_world, tmp_path, *options, "run.resume=true", teachers=_split(routed_world), steps=3)
    )
    assert [m["step"] for m in read_jsonl(resumed / "metrics.jsonl")] == [1, 2, 3]
    assert (resumed / "teachers.json").read_bytes() == written


def _teacher_prompts_in_steps(monkeypatch, tokenizer) -> dict[str, list[str]]:
    """A counter on the real LocalScorer inside the training steps only (the startup rows score prompt 0 with the
    first teacher, whatever its route): model path → the decoded prompts of the rows each teacher scored (calls with
    requested_ids: a teacher's scoring, not the student's own)."""
    import opd.recipes.distill as recipe

    seen: dict[str, list[str]] = {}
    real_score, real_step, in_step = LocalScorer.score, recipe.opd_step, []

    def counting_step(tr):
        in_step.append(True)
        try:
            return real_step(tr)
        finally:
            in_step.pop()

    def counting_score(self, rollouts, **kwargs):
        if in_step and kwargs.get("requested_ids") is not None:
            path = str(self.model.config._name_or_path)
            for row in range(rollouts.batch_size):
                prompt = tokenizer.decode(rollouts.input_ids[row, : int(rollouts.prompt_lengths[row])].tolist())
                seen.setdefault(path, []).append(prompt)
        return real_score(self, rollouts, **kwargs)

    monkeypatch.setattr(LocalScorer, "score", counting_score)
    monkeypatch.setattr(recipe, "opd_step", counting_step)
    return seen


def test_every_prompt_is_scored_by_its_own_teacher(world, routed_world, tmp_path, monkeypatch):
    """A counter on the scorers (the real LocalScorer, recording what it scores): teacher a sees only "add" prompts,
    b only "mul" ones, and both score something."""
    seen = _teacher_prompts_in_steps(monkeypatch, make_tiny_tokenizer())
    distill(_config(world, routed_world, tmp_path, "prompts_per_step=4", teachers=_split(routed_world), steps=3))
    source = {r["prompt"]: r["data_source"] for r in ROWS}
    by_teacher = {
        name: [p.split("user\n")[1].split("<|im_end|>")[0] for p in seen.get(str(routed_world / name), [])]
        for name in "ab"
    }
    assert by_teacher["a"] and by_teacher["b"]
    assert {source[p] for p in by_teacher["a"]} == {"add"}
    assert {source[p] for p in by_teacher["b"]} == {"mul"}


def test_a_prompt_no_route_matches_fails_before_any_model_loads(world, routed_world, tmp_path, monkeypatch):
    import opd.recipes.distill as recipe

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the routing check")

    monkeypatch.setattr(recipe, "load_model", no_load)
    teachers = _split(routed_world)[:1]  # only "add" is routed
    teachers[0]["route"] = {"data_source": ["add"]}
    teachers.append({"name": "c", "path": str(routed_world / "b"), "route": {"data_source": ["sub"]}})
    with pytest.raises(ValueError, match=r"prompt 1 \(data_source 'mul'\) matches no teacher's route") as error:
        distill(_config(world, routed_world, tmp_path, teachers=teachers))
    assert "\n" not in str(error.value) and "a: data_source in ['add']" in str(error.value)
    both = _split(routed_world)
    both[1]["route"] = {"route_key": "level", "values": [0, 1]}  # "add" prompts match a and b
    with pytest.raises(ValueError, match="prompt 0 matches the routes of a and b"):
        distill(_config(world, routed_world, tmp_path, teachers=both))


def test_a_default_teacher_takes_the_rest(world, routed_world, tmp_path):
    teachers = _split(routed_world)
    teachers[1]["route"] = {"default": True}
    run_dir = distill(_config(world, routed_world, tmp_path, "prompts_per_step=4", teachers=teachers, steps=1))
    assert read_jsonl(run_dir / "metrics.jsonl")[-1]["teacher/b/token_frac"] > 0


def test_resume_refuses_a_changed_teacher(world, routed_world, tmp_path):
    teachers_dir = tmp_path / "teachers"
    for name in "ab":
        shutil.copytree(routed_world / name, teachers_dir / name)
    teachers = [dict(t, path=str(teachers_dir / t["name"])) for t in _split(routed_world)]
    distill(_config(world, routed_world, tmp_path, "run.save_every=2", teachers=teachers))
    make_tiny_model("qwen3", seed=7).save_pretrained(teachers_dir / "b")  # the same path, other weights
    resume = ("run.save_every=2", "run.resume=true")
    with pytest.raises(ValueError, match="teacher b's fingerprint changed since") as error:
        distill(_config(world, routed_world, tmp_path, *resume, teachers=teachers, steps=3))
    assert "\n" not in str(error.value)
    shutil.rmtree(teachers_dir / "b")
    shutil.copytree(routed_world / "b", teachers_dir / "b")
    swapped = [dict(t) for t in teachers]
    swapped[0]["route"], swapped[1]["route"] = swapped[1]["route"], swapped[0]["route"]
    with pytest.raises(ValueError, match="teacher a's route changed since"):
        distill(
            _config(world, routed_world, tmp_path, *resume, "run.allow_config_change=true", teachers=swapped, steps=3)
        )
    run_dir = distill(_config(world, routed_world, tmp_path, *resume, teachers=teachers, steps=3))
    assert [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]


def test_lab_mopd_config_routes_each_lab_prompt_to_its_specialist(tmp_path, monkeypatch):
    """configs/lab_mopd.yaml is configs/lab_demo.yaml with its teacher replaced by the two shipped specialists, each
    routed the prompts of its own domain by data_source (`opd.lab.build.DOMAINS`: a problem's first operation), and
    runs from the repo root: every prompt a specialist scores is of its domain (a counter on the real LocalScorer),
    the routing table splits the whole set by domain, and metrics carry each teacher's token share."""
    from pathlib import Path

    import yaml

    from opd.config import DistillConfig, build_config
    from opd.lab import mopd_prompts_path, mopd_test_set_path, specialist_path
    from opd.lab.build import DOMAINS, domain_of
    from opd.lab.tokenizer import build_lab_tokenizer

    root = Path(__file__).parents[2]
    if not (root / "configs" / "lab_mopd.yaml").is_file():
        pytest.skip("configs/lab_mopd.yaml is not in this checkout")
    demo, mopd = (yaml.safe_load((root / "configs" / f"{n}.yaml").read_text()) for n in ("lab_demo", "lab_mopd"))
    teacher, teachers = demo.pop("teacher"), mopd.pop("teachers")
    assert (root / mopd["data"].pop("path")).resolve() == mopd_prompts_path().resolve()
    assert [(root / b).resolve() for b in mopd["eval"].pop("benchmarks")] == [mopd_test_set_path().resolve()]
    demo["data"].pop("path"), demo["eval"].pop("benchmarks")
    assert demo == mopd
    assert [t["name"] for t in teachers] == list(DOMAINS)
    for entry in teachers:
        assert entry["route"] == {"data_source": [f"opd_lab/{entry['name']}"]}
        assert (root / entry["path"]).resolve() == specialist_path(entry["name"]).resolve()
        assert {k: v for k, v in entry.items() if k not in ("name", "route", "path")} == {
            k: v for k, v in teacher.items() if k != "path"
        }
    prompts = _teacher_prompts_in_steps(monkeypatch, build_lab_tokenizer())
    monkeypatch.chdir(root)
    out = ["run.steps=3", "run.eval_every=0", "eval.benchmarks=[]", "run.report=false", "run.samples_per_step=0"]
    config = build_config(
        DistillConfig,
        config_file=root / "configs" / "lab_mopd.yaml",
        overrides=[*out, f"run.out_dir={tmp_path}", "run.name=mopd", "rollout.max_new_tokens=48"],
    )
    run_dir = distill(config)
    seen = {
        Path(path).name.removeprefix("specialist_"): [domain_of(p.split("Compute ")[1].split(". Put")[0]) for p in rows]
        for path, rows in prompts.items()
    }
    assert seen.keys() == set(DOMAINS)
    for name, domains in seen.items():
        assert set(domains) == {name}
    table = {r["name"]: r for r in json.loads((run_dir / "teachers.json").read_text())["teachers"]}
    domains = [domain_of(r["expression"]) for r in read_jsonl(mopd_prompts_path())]
    assert {name: table[name]["prompts"] for name in DOMAINS} == {name: domains.count(name) for name in DOMAINS}
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert all(m["teacher/add/token_frac"] + m["teacher/mul/token_frac"] == pytest.approx(1.0) for m in metrics)
    for name in DOMAINS:
        assert any(m[f"teacher/{name}/token_frac"] > 0 for m in metrics)


def test_lab_opsd_config_is_the_demo_with_the_privileged_self_teacher(tmp_path, monkeypatch):
    """configs/lab_opsd.yaml is configs/lab_demo.yaml with its teacher replaced by the student's initial weights
    seeing the reference answer, and runs from the repo root. The answer changes the self-teacher's scores: without a
    view, student_init would score every token at reward zero (and is refused at config load); here it does not.
    (That the view touches only the teacher's prompt ids: test_a_view_changes_only_the_teachers_prompt_ids.)"""
    from pathlib import Path

    import yaml

    from opd.config import DistillConfig, build_config

    root = Path(__file__).parents[2]
    if not (root / "configs" / "lab_opsd.yaml").is_file():
        pytest.skip("configs/lab_opsd.yaml is not in this checkout")
    demo, opsd = (yaml.safe_load((root / "configs" / f"{n}.yaml").read_text()) for n in ("lab_demo", "lab_opsd"))
    teacher, teachers = demo.pop("teacher"), opsd.pop("teachers")
    assert demo == opsd
    (entry,) = teachers
    assert entry["path"] == "student_init" and entry["view"]["context_key"] == "answer"
    assert {k: v for k, v in entry.items() if k not in ("name", "path", "view")} == {
        k: v for k, v in teacher.items() if k != "path"
    }
    monkeypatch.chdir(root)
    out = ["run.steps=2", "run.eval_every=0", "eval.benchmarks=[]", "run.report=false", "run.samples_per_step=0"]
    config = build_config(
        DistillConfig,
        config_file=root / "configs" / "lab_opsd.yaml",
        overrides=[*out, f"run.out_dir={tmp_path}", "run.name=opsd", "data.limit=200"],
    )
    metrics = read_jsonl(distill(config) / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert abs(metrics[0]["reward_mean"]) > 1e-3  # the answer in the teacher's context was seen


def test_mixed_placements_local_offloaded_and_served_on_loopback(tmp_path):
    """One local teacher (offloaded) and one served by an in-process `opd serve-teacher` on loopback, both the lab
    teacher and split by the prompts' steps column: the same run as the one local lab teacher (≤ 1e-5, the served
    one batches rows its own way)."""
    pytest.importorskip("uvicorn")
    from opd.config import DistillConfig, ModelSpec, build_config
    from opd.lab import opd_prompts_path, student_path, teacher_path
    from opd.models import load_model
    from opd.recipes.serve_teacher import ServeConfig
    from opd.teacher.server import service_for

    model, tokenizer = load_model(teacher_path(), dtype="fp32", device="cpu")
    service = service_for(model, tokenizer, ServeConfig(model=ModelSpec(path=str(teacher_path()))), name="lab")
    token_file = tmp_path / "token"
    token_file.write_text("mixed-placements-token-0123")
    with server_in_thread(service, token_file.read_text()) as url:
        lab = {"device": "cpu", "dtype": "fp32"}
        teachers = [
            {"name": "local", "path": str(teacher_path()), "offload": True, **lab},
            {"name": "served", "url": url, "token_file": str(token_file)},
        ]
        teachers[0]["route"] = {"route_key": "steps", "values": [1, 2]}
        teachers[1]["route"] = {"route_key": "steps", "values": [3, 4, 5]}
        common = [
            f"student.path={student_path()}",
            "student.device=cpu",
            "student.dtype=fp32",
            f"data.path={opd_prompts_path()}",
            "data.limit=200",
            "data.max_prompt_length=64",
            "prompts_per_step=4",
            "rollout.n=2",
            "rollout.max_new_tokens=24",
            "micro_batch_tokens=4096",
            "score_batch_tokens=4096",
            f"run.out_dir={tmp_path}",
            "run.steps=2",
            "run.report=false",
            "run.samples_per_step=0",
        ]
        one = [f"teacher.path={teacher_path()}", "teacher.device=cpu", "teacher.dtype=fp32", "run.name=one"]
        single = distill(build_config(DistillConfig, overrides=[*common, *one]))
        mixed = distill(
            build_config(DistillConfig, overrides=[*common, f"teachers={json.dumps(teachers)}", "run.name=mixed"])
        )
    for a, b in zip(_numbers(single), _numbers(mixed), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            if isinstance(a[k], float):
                assert b[k] == pytest.approx(a[k], abs=1e-5), k
    last = read_jsonl(mixed / "metrics.jsonl")[-1]
    assert last["teacher/local/token_frac"] > 0 and last["teacher/served/token_frac"] > 0


def test_a_view_changes_only_the_teachers_prompt_ids(world, routed_world, tmp_path, monkeypatch):
    """A teacher with `view: {context_key: answer}` scores the student's response ids after its own prompt (the
    student's plus the answer); the student's prompts and responses are untouched."""
    calls: list[tuple[str, list[str], object]] = []
    tokenizer = make_tiny_tokenizer()
    real_score = LocalScorer.score

    def recording_score(self, rollouts, **kwargs):
        if kwargs.get("top_k", 0):  # the step's student and teacher calls (not the startup checks)
            role = "teacher" if kwargs.get("requested_ids") is not None else "student"
            prompts = [
                tokenizer.decode(rollouts.input_ids[b, : int(rollouts.prompt_lengths[b])].tolist())
                for b in range(rollouts.batch_size)
            ]
            calls.append((role, prompts, rollouts.response_ids.clone()))
        return real_score(self, rollouts, **kwargs)

    monkeypatch.setattr(LocalScorer, "score", recording_score)
    view = {"context_key": "answer", "context_template": " Answer: {context}"}
    teachers = [{"name": "t", "path": str(world / "teacher"), "view": view}]
    run_dir = distill(_config(world, routed_world, tmp_path / "view", teachers=teachers))
    calls = calls[-4:]  # the two steps' (earlier ones: the startup checks, on the student's prompts)
    assert [c[0] for c in calls] == ["student", "teacher"] * 2
    answer = {r["prompt"]: r["answer"] for r in ROWS}
    for (_, student_prompts, student_ids), (_, teacher_prompts, teacher_ids) in zip(calls[::2], calls[1::2]):
        assert torch.equal(student_ids, teacher_ids)
        for s, t in zip(student_prompts, teacher_prompts):
            question = s.split("user\n")[1].split("<|im_end|>")[0]
            assert "Answer:" not in s
            assert t == s.replace(question, f"{question} Answer: {answer[question]}")
    assert "Answer:" not in read_jsonl(run_dir / "samples" / "step_1.jsonl")[0]["prompt"]
    plain = distill(_config(world, routed_world, tmp_path / "plain"))
    assert _numbers(plain)[0]["reward_mean"] != _numbers(run_dir)[0]["reward_mean"]  # the context was seen


@pytest.mark.parametrize(
    ("teachers", "culprit"),
    [
        ([{"name": "self", "path": "student"}], "teachers[0] (self): path: student without a view"),
        ([{"name": "self", "path": "student_init"}], "teachers[0] (self): path: student_init without a view"),
        (  # the live student beside a real teacher: its own prompts still get reward 0
            [
                {"name": "self", "path": "student", "route": {"data_source": ["add"]}},
                {"name": "real", "path": "T", "route": {"data_source": ["mul"]}},
            ],
            "teachers[0] (self): path: student without a view",
        ),
    ],
)
def test_a_self_teacher_without_a_view_is_refused_at_config_load(world, routed_world, tmp_path, teachers, culprit):
    """The student scoring its own tokens on its own prompt gives every token reward 0: refused before anything
    loads, naming the entry and what would teach (a view, another teacher, an outcome reward)."""
    teachers = [{**t, "path": str(world / "teacher")} if t["path"] == "T" else t for t in teachers]
    with pytest.raises(ValueError, match=re.escape(culprit)) as error:
        _config(world, routed_world, tmp_path, teachers=teachers)
    assert "\n" not in str(error.value) and "view" in str(error.value)


def test_student_init_beside_a_real_teacher_anchors_the_student_to_its_start(world, routed_world, tmp_path):
    """Beside a real teacher (on the "mul" prompts, so the student learns), student_init (the frozen initial weights)
    scores the "add" prompts at reward 0 at step 1 only: the student moved, its initial weights are another model.
    The live student with a view (the answer in its prompt) scores them at a reward that is not 0."""

    def add_rewards(run_dir, step):
        add = {r["prompt"] for r in ROWS if r["data_source"] == "add"}
        samples = read_jsonl(run_dir / "samples" / f"step_{step}.jsonl")
        mine = [s for s in samples if s["prompt"].split("user\n")[1].split("<|im_end|>")[0] in add]
        assert mine
        return [r for s in mine for r in s["token_rewards"]]

    def teachers(path, view=None):
        own = {"name": "self", "path": path, "route": {"data_source": ["add"]}}
        real = {"name": "real", "path": str(world / "teacher"), "route": {"data_source": ["mul"]}}
        return [own if view is None else {**own, "view": view}, real]

    options = ("prompts_per_step=4", "run.samples_per_step=8", "optim.lr=1e-2")
    frozen = distill(_config(world, routed_world, tmp_path / "init", *options, teachers=teachers("student_init")))
    assert all(r == 0.0 for r in add_rewards(frozen, 1))
    assert any(r != 0.0 for r in add_rewards(frozen, 2))  # the student moved: its initial weights are another model
    view = {"context_key": "answer", "context_template": " Answer: {context}"}
    seen = distill(_config(world, routed_world, tmp_path / "view", *options, teachers=teachers("student", view)))
    assert any(abs(r) > 1e-4 for r in add_rewards(seen, 1))


def test_a_view_alone_makes_the_live_students_reward_nonzero(world, routed_world, tmp_path):
    """The single live-student teacher with a view (privileged self-distillation on the current weights)."""
    view = {"context_key": "answer", "context_template": " Answer: {context}"}
    teachers = [{"name": "self", "path": "student", "view": view}]
    run_dir = distill(_config(world, routed_world, tmp_path, teachers=teachers))
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["reward_abs_mean"] > 1e-4 for m in metrics)
    (manifest,) = load_trainer_state(latest_checkpoint(run_dir))["teachers"]
    assert manifest["model"] == "student" and manifest["fingerprint"] == "student (live)"


def test_entries_naming_one_model_share_one_loaded_teacher(world, routed_world):
    from opd.models import load_tokenizer
    from opd.recipes.distill import _load_models as load_models
    from opd.train.distributed import SINGLE

    teachers = [dict(t, path=str(routed_world / "a")) for t in _split(routed_world)]
    view = {"context_key": "answer"}  # without one the live student is refused (it would teach nothing)
    teachers.append({"name": "self", "path": "student", "route": {"default": True}, "view": view})
    config = _config(world, routed_world, routed_world / "unused", teachers=teachers)
    models = load_models(config, None, load_tokenizer(str(world / "student")), SINGLE)
    a, b, own = (t.teacher for t in models.teachers)
    assert a is b and a.module is not None
    assert own.scorer is models.student_scorer and own.module is None


def _self_entry(**fields):
    return "teachers=" + json.dumps([{"name": "s", "path": "student", **fields}])


@pytest.mark.parametrize(
    ("field", "overrides"),
    [
        ("url", [_self_entry(url="http://127.0.0.1:1")]),
        ("engine", [_self_entry(engine="vllm")]),
        ("dtype", [_self_entry(dtype="fp32")]),
        ("device", [_self_entry(device="cpu")]),
        ("offload", [_self_entry(offload=True)]),
        ("trust_remote_code", [_self_entry(trust_remote_code=True)]),
        ("attn_implementation", [_self_entry(attn_implementation="eager")]),
        ("vllm", [_self_entry(vllm={"enforce_eager": True})]),
        ("dtype", ["teacher.path=student", "teacher.dtype=bf16"]),
        ("teacher_offload", ["teacher.path=student", "teacher_offload=true"]),
    ],
)
def test_path_student_refuses_placement_fields_in_one_line(world, tmp_path, monkeypatch, capfd, field, overrides):
    argv = ["distill", "--student", str(world / "student"), "--prompts", str(world / "prompts.jsonl")]
    argv += ["--out-dir", str(tmp_path), "--steps", "1", *overrides]
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, stderr, _ = run_in_process(argv, monkeypatch, capfd)
    line = one_line(code, stderr)
    assert field in line and "path: student" in line, stderr
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.parametrize("path", ["student", "student_init"])
def test_prompts_score_refuses_the_student_as_its_teacher(world, tmp_path, monkeypatch, capfd, path):
    argv = ["prompts", "score", "--student", str(world / "student"), "--teacher", path]
    argv += ["--in", str(world / "prompts.jsonl"), "--out", str(tmp_path / "s.jsonl")]
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, stderr, _ = run_in_process(argv, monkeypatch, capfd)
    assert f"teacher.path: {path}" in one_line(code, stderr), stderr
    assert not (tmp_path / "s.jsonl").exists()


def test_in_run_eval_is_split_by_the_teacher_routes(world, routed_world, tmp_path):
    """With several teachers, each benchmark the routes place whole also logs eval/teacher/<name>/<bench>/<metric>
    over the problems routed to each; the split recombines to the whole. A benchmark the routes cannot place (no
    data_source: the world's own prompts) keeps its overall metrics only."""
    bench = routed_world / "prompts.jsonl"
    unrouted = shutil.copy(world / "prompts.jsonl", tmp_path / "unrouted.jsonl")
    run_dir = distill(
        _config(
            world,
            routed_world,
            tmp_path,
            f"eval.benchmarks=[{bench},{unrouted}]",
            "eval.prompt_key=prompt",
            "eval.answer_key=answer",
            "eval.n=2",
            "eval.temperature=1.0",
            "eval.max_new_tokens=6",
            "run.eval_every=1",
            teachers=_split(routed_world),
            steps=1,
        )
    )
    logged = {k: v for m in read_jsonl(run_dir / "metrics.jsonl") for k, v in m.items() if k.startswith("eval/")}
    split = {k for k in logged if k.startswith("eval/teacher/")}
    assert {k.split("/")[2] for k in split} == {"a", "b"} and {k.split("/")[3] for k in split} == {"prompts"}
    assert "eval/unrouted/avg@2" in logged
    for metric in ("avg@2", "mean_response_tokens"):  # three problems each: the halves average to the whole
        halves = [logged[f"eval/teacher/{t}/prompts/{metric}"] for t in "ab"]
        assert sum(halves) / 2 == pytest.approx(logged[f"eval/prompts/{metric}"])


def test_opd_check_runs_per_teacher_on_its_routed_prompts(world, routed_world, tmp_path, monkeypatch, capfd):
    """`opd check` of a config with `teachers:`: each teacher's groups on the prompts routed to it
    (<out>/<name>/check.json), the routing table and every exit code in <out>/check.json, each recovery command
    naming its teacher's route; a teacher with a view gets teacher_view and no forecast; the live student (`path:
    student`) is checked as its initial weights, with its view."""
    from opd.recipes.check import run_check

    config = _config(world, routed_world, tmp_path, teachers=_split(routed_world))
    report = run_check(config, n=2, prompts_sample=8, out=tmp_path / "check", skip=["step_time"])
    summary = json.loads((tmp_path / "check" / "check.json").read_text())
    assert {name: row["prompts"] for name, row in summary["teachers"].items()} == {"a": 3, "b": 3}
    assert summary["exit_code"] == report.exit_code()
    for name, source in zip("ab", ("add", "mul")):
        own = json.loads((tmp_path / "check" / name / "check.json").read_text())
        assert own["forecast"]["prompts_sample"] == 3  # its own 3 of the 6 prompts, not the whole set
        assert summary["teachers"][name]["exit_code"] == own["exit_code"]
        # 2 × 3 rollouts are too few for a verdict: the recovery re-runs the check, on this teacher's route
        assert own["forecast"]["recovery"] == "more_rollouts"
        command = own["forecast"]["command"]
        assert command.endswith(f"teacher {name}'s route (data_source in ['{source}'], 3 prompts)")
        # re-run on the config's own teachers list: a --teacher would contradict it
        assert command.startswith(f"opd check --prompts {routed_world / 'prompts.jsonl'} --n 2 --prompts-sample 16")
    teachers = _split(routed_world)
    teachers[0]["view"] = {"context_key": "answer"}  # a view: teacher_view instead of a forecast
    run_check(_config(world, routed_world, tmp_path, teachers=teachers), n=2, prompts_sample=8, out=tmp_path / "c1")
    rows = {r["name"]: r for r in json.loads((tmp_path / "c1" / "a" / "check.json").read_text())["results"]}
    assert rows["teacher_view"]["status"] == "pass" and rows["forecast"]["status"] == "skip"
    assert "teacher_view" not in {
        r["name"] for r in json.loads((tmp_path / "c1" / "b" / "check.json").read_text())["results"]
    }
    teachers[0] = {"name": "a", "path": "student", "route": teachers[0]["route"], "view": teachers[0]["view"]}
    argv = ["check", "--student", str(world / "student"), "--prompts", str(routed_world / "prompts.jsonl")]
    argv += ["--out", str(tmp_path / "c2"), "data.answer_key=answer", f"teachers={json.dumps(teachers)}"]
    argv += ["--skip-check", "step_time", "--n", "2", "--prompts-sample", "8"]
    monkeypatch.delenv("OPD_DEBUG", raising=False)
    code, stderr, _ = run_in_process(argv, monkeypatch, capfd)
    assert code in (0, 3), stderr
    live = {r["name"]: r for r in json.loads((tmp_path / "c2" / "a" / "check.json").read_text())["results"]}
    assert live["teacher_view"]["status"] == "pass"  # the answer in its context moves the student's own scores
    # the student scoring its own samples: bit-identical twice, and its reward against itself is zero
    assert live["determinism"]["status"] == "pass" and live["self_distillation_zero"]["status"] == "pass"
    assert live["tokenizer_vocab"]["status"] == "pass" and live["memory"]["status"] != "fail"


def test_a_view_whose_context_never_reaches_the_teacher_stops_distill_at_startup(world, routed_world, tmp_path):
    """`teacher_view`: a chat template that drops the user message's content renders the view's prompt exactly as
    the student's, so the teacher's scores cannot move: distill stops before the first step with one line. The same
    view with the real template passes (the row runs in every view test above)."""
    blind = tmp_path / "blind"
    shutil.copytree(world / "student", blind)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"  # ignores every message
    tokenizer.save_pretrained(blind)
    teachers = [{"name": "self", "path": "student_init", "view": {"context_key": "answer"}}]
    config = _config(world, routed_world, tmp_path / "runs", f"student.path={blind}", teachers=teachers)
    with pytest.raises(ValueError, match=r"teacher_view failed .*unchanged for self") as stop:
        distill(config)
    assert "\n" not in str(stop.value) and "view.context_template" in str(stop.value)
    assert not list((tmp_path / "runs").rglob("metrics.jsonl"))


def test_opd_check_of_a_served_teacher_over_loopback(world, routed_world, tmp_path):
    """`opd check` with one local teacher and one served by an in-process `opd serve-teacher` on loopback (the same
    tiny teacher): both get <out>/<name>/check.json; the served one's tokenizer rows come from the server's /info,
    its scoring rows are served_scores and determinism, and its forecast runs on its own route's prompts (no teacher
    accuracy: it cannot generate)."""
    pytest.importorskip("uvicorn")
    from opd.config import ModelSpec
    from opd.models import load_model
    from opd.recipes.check import run_check
    from opd.recipes.serve_teacher import ServeConfig
    from opd.teacher.server import service_for

    model, tokenizer = load_model(str(routed_world / "b"), dtype="fp32", device="cpu")
    service = service_for(model, tokenizer, ServeConfig(model=ModelSpec(path=str(routed_world / "b"))), name="b")
    token_file = tmp_path / "token"
    token_file.write_text("served-check-token-0123456")
    with server_in_thread(service, token_file.read_text()) as url:
        teachers = _split(routed_world)
        teachers[1] = {"name": "b", "url": [url, url], "token_file": str(token_file), "route": teachers[1]["route"]}
        config = _config(world, routed_world, tmp_path, teachers=teachers)
        report = run_check(config, n=2, prompts_sample=8, out=tmp_path / "check")
    summary = json.loads((tmp_path / "check" / "check.json").read_text())
    assert summary["exit_code"] == report.exit_code() == 0
    local, served = (json.loads((tmp_path / "check" / n / "check.json").read_text()) for n in "ab")
    rows = {r["name"]: r for r in served["results"]}
    assert {rows[n]["status"] for n in ("tokenizer_vocab", "chat_template", "served_scores", "determinism")} == {"pass"}
    assert rows["special_tokens"]["status"] == rows["self_distillation_zero"]["status"] == "skip"
    assert rows["step_time"]["status"] != "fail" and served["mini_step"]["teacher"] > 0
    assert served["forecast"]["values"]["teacher_accuracy"] is None
    assert served["forecast"]["values"]["rollouts"] == 2 * 3  # n × its own 3 prompts
    assert local["forecast"]["values"]["teacher_accuracy"] is not None
    # the same teacher b in process, on the same route: the same forecast signals
    run_check(
        _config(world, routed_world, tmp_path, teachers=_split(routed_world)),
        n=2,
        prompts_sample=8,
        out=tmp_path / "both_local",
    )
    in_process = json.loads((tmp_path / "both_local" / "b" / "check.json").read_text())["forecast"]["values"]
    for key in ("overlap_ratio", "overlap_advantage", "entropy_teacher", "seq_reward_mean"):
        assert served["forecast"]["values"][key] == pytest.approx(in_process[key], abs=1e-4), key
    assert served["forecast"]["command"].endswith("teacher b's route (data_source in ['mul'], 3 prompts)")


def _startup_report(config):
    """distill's startup rows (`startup_checks`) for `config`, on the models and prompts `setup` would load."""
    from opd.models import load_tokenizer
    from opd.recipes import distill as recipe
    from opd.train.distributed import SINGLE

    tokenizer = load_tokenizer(config.student.path)
    data = recipe._load_data(config, tokenizer, None)
    prompt_teacher = recipe.route_teachers(config, data, None)
    models = recipe._load_models(config, None, tokenizer, SINGLE)
    for routed, view_ids in zip(models.teachers, recipe.teacher_views(config, data, prompt_teacher, tokenizer)):
        routed.prompt_ids = view_ids
    generator, _, _ = recipe._build_engines(config, models, SINGLE)
    return recipe.startup_checks(config, models, generator, data, tokenizer, SINGLE, None, prompt_teacher)


def test_each_teachers_startup_rows_run_on_prompts_of_its_own_route(world, routed_world, tmp_path):
    """distill's startup scoring rows and step_time run once per teacher, named row[teacher], each on the first
    prompts routed to it (a: the even prompts 0, 2; b, the live student: 1, 3, through served_scores); a run's only
    teacher keeps the plain row names, on the first prompts."""
    teachers = _split(routed_world)
    teachers[1] = {"name": "b", "path": "student", "route": teachers[1]["route"], "view": {"context_key": "answer"}}
    report = _startup_report(_config(world, routed_world, tmp_path, teachers=teachers))
    rows = {r.name: r.status for r in report.results}
    assert report.values["scoring_prompts"] == {"a": [0, 2], "b": [1, 3]}
    for row in ("determinism[a]", "self_distillation_zero[a]", "served_scores[b]", "step_time[a]", "step_time[b]"):
        assert rows[row] in ("pass", "warn"), (row, rows)
    assert "determinism" not in rows and "served_scores[a]" not in rows and "determinism[b]" not in rows
    assert {r.group for r in report.results if r.name.startswith("step_time")} == {"resources"}
    # the live student's tokenizer is the student's own: no tokenizer rows of its own
    assert rows["chat_template[a]"] == "pass" and not {"chat_template[b]", "chat_template"} & rows.keys()
    single = _startup_report(_config(world, routed_world, tmp_path / "one"))
    assert single.values["scoring_prompts"] == {"teacher": [0, 1]}
    assert {"determinism", "self_distillation_zero", "prompt_logprobs", "step_time"} <= {r.name for r in single.results}
    assert {"tokenizer_vocab", "special_tokens", "chat_template"} <= {r.name for r in single.results}


def test_each_in_process_teachers_tokenizer_rows_run_at_startup(world, routed_world, tmp_path):
    """distill's startup tokenizer rows run once per in-process teacher, named row[teacher]: two teachers with the
    student's tokenizer both pass (the live student gets none: the test above)."""
    report = _startup_report(_config(world, routed_world, tmp_path, teachers=_split(routed_world)))
    rows = {r.name: r.status for r in report.results}
    for row in ("tokenizer_vocab", "special_tokens", "chat_template"):
        assert rows[f"{row}[a]"] == rows[f"{row}[b]"] == "pass", (row, rows)
        assert row not in rows


def test_a_second_teacher_with_another_chat_template_stops_distill_at_startup(world, routed_world, tmp_path):
    """The second of two local teachers renders prompts with another chat template: distill stops before the first
    step with one line naming the row and that teacher."""
    other = tmp_path / "other"
    shutil.copytree(routed_world / "b", other)
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = "{{- '<|im_start|>system\\n<|im_end|>\\n' -}}" + CHAT_TEMPLATE
    tokenizer.save_pretrained(other)
    teachers = _split(routed_world)
    teachers[1]["path"] = str(other)
    refused = r"^opd check: chat_template\[b\] failed .*--skip-check chat_template"
    with pytest.raises(ValueError, match=refused) as stop:
        distill(_config(world, routed_world, tmp_path / "runs", teachers=teachers))
    assert "\n" not in str(stop.value) and "chat_template[a]" not in str(stop.value)
    assert not list((tmp_path / "runs").rglob("metrics.jsonl"))


def test_opd_check_checks_a_vllm_teacher_of_several_as_the_model_in_process(world, routed_world, tmp_path, capsys):
    """A vLLM teacher among several is checked as a single vLLM teacher is: the same model in process (a note says
    so), on the prompts routed to it, beside the other teachers; vllm itself is not needed."""
    teachers = _split(routed_world)
    teachers[1]["engine"] = "vllm"
    argv = ["check", "--student", str(world / "student"), "--prompts", str(routed_world / "prompts.jsonl")]
    argv += ["--out", str(tmp_path / "c"), "data.answer_key=answer", f"teachers={json.dumps(teachers)}"]
    code, out, err = cli(capsys, *argv)
    assert code in (0, 1), err  # 1: a forecast of "unlikely" on these tiny random models
    assert " ".join(out.split()).count("note: the teacher runs in vLLM (engine: vllm)") == 1
    combined = json.loads((tmp_path / "c" / "check.json").read_text())
    assert set(combined["teachers"]) == {"a", "b"}
    assert all((tmp_path / "c" / name / "check.json").is_file() for name in ("a", "b"))
