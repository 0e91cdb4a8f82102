"""`opd distill` with a teacher of another vocabulary, through the CLI: auto picks the cross path and says so, the
step logs its xtok/ shares, `tokenizer: same` keeps the old refusal, and a teacher that cannot encode the student's
text stops at startup in one line."""

import json

import pytest

from helpers import cli, make_tiny_model, make_tiny_tokenizer, one_line
from helpers_cross_vocab import byte_bpe, characters, teacher_model


@pytest.fixture(scope="module")
def cross_world(tmp_path_factory):
    """A tiny student (byte-level, no merges), a byte-level BPE teacher and a characters-only teacher (no byte
    fallback), and a prompt set whose answers hold a character the latter cannot encode."""
    root = tmp_path_factory.mktemp("cross")
    make_tiny_model("qwen3", seed=0).save_pretrained(root / "student")
    make_tiny_tokenizer().save_pretrained(root / "student")
    for name, tokenizer in (("bpe", byte_bpe()), ("chars", characters(byte_fallback=False))):
        teacher_model(tokenizer).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    rows = [{"prompt": f"{i}+{i}=", "answer": f"{2 * i} 数"} for i in range(6)]
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _args(root, tmp_path, teacher, *extra):
    return [
        "distill",
        f"student.path={root / 'student'}",
        f"teacher.path={root / teacher}",
        f"data.path={root / 'prompts.jsonl'}",
        "data.answer_key=answer",
        "data.max_prompt_length=32",
        "prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=6",
        "micro_batch_tokens=64",
        f"run.out_dir={tmp_path}",
        "run.name=run",
        "run.steps=1",
        "run.report=false",
        *extra,
    ]


def test_auto_runs_a_teacher_of_another_vocabulary_through_the_cross_path(cross_world, tmp_path, capsys):
    code, out, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "objective.top_k=4"))
    assert code == 0, err
    assert "tokenizer auto → cross" in out and "cross_tokenizer pass" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    shares = [metrics[f"xtok/{k}_frac"] for k in ("exact", "span", "unmapped")]
    assert sum(shares) == pytest.approx(1.0)


@pytest.mark.parametrize("teacher_temperature", [1.0, 0.7])
def test_a_cross_teacher_scores_at_the_objectives_teacher_temperature(tmp_path, capsys, teacher_temperature):
    """The lab student's own weights as the teacher, once through the same-vocabulary path and once forced through
    the cross path (`tokenizer: cross`, the student's tokenizer twice): the first step's rewards are equal. At
    τ_T = 1 they are 0 (the teacher is the student); at 0.7 the teacher's logits are divided by τ_T on both paths."""
    from opd import lab

    runs = {}
    for mode in ("same", "cross"):
        code, _, err = cli(
            capsys,
            "distill",
            f"student.path={lab.student_path()}",
            f"teacher.path={lab.student_path()}",
            f"teacher.tokenizer={mode}",
            f"data.path={lab.opd_prompts_path()}",
            "data.max_prompt_length=64",
            "prompts_per_step=2",
            "rollout.n=2",
            "rollout.max_new_tokens=16",
            "objective.top_k=0",
            f"objective.teacher_temperature={teacher_temperature}",
            f"run.out_dir={tmp_path / mode}",
            "run.name=run",
            "run.steps=1",
            "run.report=false",
        )
        assert code == 0, err
        runs[mode] = json.loads((tmp_path / mode / "run" / "metrics.jsonl").read_text().splitlines()[0])
    same, cross = runs["same"], runs["cross"]
    assert cross["xtok/exact_frac"] == 1.0 and "xtok/exact_frac" not in same  # every token one-to-one
    assert cross["reward_abs_mean"] == pytest.approx(same["reward_abs_mean"], abs=1e-6)
    assert cross["reward_mean"] == pytest.approx(same["reward_mean"], abs=1e-6)
    assert (same["reward_abs_mean"] > 0.01) == (teacher_temperature != 1.0)


def test_tokenizer_same_refuses_another_vocabulary_in_one_line(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "teacher.tokenizer=same"))
    assert "tokenizers differ" in one_line(code, err) or "missing from the teacher" in err


def test_a_cross_teacher_refuses_a_strategy_with_teacher_slots_in_one_line(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "objective.strategy=union"))
    assert "strategy: only_stu" in one_line(code, err)


def test_a_teacher_that_cannot_encode_the_text_stops_at_startup(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "chars"))
    line = one_line(code, err)
    assert "cross_tokenizer failed" in line and "数" in line


def test_opd_check_gives_a_teacher_of_another_vocabulary_its_cross_tokenizer_row(cross_world, tmp_path, capsys):
    args = [a for a in _args(cross_world, tmp_path, "bpe") if not a.startswith(("run.", "prompts_per", "rollout."))]
    code, out, err = cli(capsys, "check", *args[1:], f"run.out_dir={tmp_path}")
    assert code == 0, err
    report = json.loads(next(tmp_path.rglob("check.json")).read_text())
    row = next(r for r in report["results"] if r["name"] == "cross_tokenizer")
    assert row["status"] == "pass" and "exact-string map" in row["detail"]
    assert "on the forecast's rollouts" in row["detail"]  # coverage on the student's sampled rollouts
    shares = report["cross_tokenizer"]["rollouts"]
    assert sum(shares[f"xtok/{k}_frac"] for k in ("exact", "span", "unmapped")) == pytest.approx(1.0)
    rows = {r["name"]: r for r in report["results"]}
    assert rows["forecast"]["status"] != "skip" and rows["seq_reward_auroc"]["status"] in ("pass", "warn", "skip")
    assert report["forecast"]["values"]["rollouts"] > 0 and report["forecast"]["values"]["seq_reward_mean"] is not None
    assert rows["self_distillation_zero"]["status"] == "skip" and rows["step_time"]["status"] == "skip"


def test_opd_check_runs_no_forecast_when_the_teacher_cannot_encode_the_text(cross_world, tmp_path, capsys):
    args = [a for a in _args(cross_world, tmp_path, "chars") if not a.startswith(("run.", "prompts_per", "rollout."))]
    code, _, _ = cli(capsys, "check", *args[1:], f"run.out_dir={tmp_path}")
    report = json.loads(next(tmp_path.rglob("check.json")).read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert rows["cross_tokenizer"]["status"] == "fail" and code == report["exit_code"] != 0
    assert rows["forecast"]["status"] == "skip" and "cross_tokenizer row failed" in rows["forecast"]["detail"]


def test_the_cross_forecast_of_one_tokenizer_twice_is_the_same_vocabulary_forecast(cross_world, tmp_path):
    """The forecast of a cross teacher is computed on the aligned signal (the training step's cross scoring): with
    the student's own tokenizer as the teacher's (`tokenizer: cross` forces the path) every span is one-to-one and
    every position exact, so it equals the same-vocabulary forecast."""
    import io

    from rich.console import Console

    from opd import lab
    from opd.config import DistillConfig
    from opd.recipes.check import run_check

    def values(tokenizer, name):
        config = DistillConfig.model_validate(
            {
                "student": {"path": str(lab.student_path()), "device": "cpu", "dtype": "fp32"},
                "teacher": {"path": str(lab.teacher_path()), "device": "cpu", "dtype": "fp32", "tokenizer": tokenizer},
                "data": {"path": str(lab.opd_prompts_path()), "max_prompt_length": 64},
                "rollout": {"max_new_tokens": 24},
                "run": {"out_dir": str(tmp_path)},
            }
        )
        report = run_check(
            config,
            n=2,
            prompts_sample=4,
            out=tmp_path / name,
            skip=["scoring", "resources"],
            console=Console(file=io.StringIO(), width=200),
        )
        return report.values["forecast"]["values"], {r.name: r for r in report.results}

    same, same_rows = values("same", "same")
    cross, cross_rows = values("cross", "cross")
    assert "cross_tokenizer" in cross_rows and "cross_tokenizer" not in same_rows
    for key, value in same.items():
        if key == "seconds":
            continue
        if isinstance(value, float):
            assert cross[key] == pytest.approx(value, abs=1e-6), key
        else:
            assert cross[key] == value, key


def test_a_teachers_list_mixes_a_cross_and_a_same_vocabulary_teacher(cross_world, tmp_path, capsys):
    config = {
        "student": {"path": str(cross_world / "student")},
        "teachers": [
            {
                "name": "cross",
                "path": str(cross_world / "bpe"),
                "route": {"route_key": "id", "values": ["0", "1", "2"]},
            },
            {"name": "same", "path": str(cross_world / "student"), "route": {"default": True}},
        ],
        "data": {"path": str(cross_world / "prompts.jsonl"), "answer_key": "answer", "max_prompt_length": 32},
        "rollout": {"n": 2, "max_new_tokens": 6},
        "objective": {"top_k": 4},
        "prompts_per_step": 4,
        "micro_batch_tokens": 64,
        "run": {"out_dir": str(tmp_path), "name": "run", "steps": 1, "report": False},
    }
    path = tmp_path / "two.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    code, out, err = cli(capsys, "distill", "-c", str(path))
    assert code == 0, err
    assert "teacher cross: tokenizer auto → cross" in out and "teacher same" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert 0 < metrics["teacher/cross/token_frac"] < 1 and "xtok/exact_frac" in metrics  # 3 of 6 prompts each


TEXTS = ["Compute 12 + 35 = 47.", "the answer is \\boxed{47}", "Café: naïve 数学", "x * x  # square"]


def _prefix_reference(cross, model, prompt, student_ids, teacher_ids, tau=1.0):
    """Per student token of one row (its text tokens, then its EOS), the teacher's log-prob `prefix` credits it, in
    float64 from the teacher's whole distribution at every position: cuts where both byte offsets agree; within a
    span, L_i = the span's teacher tokens before the one covering token i's end plus log Σ over the teacher tokens
    that begin with that token's bytes up to that end; L_i − L_prev (the span's sum on its last token). `tau`: the
    teacher's temperature, dividing its logits."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + teacher_ids])).logits[0, len(prompt) - 1 : -1]
    lp = (logits.double() / tau).log_softmax(-1)
    table = cross.teacher.table
    t_bytes = [table[i] for i in teacher_ids[:-1]]
    t_end = [sum(len(b) for b in t_bytes[: j + 1]) for j in range(len(t_bytes))]
    s_bytes = [cross.student.table[i] for i in student_ids[:-1]]
    s_end = [sum(len(b) for b in s_bytes[: i + 1]) for i in range(len(s_bytes))]
    cuts = sorted(set(s_end) & set(t_end))
    out, previous = [], 0.0
    for end in s_end:
        start = max([c for c in cuts if c < end], default=0)
        span_t = [j for j, e in enumerate(t_end) if start < e <= next(c for c in cuts if c >= end)]
        if end in cuts:
            cumulative = sum(float(lp[j, teacher_ids[j]]) for j in span_t)
        else:
            j = next(j for j, e in enumerate(t_end) if e > end)
            prefix = t_bytes[j][: end - (t_end[j] - len(t_bytes[j]))]
            ids = [v for v, b in enumerate(table) if b.startswith(prefix)]
            before = sum(float(lp[k, teacher_ids[k]]) for k in span_t if k < j)
            cumulative = before + float(lp[j, ids].logsumexp(-1))
        out.append(cumulative - previous)
        previous = 0.0 if end in cuts else cumulative
    out.append(float(lp[-1, teacher_ids[-1]]))  # the stop: the EOS span, one token each
    return out


@pytest.mark.parametrize("tau", [1.0, 0.7])
@pytest.mark.parametrize("kinds", [("characters", "byte_bpe"), ("byte_bpe", "sentencepiece")])
def test_prefix_credit_matches_the_teachers_whole_distribution_in_float64(kinds, tau):
    """A student and a teacher of other tokenizers (characters under byte-level BPE: every word a span of several
    student tokens; byte-level BPE under SentencePiece: both ways): through `start_cross_scoring`, each student
    token's teacher log-prob under `span_credit: prefix` equals the dense float64 reference from the teacher's full
    distribution, and the spans still sum to the teacher's log-prob of the whole text; at τ_T = 0.7 too (the
    teacher's logits divided by it, in the span log-probs and the prefix masses alike)."""
    import torch

    from helpers_cross_vocab import KINDS, chat_prompt, text_rollouts
    from opd.teacher.cross_vocab import build_cross_vocab, start_cross_scoring
    from opd.teacher.local import LocalScorer

    student_tok, teacher_tok = KINDS[kinds[0]](), KINDS[kinds[1]]()
    student_model = make_tiny_model(vocab_size=max(len(student_tok), 261), seed=4)
    model = teacher_model(teacher_tok, seed=3)
    rollouts, _ = text_rollouts(student_tok, TEXTS, student_tok.eos_token_id)
    prompts = [chat_prompt(teacher_tok, i) for i in range(len(TEXTS))]
    student = LocalScorer(student_model).score(rollouts, top_k=0)
    cross = build_cross_vocab(student_tok, teacher_tok, student_eos_ids=[student_tok.eos_token_id], credit="prefix")
    call = start_cross_scoring(cross, LocalScorer(model), rollouts, student, prompts, top_k=0, temperature=tau)
    got = call.result().sampled_logprobs
    interior = 0
    for b in range(len(TEXTS)):
        n = int(rollouts.response_mask[b].sum())
        m = int(call.aligned.teacher_mask_BN[b].sum())
        teacher_ids = call.aligned.teacher_ids_BN[b, :m].tolist()
        want = _prefix_reference(cross, model, prompts[b], rollouts.response_ids[b, :n].tolist(), teacher_ids, tau)
        assert torch.allclose(got[b, :n].double(), torch.tensor(want, dtype=torch.float64), atol=2e-5, rtol=0), (
            b,
            got[b, :n],
            want,
        )
        interior += int((call.aligned.prefix_at_BT[b] >= 0).sum())
    assert interior >= 5  # the prefix masses are in play, not only one-to-one spans


def test_prefix_credit_with_one_tokenizer_twice_is_the_same_vocabulary_reward():
    """Every span one-to-one: `prefix` gives each token the teacher's own log-prob, as the same-vocabulary path
    (within 1e-6), and asks for no prefix mass."""
    import torch

    from helpers import EOS_ID
    from helpers_cross_vocab import text_rollouts
    from opd.teacher.cross_vocab import build_cross_vocab, start_cross_scoring
    from opd.teacher.local import LocalScorer

    tokenizer = make_tiny_tokenizer()
    rollouts, prompts = text_rollouts(tokenizer, TEXTS, EOS_ID)
    student = LocalScorer(make_tiny_model(seed=0)).score(rollouts, top_k=4)
    scorer = LocalScorer(make_tiny_model(seed=1))
    same = scorer.score(rollouts, top_k=0, requested_ids=student.topk_ids)
    cross = build_cross_vocab(tokenizer, tokenizer, student_eos_ids=[EOS_ID], credit="prefix")
    call = start_cross_scoring(cross, scorer, rollouts, student, prompts, top_k=4, temperature=1.0)
    crossed, mask = call.result(), rollouts.response_mask
    assert not (call.aligned.prefix_at_BT >= 0).any()
    assert torch.allclose(crossed.sampled_logprobs[mask], same.sampled_logprobs[mask], atol=1e-6, rtol=0)
    assert torch.allclose(crossed.requested_logprobs[mask], same.requested_logprobs[mask], atol=1e-6, rtol=0)


def test_distill_runs_with_span_credit_prefix(cross_world, tmp_path, capsys):
    code, out, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "teacher.span_credit=prefix"))
    assert code == 0, err
    assert "span_credit: prefix" in out
    metrics = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert metrics["xtok/span_frac"] > 0


def test_a_bad_span_credit_is_refused_in_one_line(cross_world, tmp_path, capsys):
    code, _, err = cli(capsys, *_args(cross_world, tmp_path, "bpe", "teacher.span_credit=middle"))
    line = one_line(code, err)
    assert "span_credit" in line and "prefix" in line and "even" in line


def test_span_credit_prefix_with_a_served_cross_teacher_is_refused_in_one_line(tmp_path):
    from opd.config import TeacherEntry
    from opd.teacher.cross_vocab import resolve_tokenizer_mode

    byte_bpe().save_pretrained(tmp_path / "other")
    entry = TeacherEntry(
        name="t", url="http://127.0.0.1:9", tokenizer_path=str(tmp_path / "other"), span_credit="prefix"
    )
    with pytest.raises(ValueError, match="span_credit: prefix needs the teacher's distribution") as error:
        resolve_tokenizer_mode(entry, make_tiny_tokenizer())  # refused before the server is asked anything
    assert "\n" not in str(error.value) and "span_credit: even or last" in str(error.value)
