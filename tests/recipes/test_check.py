"""`opd check` (opd.check): each check on crafted student/teacher pairs, the forecast's classification thresholds,
the exit codes, the CLI, and `opd distill`'s startup refusal. Pairs are real tokenizers and models: the lab's
(shipped, tiny) and variants of their files (a swapped vocabulary, another chat template, another EOS)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from opd import check as C
from opd import lab
from opd.config import parse_override
from opd.lab.tokenizer import CHAT_TEMPLATE, build_lab_tokenizer

MESSAGES = [{"role": "user", "content": "Compute (3+4)*2. Put the final answer in \\boxed{}."}]


def _lab_tokenizer_dir(tmp_path: Path, name: str = "tok") -> Path:
    path = tmp_path / name
    build_lab_tokenizer().save_pretrained(path)
    return path


def _load(path: Path):
    from opd.models import load_tokenizer

    return load_tokenizer(path)


def _rows(results, name):
    (row,) = [r for r in results if r.name == name]
    return row


# ------------------------------------------------------------------------------------------------ tokenizers


def test_identical_tokenizers_pass():
    rows = C.check_tokenizers(
        build_lab_tokenizer(),
        build_lab_tokenizer(),
        messages=MESSAGES,
        student_rows=34,
        teacher_rows=40,
        student_eos_ids=[2],
        teacher_eos_ids=[2],
    )
    assert [r.status for r in rows] == ["pass", "pass", "pass"]
    assert "padding" in _rows(rows, "tokenizer_vocab").detail  # 34 vs 40 rows: padding rows are allowed


def test_different_vocab_fails(tiny_tokenizer):
    rows = C.check_tokenizers(build_lab_tokenizer(), tiny_tokenizer, messages=MESSAGES)
    vocab = _rows(rows, "tokenizer_vocab")
    assert vocab.status == "fail" and vocab.hard and "tokenizers differ" in vocab.detail


def test_swapped_ids_fail(tmp_path):
    path = _lab_tokenizer_dir(tmp_path)
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["3"], vocab["4"] = vocab["4"], vocab["3"]
    (path / "tokenizer.json").write_text(json.dumps(data))
    rows = C.check_tokenizers(build_lab_tokenizer(), _load(path), messages=MESSAGES)
    vocab_row = _rows(rows, "tokenizer_vocab")
    assert vocab_row.status == "fail" and "'3'" in vocab_row.detail
    # the templates render the same text, but to other ids: the first differing token is reported
    template = _rows(rows, "chat_template")
    assert template.status == "fail" and "first difference at token" in template.detail


def test_different_chat_template_reports_first_difference():
    teacher = build_lab_tokenizer()
    teacher.chat_template = "{{- '<|im_start|>system\\n<|im_end|>\\n' -}}" + CHAT_TEMPLATE
    row = _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "chat_template")
    assert row.status == "fail" and row.hard
    assert "first difference at token 1" in row.detail and "'user'" in row.detail and "'system'" in row.detail
    s, t = C.render_ids(build_lab_tokenizer(), MESSAGES, None), C.render_ids(teacher, MESSAGES, None)
    assert C.first_difference(s, t) == 1 and C.first_difference(s, s) is None
    assert C.first_difference([1, 2], [1, 2, 3]) == 2


def test_template_differing_only_with_thinking_off_warns_unless_the_run_uses_it():
    teacher = build_lab_tokenizer()
    teacher.chat_template = (
        CHAT_TEMPLATE + "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '\\n' -}}{%- endif -%}"
    )
    default = _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "chat_template")
    assert default.status == "warn" and "thinking off" in default.detail
    off = _rows(
        C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES, enable_thinking=False), "chat_template"
    )
    assert off.status == "fail"


def test_special_tokens(tmp_path):
    teacher = build_lab_tokenizer()
    teacher.eos_token = "<|endoftext|>"
    assert (
        _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "special_tokens").status == "fail"
    )
    eos_ids = C.check_tokenizers(
        build_lab_tokenizer(), build_lab_tokenizer(), messages=MESSAGES, student_eos_ids=[2], teacher_eos_ids=[0]
    )
    assert _rows(eos_ids, "special_tokens").status == "fail"  # the models stop on different tokens
    teacher = build_lab_tokenizer()
    teacher.pad_token = "<unk>"
    assert (
        _rows(C.check_tokenizers(build_lab_tokenizer(), teacher, messages=MESSAGES), "special_tokens").status == "warn"
    )


# --------------------------------------------------------------------------------------------------- scoring


@pytest.fixture(scope="module")
def lab_teacher():
    from opd.models import load_model

    model, tokenizer = load_model(lab.teacher_path(), dtype="fp32", device="cpu")
    return model, tokenizer


@pytest.fixture(scope="module")
def teacher_rollouts(lab_teacher):
    model, tokenizer = lab_teacher
    ids = [
        C.render_ids(tokenizer, MESSAGES, None),
        C.render_ids(tokenizer, [{"role": "user", "content": "Compute 7-9. Put the final answer in \\boxed{}."}], None),
    ]
    return C.teacher_samples(model, tokenizer, ids, temperature=1.0, max_new_tokens=48, vocab_size=34, seed=0)


class NoisyScorer:
    """A real `LocalScorer` whose log-probs get Gaussian noise on every call: a nondeterministic teacher."""

    def __init__(self, scorer, scale: float, seed: int = 0):
        self.scorer, self.scale = scorer, scale
        self.generator = torch.Generator().manual_seed(seed)

    def score(self, rollouts, **kwargs):
        scores = self.scorer.score(rollouts, **kwargs)
        noise = lambda x: None if x is None else x + self.scale * torch.randn(x.shape, generator=self.generator)  # noqa: E731
        scores.sampled_logprobs = noise(scores.sampled_logprobs)
        scores.topk_logprobs = noise(scores.topk_logprobs)
        return scores


def _scorer(model, **kwargs):
    from opd.teacher.local import LocalScorer

    return LocalScorer(model, vocab_size=34, **kwargs)


def test_determinism(lab_teacher, teacher_rollouts):
    scorer = _scorer(lab_teacher[0])
    assert C.check_determinism(scorer, teacher_rollouts, top_k=16, temperature=1.0).status == "pass"
    small = C.check_determinism(NoisyScorer(scorer, 1e-5), teacher_rollouts, top_k=16, temperature=1.0)
    assert small.status == "warn" and 0 < small.value <= C.DETERMINISM_TOLERANCE
    noisy = C.check_determinism(NoisyScorer(scorer, 0.05), teacher_rollouts, top_k=16, temperature=1.0)
    assert noisy.status == "fail" and noisy.hard and noisy.value > C.DETERMINISM_TOLERANCE


def test_determinism_catches_dropout_left_on(lab_teacher, teacher_rollouts):
    """A model whose layers drop activations even in eval mode (a scorer that would not turn dropout off)."""
    import copy

    model = copy.deepcopy(lab_teacher[0])
    for layer in model.model.layers:
        layer.mlp.register_forward_hook(lambda m, i, out: torch.nn.functional.dropout(out, 0.1, training=True))
    # (LocalScorer's own one-off head check would already trip over the random outputs: skip it to reach ours)
    row = C.check_determinism(_scorer(model, check_head=False), teacher_rollouts, top_k=16, temperature=1.0)
    assert row.status == "fail"


def test_self_distillation_zero(lab_teacher, teacher_rollouts):
    scorer = _scorer(lab_teacher[0])
    row = C.check_self_distillation(scorer, teacher_rollouts, temperature=1.0, dtype=torch.float32)
    assert row.status == "pass" and row.value < 1e-4  # fp32: two orders of summation, ~1e-7 measured
    # a scorer at another temperature than the samples were drawn with: the reward of a model against itself ≠ 0
    # (the lab student: the lab teacher is so peaked, entropy ~0.002 nats, that τ barely moves its log-probs)
    from opd.models import load_model

    student, tokenizer = load_model(lab.student_path(), dtype="fp32", device="cpu")
    ids = [C.render_ids(tokenizer, MESSAGES, None)] * 4
    samples = C.teacher_samples(student, tokenizer, ids, temperature=1.0, max_new_tokens=48, vocab_size=34, seed=0)
    assert C.check_self_distillation(_scorer(student), samples, temperature=1.0, dtype=torch.float32).status == "pass"
    wrong = C.check_self_distillation(_scorer(student), samples, temperature=0.5, dtype=torch.float32)
    assert wrong.status == "fail" and wrong.value > C.SELF_ZERO_TOLERANCE[torch.float32]
    noisy = C.check_self_distillation(NoisyScorer(scorer, 0.1), teacher_rollouts, temperature=1.0, dtype=torch.float32)
    assert noisy.status == "fail"


def test_prompt_logprobs_rule():
    big, small = 8_000_000_000, 1_700_000_000
    ok = C.check_prompt_logprobs(2.0, 1.9, student_params=small, teacher_params=big, vocab_size=151_000)
    assert ok.status == "pass" and ok.value["predicted_teacher"] == pytest.approx(2.0 * (small / big) ** 0.076)
    worse = C.check_prompt_logprobs(2.0, 4.0, student_params=small, teacher_params=big, vocab_size=151_000)
    assert worse.status == "warn"
    broken = C.check_prompt_logprobs(2.0, float("nan"), student_params=small, teacher_params=big, vocab_size=151_000)
    assert broken.status == "fail" and broken.hard
    # neither model was trained on the text (the lab's prompt tokens): the comparison says nothing
    untrained = C.check_prompt_logprobs(7.0, 12.0, student_params=small, teacher_params=big, vocab_size=34)
    assert untrained.status == "skip" and "uninformative" in untrained.detail


def test_nll_of_texts_matches_a_plain_forward(lab_teacher):
    model, tokenizer = lab_teacher
    ids = C.render_ids(tokenizer, MESSAGES, None)
    nll = C.nll_of_texts(_scorer(model), [ids], pad_id=tokenizer.pad_token_id, device=torch.device("cpu"))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    expected = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()
    assert nll == pytest.approx(expected, abs=1e-4)  # fp32: the chunked head vs one matmul


# --------------------------------------------------------------------------------------------------- forecast

ALIGNED = dict(
    overlap_ratio=0.6,
    overlap_mass_student=0.98,
    overlap_mass_teacher=0.99,
    overlap_advantage=-0.1,
    seq_reward_auroc=0.9,
    student_accuracy=0.4,
    teacher_accuracy=1.0,
)


@pytest.mark.parametrize(
    "change, verdict, recovery",
    [
        ({}, "likely", "none"),
        ({"overlap_ratio": 1.0, "overlap_advantage": 0.0}, "unlikely", "other_teacher"),
        ({"teacher_accuracy": 0.42}, "unlikely", "other_teacher"),
        ({"overlap_advantage": -0.3}, "unlikely", "cold_start"),
        ({"seq_reward_auroc": 0.5}, "unlikely", "cold_start"),
        ({"overlap_advantage": -0.17}, "uncertain", "prompt_selection"),
        ({"overlap_mass_teacher": 0.8}, "uncertain", "prompt_selection"),
        ({"seq_reward_auroc": 0.58}, "uncertain", "prompt_selection"),
        ({"seq_reward_auroc": None, "student_accuracy": None, "teacher_accuracy": None}, "likely", "none"),
    ],
)
def test_classify(change, verdict, recovery):
    out = C.classify({**ALIGNED, **change})
    assert (out["verdict"], out["recovery"]) == (verdict, recovery), out["reasons"]
    assert out["reasons"]


@pytest.mark.parametrize(
    "change, verdict",
    [({}, "likely"), ({"teacher_accuracy": 0.42}, "unlikely"), ({"overlap_advantage": -0.17}, "uncertain")],
)
def test_classify_thin_evidence_is_no_verdict(change, verdict):
    """A handful of rollouts (issue 22 item 15): no confident verdict either way; min_rollouts of them keep it."""
    th = C.ForecastThresholds()
    thin = C.classify({**ALIGNED, **change, "rollouts": th.min_rollouts - 1})
    assert (thin["verdict"], thin["recovery"]) == ("uncertain", "more_rollouts")
    assert thin["reasons"] == [
        f"evidence too thin: 31 student rollouts, fewer than the {th.min_rollouts} a forecast needs"
    ]
    assert C.classify({**ALIGNED, **change, "rollouts": th.min_rollouts})["verdict"] == verdict
    # the teacher being the student is told on any number of tokens
    same = C.classify({**ALIGNED, "overlap_ratio": 1.0, "overlap_advantage": 0.0, "rollouts": 2})
    assert (same["verdict"], same["recovery"]) == ("unlikely", "other_teacher")
    command = C.recovery_command("more_rollouts", student="S", teacher="T", prompts="P", n=2, prompts_sample=3)
    assert command.startswith("opd check --student S --teacher T --prompts P --n 2 --prompts-sample 16 ")
    assert "or --n 11 on 3 prompts" in command


def test_classify_thresholds_are_the_boundaries():
    th = C.ForecastThresholds()
    assert C.classify({**ALIGNED, "overlap_advantage": th.ok_overlap_advantage})["verdict"] == "likely"
    assert C.classify({**ALIGNED, "overlap_advantage": th.fail_overlap_advantage})["verdict"] == "uncertain"
    assert C.classify({**ALIGNED, "overlap_advantage": th.fail_overlap_advantage - 1e-6})["verdict"] == "unlikely"
    strict = C.ForecastThresholds(min_auroc=0.95)
    assert C.classify(ALIGNED, strict)["verdict"] == "uncertain"
    assert C.recovery_command("cold_start", student="S", teacher="T", prompts="P").startswith("opd pipeline run")
    assert "opd prompts select" in C.recovery_command("prompt_selection", student="S", teacher="T", prompts="P")


def test_recovery_commands_name_a_served_teacher_by_every_replica_url():
    """A served teacher is named by the `teacher.url` override with all its replicas (--teacher is a model path),
    quoted for the shell and read back as the list; the cold start, which needs its weights, says so."""
    replicas = ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]
    select = C.recovery_command("prompt_selection", student="S", teacher=replicas, prompts="P", served=True)
    assert select.startswith("opd prompts score --student S 'teacher.url=[http://10.0.0.1:8000,http://10.0.0.2:8000]'")
    assert parse_override(shlex.split(select)[5]) == ("teacher.url", replicas)
    more = C.recovery_command("more_rollouts", student="S", teacher=replicas[0], prompts="P", served=True)
    assert more.startswith("opd check --student S teacher.url=http://10.0.0.1:8000 --prompts P ")
    cold = C.recovery_command("cold_start", student="S", teacher=replicas, prompts="P", served=True)
    assert cold.startswith("# a served teacher cannot") and "http" not in cold


# --------------------------------------------------------------------------------------------------- resources


def test_memory_estimate_and_check(lab_teacher):
    from opd.recipes.demo import demo_config

    model = lab_teacher[0]
    small = C.estimate_memory(demo_config(), model, model, compute_dtype=torch.float32)["cpu"]
    big = C.estimate_memory(
        demo_config(["rollout.batch_size=512", "prompts_per_step=128"]), model, model, compute_dtype=torch.float32
    )["cpu"]
    assert big["kv_cache"] == 16 * small["kv_cache"] > 0  # rows = min(batch_size, prompts × n): 32 → 512
    params = sum(p.numel() for p in model.parameters())
    assert small["adamw_state"] == 2 * 4 * params and small["teacher_weights"] == 4 * params
    needs = {"cpu": small}
    total = sum(small.values())
    assert C.check_memory(needs, free={"cpu": 10 * total}).status == "pass"
    assert C.check_memory(needs, free={"cpu": int(total / 0.9)}).status == "warn"
    failed = C.check_memory(needs, free={"cpu": total // 2})
    assert failed.status == "fail" and failed.hard and failed.fix


def test_memory_estimate_counts_every_teacher_where_it_lives(lab_teacher):
    """Several teachers: each one's weights under its own name where they live, the scoring activations once (the
    largest: teachers score one after another); one teacher keeps its single `teacher_weights` entry."""
    from opd.recipes.demo import demo_config

    model = lab_teacher[0]
    bytes_ = sum(p.numel() * p.element_size() for p in model.parameters())
    one = C.estimate_memory(demo_config(), model, model, compute_dtype=torch.float32)["cpu"]
    two = C.estimate_memory(
        demo_config(), model, None, compute_dtype=torch.float32, teachers=[("a", model, True), ("b", model, False)]
    )["cpu"]
    assert one["teacher_weights"] == two["teacher_weights[a]"] == two["teacher_weights[b]"] == bytes_
    assert "teacher_weights" not in two and two["teacher_activations"] == one["teacher_activations"]
    assert sum(two.values()) == sum(one.values()) + bytes_


def test_exit_codes_and_skips():
    report = C.CheckReport([C.CheckResult("memory", "pass", hard=True)])
    assert report.exit_code() == C.EXIT_OK
    report.values["forecast"] = {"verdict": "unlikely"}
    assert report.exit_code() == C.EXIT_UNLIKELY
    report.results.append(C.CheckResult("determinism", "fail", hard=True))
    assert report.exit_code() == C.EXIT_FAILED
    assert C.CheckReport([C.CheckResult("seq_reward_auroc", "warn")]).exit_code() == C.EXIT_OK
    assert C.resolve_skips(["scoring", "memory"]) == {
        "determinism",
        "self_distillation_zero",
        "prompt_logprobs",
        "served_scores",
        "generation_scoring",
        "teacher_view",
        "memory",
    }
    assert C.resolve_skips(["all"]) == set(C.CHECKS)
    with pytest.raises(ValueError, match="unknown check 'memroy'"):
        C.resolve_skips(["memroy"])


# ------------------------------------------------------------------------------------------------- CLI + distill

LAB = [
    "rollout.max_new_tokens=64",
    "data.max_prompt_length=64",
    "student.device=cpu",
    "teacher.device=cpu",
    "student.dtype=fp32",
    "teacher.dtype=fp32",
    "micro_batch_tokens=8192",
    "prompts_per_step=4",
    "rollout.n=2",
]


def _check_cli(tmp_path, teacher, *extra):
    from opd.cli import app

    out = tmp_path / "check"
    args = [
        "check",
        "--student",
        str(lab.student_path()),
        "--teacher",
        str(teacher),
        "--prompts",
        str(lab.opd_prompts_path()),
        "--n",
        "2",
        "--prompts-sample",
        "8",
        "--out",
        str(out),
        *extra,
        *LAB,
    ]
    result = CliRunner().invoke(app, args)
    return result, (json.loads((out / "check.json").read_text()) if (out / "check.json").is_file() else None)


def test_cli_lab_pair_passes(tmp_path):
    result, report = _check_cli(tmp_path, lab.teacher_path())
    assert result.exit_code == C.EXIT_OK, result.output
    assert report["exit_code"] == 0 and report["forecast"]["verdict"] in ("likely", "uncertain")
    names = {r["name"]: r for r in report["results"]}
    # a local teacher's scores are checked by the rest; the student's engine against its scorer at distill's startup
    # teacher_view: a run with a view's (distill's startup)
    assert set(names) == set(C.CHECKS) - {"served_scores", "generation_scoring", "teacher_view"}
    for name in (
        "tokenizer_vocab",
        "special_tokens",
        "chat_template",
        "determinism",
        "self_distillation_zero",
        "memory",
    ):
        assert names[name]["status"] == "pass", names[name]
    assert report["forecast"]["values"]["teacher_accuracy"] > report["forecast"]["values"]["student_accuracy"]
    assert names["step_time"]["value"] > 0 and "opd check" in result.output
    # 2 × 8 = 16 rollouts: too few for a verdict, and the output says so with the command that gets one
    assert report["forecast"]["recovery"] == "more_rollouts"
    assert "forecast: no verdict: evidence too thin: 16 student rollouts" in result.output
    assert "--n 2 --prompts-sample 16" in result.output
    # check.json is never replaced: a second run into the same --out refuses (a one-line error, exit 2 via main)
    again, _ = _check_cli(tmp_path, lab.teacher_path())
    assert isinstance(again.exception, FileExistsError)


def test_cli_student_as_teacher_is_unlikely(tmp_path):
    result, report = _check_cli(tmp_path, lab.student_path(), "--skip-check", "resources")
    assert result.exit_code == C.EXIT_UNLIKELY, result.output
    assert report["forecast"]["recovery"] == "other_teacher"
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert statuses["memory"] == statuses["step_time"] == "skip"


def test_cli_other_vocabulary_fails(tmp_path, tiny_model_dir):
    result, report = _check_cli(tmp_path, tiny_model_dir)
    assert result.exit_code == C.EXIT_FAILED, result.output
    statuses = {r["name"]: r["status"] for r in report["results"]}
    assert statuses["tokenizer_vocab"] == "fail" and statuses["determinism"] == "skip"


@pytest.mark.slow
def test_cli_bad_input_is_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "check",
            "--student",
            str(lab.student_path()),
            "--teacher",
            str(lab.teacher_path()),
            "--prompts",
            str(lab.opd_prompts_path()),
            "--skip-check",
            "nope",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "unknown check 'nope'" in lines[0], result.stderr


def _other_template_teacher(tmp_path) -> Path:
    path = tmp_path / "teacher_other_template"
    shutil.copytree(lab.teacher_path(), path)
    (path / "chat_template.jinja").write_text("{{- '<|im_start|>system\\n<|im_end|>\\n' -}}" + CHAT_TEMPLATE)
    return path


def test_distill_refuses_on_a_hard_failure_unless_skipped(tmp_path):
    from opd.recipes.demo import demo_config
    from opd.recipes.distill import distill

    teacher = _other_template_teacher(tmp_path)
    small = [
        f"teacher.path={teacher}",
        f"run.out_dir={tmp_path}",
        "run.steps=1",
        "eval.limit=2",
        "prompts_per_step=2",
        "rollout.n=2",
        "run.report=false",
    ]
    with pytest.raises(ValueError, match="chat_template failed.*--skip-check chat_template"):
        distill(demo_config([*small, "run.name=refused"]))
    assert not (tmp_path / "refused" / "metrics.jsonl").exists()  # refused before any step
    run = distill(demo_config([*small, "run.name=skipped", "skip_checks=chat_template"]))
    assert (run / "metrics.jsonl").is_file()


def test_preflight_is_cheap_and_leaves_training_unchanged(tmp_path):
    """The startup checks draw no global random numbers and change no weights: a run with them equals one without."""
    from opd.recipes.demo import demo_config
    from opd.recipes.distill import distill

    small = [
        f"run.out_dir={tmp_path}",
        "run.steps=2",
        "eval.limit=2",
        "prompts_per_step=2",
        "rollout.n=2",
        "run.report=false",
        "run.samples_per_step=0",
    ]
    rows = []
    for name, skip in (("checked", "[]"), ("unchecked", "all")):
        run = distill(demo_config([*small, f"run.name={name}", f"skip_checks={skip}"]))
        rows.append(
            [
                {k: v for k, v in json.loads(line).items() if not k.startswith("time") and k != "tokens_per_second"}
                for line in (run / "metrics.jsonl").read_text().splitlines()
            ]
        )
    assert rows[0] == rows[1]
