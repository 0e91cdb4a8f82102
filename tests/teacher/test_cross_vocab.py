import pytest
import torch

from helpers import EOS_ID, make_tiny_model, make_tiny_tokenizer
from helpers_cross_vocab import byte_bpe, characters, chat_prompt, sentencepiece, text_rollouts
from opd.check.tokenizers import check_cross_tokenizer
from opd.config import ObjectiveSpec, TeacherEntry
from opd.objectives.targets import build_targets, micro_loss
from opd.teacher.cross_vocab import build_cross_vocab, cross_metrics, resolve_tokenizer_mode, start_cross_scoring
from opd.teacher.local import LocalScorer

K = 4
TEXTS = ["x = 3; so 2x + 1 = 7.", "Café: 数学 🙂", "the answer is \\boxed{47}", "ok"]


@pytest.mark.parametrize("teacher_temperature", [1.0, 0.7])
@pytest.mark.parametrize("top_k", [0, K])
def test_the_cross_path_with_one_tokenizer_twice_equals_the_same_vocabulary_path(top_k, teacher_temperature):
    """τ_T (objective.teacher_temperature) scales the cross teacher's logits as it does the same-vocabulary one's."""
    tokenizer = make_tiny_tokenizer()
    student_model, teacher_model = make_tiny_model(seed=0), make_tiny_model(seed=1)
    rollouts, prompts = text_rollouts(tokenizer, TEXTS, EOS_ID, truncate_last=True)
    student = LocalScorer(student_model).score(rollouts, top_k=K)
    teacher_scorer = LocalScorer(teacher_model)
    same = teacher_scorer.score(rollouts, top_k=K, requested_ids=student.topk_ids, temperature=teacher_temperature)
    cross = build_cross_vocab(tokenizer, tokenizer, student_eos_ids=[EOS_ID, tokenizer.pad_token_id])
    crossed = start_cross_scoring(
        cross, teacher_scorer, rollouts, student, prompts, top_k=top_k, temperature=teacher_temperature
    ).result()
    mask_BT = rollouts.response_mask
    assert torch.allclose(crossed.sampled_logprobs[mask_BT], same.sampled_logprobs[mask_BT], atol=1e-6, rtol=0)
    assert torch.allclose(crossed.requested_logprobs[mask_BT], same.requested_logprobs[mask_BT], atol=1e-6, rtol=0)
    metrics = cross_metrics([cross])
    assert metrics["xtok/exact_frac"] == 1.0 and metrics["xtok/unmapped_frac"] == 0.0
    objective = ObjectiveSpec(top_k=top_k, teacher_temperature=teacher_temperature)
    a = build_targets(student, same, rollouts, objective)
    b = build_targets(student, crossed, rollouts, objective)
    J = a.candidate_ids.shape[-1]
    assert torch.equal(a.candidate_ids, b.candidate_ids[..., :J])  # top-k: the same candidates
    assert torch.allclose(a.rewards, b.rewards[..., :J], atol=1e-6, rtol=0)
    assert not b.reward_valid[..., J:].any()  # the span slot (top-k) is never used: every position is exact
    logits_BTV = torch.randn(*rollouts.response_ids.shape, len(tokenizer), generator=torch.Generator().manual_seed(0))
    lp_BTV = logits_BTV.log_softmax(-1)
    tokens = mask_BT.sum()
    loss_a, _ = micro_loss(
        lp_BTV.gather(-1, a.candidate_ids), lp_BTV[..., 0], a, objective, global_num_tokens=tokens, global_num_seqs=4
    )
    loss_b, _ = micro_loss(
        lp_BTV.gather(-1, b.candidate_ids), lp_BTV[..., 0], b, objective, global_num_tokens=tokens, global_num_seqs=4
    )
    assert abs(float(loss_a) - float(loss_b)) < 1e-6


def test_a_cross_teacher_scores_the_text_under_its_own_tokenizer():
    """Byte-level student, SentencePiece teacher: the span log-probs sum to the teacher's log-prob of the text (its
    own tokens, its EOS), and the step's xtok fractions add up to 1."""
    student_tok, teacher_tok = byte_bpe(), sentencepiece()
    teacher_model = make_tiny_model(vocab_size=len(teacher_tok), seed=3)
    student_model = make_tiny_model(vocab_size=len(student_tok), seed=4)
    rollouts, _ = text_rollouts(student_tok, TEXTS, student_tok.eos_token_id)
    teacher_prompts = [chat_prompt(teacher_tok, i) for i in range(len(TEXTS))]
    student = LocalScorer(student_model).score(rollouts, top_k=K)
    cross = build_cross_vocab(student_tok, teacher_tok, student_eos_ids=[student_tok.eos_token_id])
    scorer = LocalScorer(teacher_model)
    crossed = start_cross_scoring(cross, scorer, rollouts, student, teacher_prompts, top_k=0, temperature=1.0).result()
    mask_BT = rollouts.response_mask
    # the teacher's own log-prob of each row: its tokens of the text then its EOS
    own = []
    for b, text in enumerate(TEXTS):
        ids = teacher_tok(text, add_special_tokens=False)["input_ids"] + [teacher_tok.eos_token_id]
        full = torch.tensor([teacher_prompts[b] + ids])
        with torch.no_grad():
            lp = teacher_model(full).logits[0, :-1].float().log_softmax(-1)
        own.append(float(lp[len(teacher_prompts[b]) - 1 :].gather(-1, torch.tensor(ids)[:, None]).sum()))
    got = (crossed.sampled_logprobs * mask_BT).sum(-1)
    assert torch.allclose(got, torch.tensor(own), atol=1e-4, rtol=0)
    metrics = cross_metrics([cross])
    total = metrics["xtok/exact_frac"] + metrics["xtok/span_frac"] + metrics["xtok/unmapped_frac"]
    assert total == pytest.approx(1.0) and metrics["xtok/unmapped_frac"] == 0.0
    assert 0 < metrics["xtok/exact_frac"] < 1
    # per byte of the answers' text: the teacher's negative log-likelihood of them, its stops included
    text_bytes = sum(len(text.encode()) for text in TEXTS)
    assert metrics["xtok/teacher_nll_per_byte"] == pytest.approx(-sum(own) / text_bytes, rel=1e-4)
    assert metrics["xtok/align_s"] > 0 and 0 <= metrics["xtok/align_wait_s"]


def test_auto_mode_is_same_for_one_vocabulary_and_cross_for_another(tmp_path):
    make_tiny_tokenizer().save_pretrained(tmp_path / "same")
    byte_bpe().save_pretrained(tmp_path / "other")
    student = make_tiny_tokenizer()
    assert resolve_tokenizer_mode(TeacherEntry(name="t", path=str(tmp_path / "same")), student) == "same"
    assert resolve_tokenizer_mode(TeacherEntry(name="t", path=str(tmp_path / "other")), student) == "cross"
    with pytest.raises(ValueError, match="tokenizer: cross needs an in-process teacher"):
        resolve_tokenizer_mode(TeacherEntry(name="t", url="http://x:1", tokenizer="cross"), student)


def test_the_cross_tokenizer_row_names_a_character_the_teacher_cannot_encode():
    student_tok = byte_bpe()
    ok = build_cross_vocab(student_tok, characters(), student_eos_ids=[student_tok.eos_token_id])
    row = check_cross_tokenizer(ok, student_tok, ["x = 3", "Café 数学"])
    assert row.status == "pass" and "round-trip failures 0" in row.detail
    bad = build_cross_vocab(student_tok, characters(byte_fallback=False), student_eos_ids=[student_tok.eos_token_id])
    row = check_cross_tokenizer(bad, student_tok, ["x = 3", "Café 数学"])
    assert row.status == "fail" and row.hard and "'数学'" in row.detail


def test_the_lab_teacher_under_another_token_to_id_map_scores_as_itself(tmp_path):
    """The shipped lab teacher with its ids shuffled (`permute_vocabulary`): every id differs, so the cross path maps
    the student's text and top-k onto the teacher's ids; its scores equal the original teacher's on the student's
    own ids (a real model, a real renderer of each side's prompts)."""
    from opd.lab import student_path, teacher_path
    from opd.lab.build import permute_vocabulary
    from opd.models import load_model

    shuffled = permute_vocabulary(teacher_path(), tmp_path / "shuffled", seed=0)
    student_model, tokenizer = load_model(str(student_path()), dtype=torch.float32, device="cpu")
    teacher_model, _ = load_model(str(teacher_path()), dtype=torch.float32, device="cpu")
    other_model, other_tok = load_model(str(shuffled), dtype=torch.float32, device="cpu")
    texts = ["12+3=15\n15*2=30\n\\boxed{30}", "7-9=-2\n\\boxed{-2}"]
    rollouts, _ = text_rollouts(tokenizer, texts, tokenizer.eos_token_id)
    student = LocalScorer(student_model).score(rollouts, top_k=K)
    same = LocalScorer(teacher_model).score(rollouts, top_k=K, requested_ids=student.topk_ids)
    cross = build_cross_vocab(tokenizer, other_tok, student_eos_ids=[tokenizer.eos_token_id])
    prompts = [chat_prompt(other_tok, i) for i in range(len(texts))]
    crossed = start_cross_scoring(
        cross, LocalScorer(other_model), rollouts, student, prompts, top_k=K, temperature=1.0
    ).result()
    mask_BT = rollouts.response_mask
    assert crossed.exact[mask_BT].all()
    assert torch.allclose(crossed.sampled_logprobs[mask_BT], same.sampled_logprobs[mask_BT], atol=1e-5, rtol=0)
    assert torch.allclose(crossed.requested_logprobs[mask_BT], same.requested_logprobs[mask_BT], atol=1e-5, rtol=0)


@pytest.fixture(scope="module")
def shuffled_lab(tmp_path_factory):
    """The lab teacher under another token → id map (`permute_vocabulary`): (its directory, model, tokenizer)."""
    from opd.lab import teacher_path
    from opd.lab.build import permute_vocabulary
    from opd.models import load_model

    shuffled = permute_vocabulary(teacher_path(), tmp_path_factory.mktemp("xserved") / "shuffled", seed=0)
    model, tokenizer = load_model(str(shuffled), dtype=torch.float32, device="cpu")
    return shuffled, model, tokenizer


def _served_entry(url, tmp_path, tokenizer_path):
    from helpers_served_teacher import TOKEN

    (tmp_path / "token").write_text(TOKEN + "\n")
    return TeacherEntry(
        name="served",
        url=url,
        token_file=str(tmp_path / "token"),
        retry_deadline=0,
        tokenizer="auto",
        tokenizer_path=str(tokenizer_path),
    )


def _load_served_cross(entry, student_tok):
    from opd.teacher.cross_vocab import load_cross_teacher
    from opd.teacher.registry import TeacherRequest

    request = TeacherRequest(
        spec=entry, student_tokenizer=student_tok, student_rows=0, student_device=torch.device("cpu")
    )
    return load_cross_teacher(
        entry,
        student_tokenizer=student_tok,
        student_eos_ids=[student_tok.eos_token_id],
        request=request,
        own_vocab=None,
    )


def test_a_served_cross_teacher_scores_as_the_same_teacher_in_process(shuffled_lab, lab_teacher, tmp_path):
    """The lab teacher served over a loopback socket, a student of the shuffled vocabulary: auto resolves to cross
    (tokenizer_path: the lab tokenizer, its hash /info's), the client sends the teacher ids it aligned, and the
    scores mapped back equal the in-process cross teacher's within 1e-6 (fp32 on the wire, one request scored as one
    batch as the local call is: measured equal exactly; a split request would need BATCHING_ATOL)."""
    pytest.importorskip("uvicorn")
    from helpers_served_teacher import serve_in_thread
    from opd.lab import teacher_path

    _, student_model, student_tok = shuffled_lab
    teacher_model, teacher_tok, teacher_scorer = lab_teacher
    texts = ["12+3=15\n15*2=30\n\\boxed{30}", "7-9=-2\n\\boxed{-2}"]
    rollouts, _ = text_rollouts(student_tok, texts, student_tok.eos_token_id)
    student = LocalScorer(student_model).score(rollouts, top_k=K)
    prompts = [chat_prompt(teacher_tok, i) for i in range(len(texts))]
    local = build_cross_vocab(student_tok, teacher_tok, student_eos_ids=[student_tok.eos_token_id])
    want = start_cross_scoring(local, teacher_scorer, rollouts, student, prompts, top_k=K, temperature=1.0).result()
    with serve_in_thread(teacher_scorer) as (url, _):
        entry = _served_entry(url, tmp_path, teacher_path())
        assert resolve_tokenizer_mode(entry, student_tok) == "cross"
        teacher, cross = _load_served_cross(entry, student_tok)
        try:
            got = start_cross_scoring(cross, teacher.scorer, rollouts, student, prompts, top_k=K, temperature=1.0)
            got = got.result()
        finally:
            teacher.scorer.close()
    assert cross.tokenizer_hash == local.tokenizer_hash
    mask_BT = rollouts.response_mask
    assert torch.equal(got.exact, want.exact) and got.exact[mask_BT].all()
    for name in ("sampled_logprobs", "requested_logprobs", "topk_logprobs"):
        a, b = getattr(got, name)[mask_BT], getattr(want, name)[mask_BT]
        assert float((a - b).abs().max()) <= 1e-6, name
    assert torch.equal(got.topk_ids[mask_BT], want.topk_ids[mask_BT])


def test_a_served_cross_teacher_with_another_tokenizer_is_refused_in_one_line(shuffled_lab, lab_teacher, tmp_path):
    """tokenizer_path whose token → id map is not the one /info hashes: refused when the mode is resolved (before
    any model loads) and when the teacher loads, one line naming both hashes; a served cross teacher without
    tokenizer_path too."""
    pytest.importorskip("uvicorn")
    from helpers_served_teacher import serve_in_thread

    shuffled, _, student_tok = shuffled_lab
    with serve_in_thread(lab_teacher[2]) as (url, _):
        entry = _served_entry(url, tmp_path, shuffled)
        entry = entry.model_copy(update={"tokenizer": "cross"})
        for call in (
            lambda: resolve_tokenizer_mode(entry, student_tok),
            lambda: _load_served_cross(entry, student_tok),
        ):
            with pytest.raises(ValueError, match="is not the tokenizer the teacher at") as error:
                call()
            assert "\n" not in str(error.value) and "vocab_hash" in str(error.value)
        bare = entry.model_copy(update={"tokenizer_path": None})
        with pytest.raises(ValueError, match="served one with its tokenizer \\(tokenizer_path\\)"):
            resolve_tokenizer_mode(bare, student_tok)


def _served_cross_run(tmp_path, url, tokenizer_path, *overrides):
    from helpers_served_teacher import TOKEN
    from opd.config import DistillConfig, build_config
    from opd.lab import opd_prompts_path, student_path
    from opd.lab.build import permute_vocabulary
    from opd.recipes.distill import distill

    student = permute_vocabulary(student_path(), tmp_path / "student", seed=0)
    (tmp_path / "token").write_text(TOKEN + "\n")
    options = {
        "student.path": str(student),
        "student.device": "cpu",
        "student.dtype": "fp32",
        "teacher.url": url,
        "teacher.token_file": str(tmp_path / "token"),
        "teacher.retry_deadline": 0,
        "teacher.tokenizer_path": str(tokenizer_path),
        "data.path": str(opd_prompts_path()),
        "data.max_prompt_length": 64,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 8,
        "micro_batch_tokens": 4096,
        "score_batch_tokens": 4096,
        "objective.top_k": K,
        "run.out_dir": str(tmp_path),
        "run.name": "run",
        "run.steps": 1,
        "run.report": False,
        "run.save_every": 0,
        "run.samples_per_step": 0,
    }
    return distill(build_config(DistillConfig, options=options, overrides=list(overrides)))


def test_distill_with_a_served_cross_teacher(shuffled_lab, lab_teacher, tmp_path):
    """`opd distill teacher.url=… teacher.tokenizer_path=…` with a student of another vocabulary: one step through
    the cross path (every span one token to one token: exact_frac 1); a tokenizer_path that is not the server's
    (tokenizer: cross, so that auto's comparison with the student does not decide first) stops the run before its
    first step, in one line."""
    pytest.importorskip("uvicorn")
    from helpers_served_teacher import serve_in_thread
    from opd.io import read_jsonl
    from opd.lab import teacher_path

    shuffled = shuffled_lab[0]
    with serve_in_thread(lab_teacher[2]) as (url, _):
        with pytest.raises(ValueError, match="is not the tokenizer the teacher at") as error:
            _served_cross_run(tmp_path / "bad", url, shuffled, "teacher.tokenizer=cross")
        assert "\n" not in str(error.value) and not (tmp_path / "bad" / "run" / "metrics.jsonl").exists()
        out = _served_cross_run(tmp_path / "good", url, teacher_path())
    metrics = read_jsonl(out / "metrics.jsonl")[-1]
    assert metrics["xtok/exact_frac"] == 1.0 and metrics["xtok/unmapped_frac"] == 0.0


def _check_with(tmp_path, name, student, teacher):
    """`run_check` of the lab student `student` (a directory) with `teacher` (config keys) on 4 prompts x 2."""
    import io

    from rich.console import Console

    from opd.config import DistillConfig
    from opd.lab import opd_prompts_path
    from opd.recipes.check import run_check

    config = DistillConfig.model_validate(
        {
            "student": {"path": str(student), "device": "cpu", "dtype": "fp32"},
            "teacher": teacher,
            "data": {"path": str(opd_prompts_path()), "max_prompt_length": 64},
            "rollout": {"max_new_tokens": 24},
            "objective": {"top_k": K},
            "run": {"out_dir": str(tmp_path)},
        }
    )
    report = run_check(config, n=2, prompts_sample=4, out=tmp_path / name, console=Console(file=io.StringIO()))
    return report, {r.name: r for r in report.results}


def test_opd_check_gives_a_served_cross_teacher_its_cross_tokenizer_row(shuffled_lab, lab_teacher, tmp_path):
    """`opd check` with a served teacher of another vocabulary (`url` with `tokenizer_path`, as `opd distill` takes
    it): the cross_tokenizer row and the forecast on the aligned signal, scored over the loopback socket, equal to
    the same teacher's in process (its accuracy aside: a served teacher has no samples); not a failed
    tokenizer_vocab row (the bug: the check compared the student's map with /info's). Without tokenizer_path the
    vocabularies are compared and the row's fix names tokenizer_path."""
    pytest.importorskip("uvicorn")
    from helpers_served_teacher import TOKEN, serve_in_thread
    from opd.lab import student_path, teacher_path
    from opd.lab.build import permute_vocabulary

    student = permute_vocabulary(student_path(), tmp_path / "student", seed=0)
    (tmp_path / "token").write_text(TOKEN + "\n")
    local, local_rows = _check_with(
        tmp_path, "local", student, {"path": str(teacher_path()), "device": "cpu", "dtype": "fp32"}
    )
    with serve_in_thread(lab_teacher[2]) as (url, _):
        served = {"url": url, "token_file": str(tmp_path / "token"), "retry_deadline": 0}
        report, rows = _check_with(tmp_path, "served", student, {**served, "tokenizer_path": str(teacher_path())})
        _, bare = _check_with(tmp_path, "bare", student, served)
    assert "tokenizer_vocab" not in rows and rows["cross_tokenizer"].status == "pass"
    assert rows["cross_tokenizer"].detail == local_rows["cross_tokenizer"].detail  # the rollouts' shares included
    assert report.exit_code() == local.exit_code() == 0
    got, want = report.values["forecast"]["values"], local.values["forecast"]["values"]
    assert got["rollouts"] > 0 and got["teacher_accuracy"] is None and want["teacher_accuracy"] is not None
    for key, value in want.items():
        if key in ("seconds", "teacher_accuracy"):
            continue
        if isinstance(value, float):
            assert got[key] == pytest.approx(value, abs=1e-6), key
        else:
            assert got[key] == value, key
    assert bare["tokenizer_vocab"].status == "fail" and "tokenizer_path" in bare["tokenizer_vocab"].fix
