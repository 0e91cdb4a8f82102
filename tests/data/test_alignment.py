"""Teacher-aligned prompts (opd.data.alignment): re-templating real DAPO rows, per-prompt overlap scores on tiny
random models (ranges, teacher == student, per-group == batch diagnostics, resume), selection and mixing, and the
one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import SMALL_SCORING, make_prompts, make_tiny_model, make_tiny_tokenizer, score_config
from opd.config import ConfigError
from opd.data.alignment import retemplate
from opd.data.prompts import DataError, load_prompts, save_prompts
from opd.data.templates import BOXED_SUFFIX, DAPO_PREFIX, DAPO_SUFFIX, strip_template
from opd.eval.prompt_scores import (
    ALIGNMENT_METRICS,
    METRICS,
    PromptScore,
    group_diagnostics,
    read_scores,
    score_prompts,
    select_prompts,
)
from opd.models import TokenizerMismatchError
from opd.objectives import opd_diagnostics_from_scores
from opd.recipes.prompts import parse_top, retemplate_file, score_prompt_file, select_prompt_file
from opd.types import Prompt, TokenScores

DAPO = Path(__file__).parents[2].parent / "shared" / "data" / "train" / "dapo-math-17k.parquet"
needs_dapo = pytest.mark.skipif(not DAPO.is_file(), reason=f"shared DAPO set not found at {DAPO}")


def fake_scores(prompts: list[Prompt], values: list[float | None], key: str = "overlap_ratio") -> list[PromptScore]:
    return [
        PromptScore(p.id, p.source, n=4, num_tokens=40, **{key: v})
        if v is not None
        else PromptScore(p.id, p.source, skipped="longer than max_prompt_length=8 tokens")
        for p, v in zip(prompts, values)
    ]


# ------------------------------------------------------------------------------------------------ template


@needs_dapo
def test_retemplate_dapo_to_boxed_keeps_problems_and_answers(tmp_path):
    source = load_prompts(DAPO, limit=300)
    boxed = retemplate(source, "boxed")
    assert [p.id for p in boxed] == [p.id for p in source]
    for old, new in zip(source, boxed):
        assert old.text.startswith(DAPO_PREFIX) and old.text.endswith(DAPO_SUFFIX)
        problem = strip_template(old.text)
        assert new.text == problem + BOXED_SUFFIX  # the problem verbatim, the new instruction after it
        assert DAPO_PREFIX not in new.text and DAPO_SUFFIX not in new.text
        # "Answer:" survives only inside the problem itself (a few Chinese DAPO problems embed their own format line)
        assert ("Answer:" in new.text) == ("Answer:" in problem)
        assert (new.answer, new.source, new.meta) == (old.answer, old.source, old.meta)
    assert retemplate(boxed, "boxed") == boxed  # already boxed: byte-exact

    out = tmp_path / "dapo-boxed.parquet"
    summary = retemplate_file(DAPO, out, "boxed")  # the whole file: 17917 rows
    assert "17917 prompts (17917 changed) with template boxed" in summary
    reloaded = load_prompts(out, limit=300)
    assert [(p.id, p.text, p.answer) for p in reloaded] == [(p.id, p.text, p.answer) for p in boxed]


def test_retemplate_custom_and_column_mapping(tmp_path):
    rows = [
        {"problem": "1+1?" + BOXED_SUFFIX, "solution": "2", "uid": "a"},
        {"problem": "2+2?", "solution": "4", "uid": "b"},
    ]
    path = tmp_path / "set.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "custom.jsonl"
    retemplate_file(path, out, "custom:Q: {problem}\nA:", prompt_key="problem", answer_key="solution", id_key="uid")
    got = load_prompts(out)
    assert [(p.id, p.text, p.answer) for p in got] == [("a", "Q: 1+1?\nA:", "2"), ("b", "Q: 2+2?\nA:", "4")]
    with pytest.raises(ValueError, match="unknown template 'fancy'"):
        retemplate(got, "fancy")


# ------------------------------------------------------------------------------------------------ score


@pytest.fixture(scope="module")
def models():
    return make_tiny_model("llama", seed=0), make_tiny_model("llama", seed=1), make_tiny_tokenizer()


def test_scores_are_per_prompt_and_in_range(models):
    student, teacher, tokenizer = models
    prompts = make_prompts(5)
    prompts[3] = Prompt("long", [{"role": "user", "content": "x" * 300}], "0")
    seen: list[list[str]] = []
    scores = score_prompts(
        student,
        teacher,
        tokenizer,
        prompts,
        max_prompt_length=64,
        seed=3,
        on_batch=lambda batch: seen.append([s.id for s in batch]),
        **SMALL_SCORING,
    )
    assert [s.id for s in scores] == [p.id for p in prompts]
    assert seen == [["long"], ["p0", "p1"], ["p2", "p4"]]  # the too-long prompt first, then fixed batches of 2
    long = scores[3]
    assert long.skipped.startswith("longer than max_prompt_length=64") and long.overlap_ratio is None
    for s in scores[:3] + scores[4:]:
        assert s.skipped is None and s.n == 2 and 2 <= s.num_tokens <= 12
        assert s.response_length == s.num_tokens / 2 and 0 <= s.truncation_rate <= 1
        for key in (
            "overlap_ratio",
            "overlap_mass_student",
            "overlap_mass_teacher",
            "topk_mass_student",
            "topk_mass_teacher",
        ):
            assert 0.0 <= getattr(s, key) <= 1.0 + 1e-6, key
        assert s.overlap_mass_student <= s.topk_mass_student + 1e-6
        assert s.overlap_advantage <= 1e-6 and s.entropy_gap >= 0 and s.entropy_student > 0
    # deterministic for a seed, different rollouts for another
    again = score_prompts(student, teacher, tokenizer, prompts, max_prompt_length=64, seed=3, **SMALL_SCORING)
    assert again == scores
    other = score_prompts(student, teacher, tokenizer, prompts, max_prompt_length=64, seed=4, **SMALL_SCORING)
    assert other != scores


def test_identical_teacher_is_fully_aligned(models):
    student, _, tokenizer = models
    scores = score_prompts(student, student, tokenizer, make_prompts(3), seed=0, **SMALL_SCORING)
    for s in scores:
        assert s.overlap_ratio == pytest.approx(1.0) and s.overlap_advantage == pytest.approx(0.0, abs=1e-6)
        assert s.overlap_mass_student == pytest.approx(s.overlap_mass_teacher, abs=1e-6)
        assert s.overlap_mass_student == pytest.approx(s.topk_mass_student, abs=1e-6)
        assert s.entropy_gap == pytest.approx(0.0, abs=1e-6)


def test_skip_ids_resume_reproduces_the_uninterrupted_run(models):
    student, teacher, tokenizer = models
    prompts = make_prompts(5)
    full = score_prompts(student, teacher, tokenizer, prompts, seed=1, **SMALL_SCORING)
    # "p1" and "p4" missing: batch [p0, p1] reruns (p1 only returned), batch [p2, p3] is skipped, [p4] runs
    rest = score_prompts(student, teacher, tokenizer, prompts, seed=1, skip_ids=["p0", "p2", "p3"], **SMALL_SCORING)
    assert rest == [full[1], full[4]]


def test_group_diagnostics_match_the_batch_function():
    g = torch.Generator().manual_seed(0)
    B, T, V, K = 6, 5, 11, 3
    s = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    t = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64), -1)
    mask = torch.rand(B, T, generator=g) > 0.3
    s_lp, s_ids = s.topk(K, -1)
    t_lp, t_ids = t.topk(K, -1)
    student = TokenScores(torch.zeros(B, T), s_ids, s_lp, entropy=-(s.exp() * s).sum(-1))
    teacher = TokenScores(
        torch.zeros(B, T), t_ids, t_lp, entropy=-(t.exp() * t).sum(-1), requested_logprobs=t.gather(-1, s_ids)
    )
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2])
    per_group = group_diagnostics(student, teacher, mask, group_ids, 3)
    assert set(per_group) == set(METRICS)
    for gi in range(3):
        rows = torch.tensor([2 * gi, 2 * gi + 1])

        def sub(x, rows=rows):
            return TokenScores(**{k: None if v is None else v[rows] for k, v in x.__dict__.items()})

        ref = opd_diagnostics_from_scores(sub(student), sub(teacher), mask[rows])
        for key in METRICS:
            assert per_group[key][gi].item() == pytest.approx(ref[key].item(), abs=1e-9), key


def test_bad_scoring_arguments(models):
    student, teacher, tokenizer = models
    with pytest.raises(ValueError, match=r"top_k must be an integer ≥ 1, got 0"):
        score_prompts(student, teacher, tokenizer, make_prompts(1), top_k=0)


# ------------------------------------------------------------------------------------------------ score command


def test_score_command_resumes_and_saves_config(tmp_path, model_dirs):
    data = save_prompts(make_prompts(5), tmp_path / "set.jsonl")
    out = tmp_path / "scores" / "scores.jsonl"
    config = score_config(model_dirs, data, out)
    score_prompt_file(config)
    full = out.read_text().splitlines()
    assert len(full) == 5 and (out.parent / "config.yaml").is_file()

    # interrupted after the first batch, with a partial line from the second append: the rerun finishes it exactly
    out.write_text("\n".join(full[:2]) + "\n" + full[2][:15])
    score_prompt_file(config)
    assert out.read_text().splitlines() == full
    assert [s.id for s in read_scores(out)] == ["p0", "p1", "p2", "p3", "p4"]

    with pytest.raises(ConfigError, match=r"was scored with n=2, this run has n=3"):
        score_prompt_file(score_config(model_dirs, data, out, n=3))
    other = save_prompts(make_prompts(3, prefix="q"), tmp_path / "other.jsonl")
    with pytest.raises(DataError, match=r"holds scores of 5 prompt ids not in .*other.jsonl \(first: 'p0'\)"):
        score_prompt_file(score_config(model_dirs, other, out))


def test_score_command_refuses_changed_prompts_models_or_another_works_directory(tmp_path, model_dirs):
    """A rerun extends a scores file only with the prompts and model files it was made with; config.yaml and
    identity.json are never written over another work's."""
    prompts = make_prompts(4)
    data = save_prompts(prompts, tmp_path / "set.jsonl")
    out = tmp_path / "scores" / "scores.jsonl"
    score_prompt_file(score_config(model_dirs, data, out))
    full = out.read_text()
    out.write_text("".join(full.splitlines(keepends=True)[:2]))  # as if interrupted after two prompts

    # the same id, another problem: its old score would be kept under the new text
    edited = [Prompt(p.id, [{"role": "user", "content": p.text + " Give the answer in words."}]) for p in prompts]
    with pytest.raises(DataError, match=r"prompt 'p0' of .*set2.jsonl is not the prompt it was scored on"):
        score_prompt_file(score_config(model_dirs, save_prompts(edited, tmp_path / "set2.jsonl"), out))

    # the teacher's weights replaced at the same path
    make_tiny_model("llama", seed=7).save_pretrained(model_dirs["teacher"])
    with pytest.raises(ValueError, match=r"holds prompt scores made with another teacher_files: '[0-9a-f]{16}' → "):
        score_prompt_file(score_config(model_dirs, data, out))

    # a file of an older opd (no prompt_sha256): cannot be told apart from a changed set
    records = [json.loads(line) for line in out.read_text().splitlines()]
    out.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "prompt_sha256"}) + "\n" for r in records))
    with pytest.raises(DataError, match=r"its score of 'p0' has no prompt_sha256"):
        score_prompt_file(score_config(model_dirs, data, out))

    # a directory holding another work's config.yaml: refused, the file untouched
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run:\n  name: mine\n")
    with pytest.raises(ValueError, match=r"run/config.yaml belongs to other work; .*directory of its own"):
        score_prompt_file(score_config(model_dirs, data, run / "scores.jsonl"))
    assert (run / "config.yaml").read_text() == "run:\n  name: mine\n" and not (run / "scores.jsonl").exists()
    with pytest.raises(ValueError, match=r"scores/config.yaml belongs to other work \(its out: .*scores.jsonl\)"):
        score_prompt_file(score_config(model_dirs, data, out.parent / "other.jsonl"))


def test_score_command_checks_tokenizers_first(tmp_path, model_dirs):
    tokenizer = make_tiny_tokenizer()
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(model_dirs["teacher"])
    data = save_prompts(make_prompts(2), tmp_path / "set.jsonl")
    with pytest.raises(TokenizerMismatchError, match="'<extra>'"):
        score_prompt_file(score_config(model_dirs, data, tmp_path / "scores.jsonl"))
    assert not (tmp_path / "scores.jsonl").exists()


# ------------------------------------------------------------------------------------------------ select


def test_select_keeps_the_top_fraction_or_count():
    prompts = make_prompts(10)
    values = [0.5, 0.9, 0.1, 0.7, None, 0.9, 0.3, 0.8, 0.2, 0.6]  # p4 was skipped while scoring
    scores = fake_scores(prompts, values)
    picked = select_prompts(prompts, scores, top=0.5)  # half of the 9 ranked prompts: round(4.5) = 4
    assert [p.id for p in picked] == ["p1", "p3", "p5", "p7"]  # file order
    assert [p.id for p in select_prompts(prompts, scores, top=3)] == ["p1", "p5", "p7"]
    assert [p.id for p in select_prompts(prompts, scores, top=1)] == ["p1"]  # tie 0.9/0.9: file order wins
    assert len(select_prompts(prompts, scores, top=1.0)) == 9

    gaps = fake_scores(prompts, [0.5, 0.9, 0.1, 0.7, None, 0.9, 0.3, 0.8, 0.2, 0.6], key="entropy_gap")
    assert [p.id for p in select_prompts(prompts, gaps, top=2, by="entropy_gap")] == ["p2", "p8"]  # smaller wins
    advantage = fake_scores(
        prompts, [-0.5, -0.01, -2.0, -0.1, None, -0.3, -1.0, -0.2, -0.05, -0.7], key="overlap_advantage"
    )
    assert [p.id for p in select_prompts(prompts, advantage, top=2, by="overlap_advantage")] == ["p1", "p8"]


def test_mix_ratio_is_exact():
    prompts, others = make_prompts(20), make_prompts(50, prefix="o")
    scores = fake_scores(prompts, [i / 20 for i in range(20)])
    for top, ratio, mixed in [(7, 0.3, 3), (10, 0.5, 10), (8, 0.2, 2), (6, 0.25, 2), (5, 0.0, 0)]:
        result = select_prompts(prompts, scores, top=top, mix_with=others, ratio=ratio, seed=1)
        drawn = [p for p in result if p.source == "o"]
        assert len(result) == top + mixed and len(drawn) == mixed
        assert len(drawn) / len(result) == pytest.approx(ratio)
        assert [p.id for p in result[:top]] == [f"p{i}" for i in range(20 - top, 20)]
    # seeded; another seed draws others
    first = select_prompts(prompts, scores, top=10, mix_with=others, ratio=0.5, seed=1)
    assert first == select_prompts(prompts, scores, top=10, mix_with=others, ratio=0.5, seed=1)
    assert first != select_prompts(prompts, scores, top=10, mix_with=others, ratio=0.5, seed=2)
    # mixing a set with itself adds *other* prompts of it: ids stay unique
    self_mix = select_prompts(prompts, scores, top=10, mix_with=prompts, ratio=0.5)
    assert len({p.id for p in self_mix}) == 20


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(top=0.0), ValueError, r"top as a fraction must be in \(0, 1\], got 0.0"),
        (dict(top=1.5), ValueError, r"top as a fraction must be in \(0, 1\], got 1.5"),
        (dict(top=0), ValueError, r"top as a count must be ≥ 1, got 0"),
        (dict(top=True), ValueError, r"top must be a fraction in \(0, 1\] or an integer count"),
        (dict(top=11), ValueError, r"top=11 asks for 11 prompts but only 9 have a score"),
        (dict(ratio=1.0, mix_with=[]), ValueError, r"ratio .* must be in \[0, 1\), got 1.0"),
        (dict(by="loss"), ValueError, r"by must be one of overlap_ratio, .*entropy_gap, got 'loss'"),
        (
            dict(top=5, ratio=0.5, mix_with=make_prompts(3, "o")),
            DataError,
            r"ratio=0.5 with 5 aligned prompts needs 5 other prompts but mix_with has 3",
        ),
    ],
)
def test_bad_selection_arguments(kwargs, error, message):
    prompts = make_prompts(10)
    scores = fake_scores(prompts, [0.5, 0.9, 0.1, 0.7, None, 0.9, 0.3, 0.8, 0.2, 0.6])
    with pytest.raises(error, match=message) as info:
        select_prompts(prompts, scores, **kwargs)
    assert "\n" not in str(info.value)


def test_scores_that_do_not_match_the_prompts():
    prompts = make_prompts(4)
    scores = fake_scores(prompts, [0.1, 0.2, 0.3, 0.4])
    with pytest.raises(DataError, match=r"1 of 5 score ids are not ids of the prompt set \(first: 'x'\)"):
        select_prompts(prompts, scores + [PromptScore("x", overlap_ratio=0.5)])
    with pytest.raises(DataError, match=r"1 of 4 prompts have no score \(first: 'p3'\); finish scoring"):
        select_prompts(prompts, scores[:3])
    with pytest.raises(DataError, match=r"prompt id 'p0' is scored twice"):
        select_prompts(prompts, scores + scores[:1])
    with pytest.raises(DataError, match=r"none of the 4 prompts has a overlap_ratio value"):
        select_prompts(prompts, fake_scores(prompts, [None] * 4))


def test_parse_top():
    assert [parse_top(t) for t in ("0.5", "50%", "500", "1.0", "1")] == [0.5, 0.5, 500, 1.0, 1]
    assert isinstance(parse_top("1"), int) and isinstance(parse_top("1.0"), float)
    with pytest.raises(ValueError, match=r"top must be a fraction in \(0, 1\] .* got 'half'"):
        parse_top("half")


def test_select_command(tmp_path):
    prompts, others = make_prompts(10), make_prompts(10, prefix="o")
    data = save_prompts(prompts, tmp_path / "set.parquet")
    other = save_prompts(others, tmp_path / "other.jsonl")
    scores = tmp_path / "scores.jsonl"
    records = [s.to_json() for s in fake_scores(prompts, [i / 10 for i in range(10)])]
    scores.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "aligned.parquet"
    line = select_prompt_file(data, scores, out, top="0.7", mix_with=other, ratio=0.3, seed=0)
    got = load_prompts(out)
    assert [p.id for p in got[:7]] == [f"p{i}" for i in range(3, 10)]
    assert len(got) == 10 and sum(p.source == "o" for p in got) == 3
    assert line.startswith("7 of 10 prompts by overlap_ratio (mean 0.6000 vs 0.4500 over all) + 3 from")
    with pytest.raises(DataError, match="no such scores file"):
        select_prompt_file(data, tmp_path / "missing.jsonl", tmp_path / "b.parquet")
    assert set(ALIGNMENT_METRICS) <= set(METRICS)
