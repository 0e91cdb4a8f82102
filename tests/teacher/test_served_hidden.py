"""`opd serve-teacher`'s hidden-state and head routes over real loopback sockets: the served hidden states equal the
local teacher's, the scores computed from them equal the local scores, the head is the local head (hash and all);
bad heads, bad answers and bad /hidden requests are refused in one line.

Tolerances: float32 on the wire, the server batches rows as the client sends them, so hidden states equal the local
ones up to the fp32 rounding of another batching (1e-4 on values of order 1; BATCHING_ATOL, 1e-3, on log-probs, as
the served scores' tests). bf16 on the wire rounds each value to 8 mantissa bits: 1e-2 relative."""

from __future__ import annotations

import pytest
import torch

from helpers_served_teacher import (
    BATCHING_ATOL,
    TOKEN,
    assert_scores_close,
    http_call,
    random_rollouts,
    serve_in_thread,
)
from opd.io import read_jsonl
from opd.teacher import wire
from opd.teacher.base import HiddenStateScorer, head_fingerprint
from opd.teacher.client import RemoteScorer, TeacherRequestError, check_served_head

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")


def _client(url, dtype="float32"):
    scorer = RemoteScorer(url, token=TOKEN, retry_deadline=0)
    scorer.hidden_dtype = dtype
    return scorer


def test_served_hidden_states_equal_local(server, lab_teacher):
    url, _, _ = server
    _, _, local = lab_teacher
    rollouts = random_rollouts(3, rows=5)
    remote = _client(url)
    try:
        assert remote.hidden_size == local.output_head().weight.shape[1]
        served = remote.hidden_states(rollouts)
        torch.testing.assert_close(served, local.hidden_states(rollouts), atol=1e-4, rtol=0)
        head = remote.output_head()
        assert torch.equal(head.weight, local.output_head().weight)
        assert head_fingerprint(head) == head_fingerprint(local.output_head())
        scores = HiddenStateScorer(remote).score(rollouts, top_k=8, temperature=0.8)
        assert_scores_close(scores, local.score(rollouts, top_k=8, temperature=0.8), BATCHING_ATOL, ids=False)
        remote.hidden_dtype = "bfloat16"
        bf16 = remote.hidden_states(rollouts)
        assert bf16.dtype == torch.bfloat16
        torch.testing.assert_close(bf16.float(), served, rtol=1e-2, atol=1e-2)
    finally:
        remote.close()


def test_hidden_route_keeps_the_servers_checks(server, lab_teacher):
    url, _, _ = server
    width = lab_teacher[2].output_head().weight.shape[1]
    request = wire.request_from_rollouts(random_rollouts(4, rows=2), None, top_k=0, with_entropy=False)
    body = wire.encode_request(request)
    status, _, _ = http_call(url, "POST", "/hidden", body, token=None)
    assert status == 401
    status, _, answer = http_call(url, "POST", "/hidden?dtype=int8", body)
    assert status == 400 and b"dtype: must be one of" in answer
    top = wire.encode_request(wire.request_from_rollouts(random_rollouts(4, rows=2), None, top_k=4))
    status, _, answer = http_call(url, "POST", "/hidden", top)
    assert status == 400 and b"top_k=0" in answer
    status, _, answer = http_call(url, "POST", "/hidden", b"x" * 100)
    assert status == 400
    status, _, answer = http_call(url, "POST", "/hidden", body)
    assert status == 200 and wire.decode_hidden(answer, request.num_positions, width).dtype == torch.bfloat16


def test_mismatched_heads_refused(lab_teacher):
    _, _, local = lab_teacher
    head = local.output_head()
    info = {
        "vocab_size": head.weight.shape[0],
        "vocab_hash": "v",
        "dtype": "float32",
        "hidden_size": head.weight.shape[1],
    }
    meta = {"vocab_hash": "v", "dtype": "float32", "head_hash": head_fingerprint(head)}
    assert check_served_head(head, meta, info, "u") is head
    for changed_info, changed_meta, culprit in [
        ({"vocab_size": 99}, {}, "vocab_size 99"),
        ({}, {"vocab_hash": "w"}, "vocab_hash w"),
        ({"dtype": "bfloat16"}, {}, "dtype float32"),
        ({}, {"head_hash": "sha256:0"}, "sha256:0"),
    ]:
        with pytest.raises(TeacherRequestError, match=culprit):
            check_served_head(head, {**meta, **changed_meta}, {**info, **changed_info}, "u")


def test_bad_hidden_answers_refused(lab_teacher):
    """A server whose hidden states hold NaN, and answers of the wrong shape: refused, never scored."""
    _, _, local = lab_teacher

    class NaNTeacher:
        inner, serves_requested_ids = local, True

        def score(self, *args, **kwargs):
            return local.score(*args, **kwargs)

        def output_head(self):
            return local.output_head()

        def hidden_states(self, rollouts):
            hidden = local.hidden_states(rollouts)
            hidden[rollouts.response_mask] = float("nan")
            return hidden

    rollouts = random_rollouts(5, rows=3, min_response=1)
    with serve_in_thread(NaNTeacher()) as (url, _):
        remote = _client(url)
        try:
            with pytest.raises(ValueError, match="hold NaN/inf"):
                HiddenStateScorer(remote).score(rollouts)
        finally:
            remote.close()
    good = wire.encode_hidden(torch.zeros(4, 32), "float32")
    with pytest.raises(wire.WireError, match=r"shape \[4, 32\].*expected \[5 scored positions, 32\]"):
        wire.decode_hidden(good, 5, 32)
    with pytest.raises(wire.WireError, match="expected a 'hidden' message"):
        wire.decode_hidden(wire.encode_message("scores", {}, [("sampled", torch.zeros(4), "float32")]), 4, 32)


def _lab_run(tmp_path, name, *overrides):
    from opd.config import DistillConfig, build_config
    from opd.lab import opd_prompts_path, student_path, teacher_path
    from opd.recipes.distill import distill

    options = {
        "student.path": str(student_path()),
        "teacher.path": str(teacher_path()),
        "data.path": str(opd_prompts_path()),
        "student.device": "cpu",
        "student.dtype": "fp32",
        "teacher.device": "cpu",
        "teacher.dtype": "fp32",
        "data.max_prompt_length": 64,
        "prompts_per_step": 2,
        "rollout.n": 2,
        "rollout.max_new_tokens": 16,
        "micro_batch_tokens": 4096,
        "score_batch_tokens": 4096,
        "optim.lr": 1e-4,
        "run.out_dir": str(tmp_path),
        "run.name": name,
        "run.steps": 2,
        "run.report": False,
        "run.save_every": 0,
        "run.samples_per_step": 0,
        "objective.loss": "full_reverse_kl",
    }
    return read_jsonl(
        distill(build_config(DistillConfig, options=options, overrides=list(overrides))) / "metrics.jsonl"
    )


@pytest.mark.slow
def test_distill_full_reverse_kl_with_a_served_teacher_matches_local(server, tmp_path):
    """`opd distill objective.loss=full_reverse_kl teacher.url=…` (hidden states and the head over loopback, float32
    wire) trains as with the local teacher: the loss and the reward within 1e-4 (the server batches rows as the
    client sends them; fp32 rounding)."""
    url, token_file, _ = server
    local = _lab_run(tmp_path, "local")
    served = _lab_run(
        tmp_path,
        "served",
        "teacher.path=null",
        "teacher.device=auto",
        "teacher.dtype=auto",
        f"teacher.url={url}",
        f"teacher.token_file={token_file}",
        "teacher.hidden_dtype=float32",
    )
    for a, b in zip(local, served):
        for key in ("full_reverse_kl_loss", "reward_mean", "teacher/bytes_per_token"):
            assert abs(a[key] - b[key]) <= 1e-4, (key, a[key], b[key])
        assert b["teacher/head_bytes"] == a["teacher/head_bytes"]
