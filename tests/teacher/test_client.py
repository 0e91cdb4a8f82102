"""`RemoteScorer` in runs (CPU, loopback only): `opd distill` and `opd prompts score` with `teacher.url` == with
the local teacher, a server killed and restarted in the middle of a run, a server swapped behind the URL,
credentials, contradictory teacher settings, the startup check of served scores, and the weights' identity.

Servers run as real `opd serve-teacher` subprocesses on the shipped lab teacher (tests/helpers_served_teacher.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from safetensors.torch import load_file

from helpers import make_tiny_tokenizer, server_in_thread
from helpers_served_teacher import TOKEN, V, free_port, http_call, random_rollouts, serve_in_thread, serve_process
from opd.config import ConfigError, DistillConfig, ModelSpec, build_config
from opd.io import read_jsonl
from opd.lab import opd_prompts_path, student_path, teacher_path
from opd.models import load_model
from opd.teacher.client import RemoteScorer, TeacherRequestError
from opd.teacher.local import LocalScorer
from opd.train.checkpoint import latest_checkpoint

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

# ------------------------------------------------------------------------------------------------ distill


def lab_config(tmp_path: Path, name: str, *overrides: str, steps: int = 3) -> DistillConfig:
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
        "rollout.max_new_tokens": 24,
        "micro_batch_tokens": 4096,
        "score_batch_tokens": 4096,
        "optim.lr": 1e-4,
        "run.out_dir": str(tmp_path),
        "run.name": name,
        "run.steps": steps,
        "run.report": False,
        "run.save_every": 0,
        "run.samples_per_step": 0,
    }
    return build_config(DistillConfig, options=options, overrides=list(overrides))


def served_overrides(url: str, token_file: Path) -> list[str]:
    return [
        "teacher.path=null",
        "teacher.device=auto",
        "teacher.dtype=auto",
        f"teacher.url={url}",
        f"teacher.token_file={token_file}",
    ]


def assert_same_run(a: Path, b: Path) -> None:
    """Same metrics (≤ 1e-5: the served teacher may batch rows differently, fp32 rounding) and weights."""
    ma, mb = read_jsonl(a / "metrics.jsonl"), read_jsonl(b / "metrics.jsonl")
    assert [m["step"] for m in ma] == [m["step"] for m in mb]
    for x, y in zip(ma, mb):
        keys = {k for k in x if not k.startswith("time/") and k != "tokens_per_second"}
        assert keys == {k for k in y if not k.startswith("time/") and k != "tokens_per_second"}
        for k in keys:
            if isinstance(x[k], float):
                assert abs(x[k] - y[k]) <= 1e-5, (x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], k
    wa, wb = (load_file(str(latest_checkpoint(d) / "model.safetensors")) for d in (a, b))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) <= 1e-6


@pytest.fixture(scope="module")
def local_run(tmp_path_factory):
    from opd.recipes.distill import distill

    return distill(lab_config(tmp_path_factory.mktemp("local"), "local", steps=4))


@pytest.mark.slow
def test_distill_with_teacher_url_matches_local(server, local_run, tmp_path):
    from opd.recipes.distill import distill

    url, token_file, _ = server
    served = distill(lab_config(tmp_path, "served", *served_overrides(url, token_file), steps=4))
    assert_same_run(local_run, served)
    assert (served / "config.yaml").read_text().count(TOKEN) == 0  # the token file's path is saved, not the token


def test_prompts_score_with_teacher_url_matches_local(server, tmp_path):
    from opd.eval.prompt_scores import read_scores
    from opd.recipes.prompts import PromptScoreConfig, score_prompt_file

    url, token_file, _ = server

    def run(name, *overrides):
        options = {
            "student.path": str(student_path()),
            "teacher.path": str(teacher_path()),
            "data.path": str(opd_prompts_path()),
            "data.limit": 4,
            "data.max_prompt_length": 64,
            "student.device": "cpu",
            "student.dtype": "fp32",
            "teacher.device": "cpu",
            "teacher.dtype": "fp32",
            "out": str(tmp_path / name / "scores.jsonl"),
            "n": 2,
            "max_new_tokens": 16,
            "batch_size": 2,
        }
        return read_scores(
            score_prompt_file(build_config(PromptScoreConfig, options=options, overrides=list(overrides)))
        )

    local, served = run("local"), run("served", *served_overrides(url, token_file))
    assert [s.id for s in local] == [s.id for s in served]
    for a, b in zip(local, served):
        for key, value in a.to_json().items():
            other = b.to_json()[key]
            assert other == value if not isinstance(value, float) else abs(other - value) <= 1e-5, key


@pytest.mark.slow
def test_server_killed_and_restarted_mid_run(local_run, tmp_path):
    """`opd distill` (a subprocess) with teacher.url: the server is killed after step 1 and restarted on the same
    port; the run waits (saying so), continues, and ends with the same steps and numbers as the local run."""
    port = free_port()
    run_dir = tmp_path / "runs" / "restart"
    command = [
        sys.executable,
        "-m",
        "opd.cli",
        "distill",
        "student.device=cpu",
        "student.dtype=fp32",
        f"student.path={student_path()}",
        f"data.path={opd_prompts_path()}",
        "data.max_prompt_length=64",
        "prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=24",
        "micro_batch_tokens=4096",
        "score_batch_tokens=4096",
        "optim.lr=1e-4",
        f"run.out_dir={tmp_path / 'runs'}",
        "run.name=restart",
        "run.steps=4",
        "run.report=false",
        "run.save_every=0",
        "run.samples_per_step=0",
        f"teacher.url=http://127.0.0.1:{port}",
        "teacher.retry_deadline=240",
        f"teacher.token_file={tmp_path / 'token'}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "trainer.log"
    with serve_process(tmp_path, port=port, name="first") as (_, first, _), open(log, "w") as out:
        trainer = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=out, env=env)
        try:
            metrics = run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 300
            while not (metrics.exists() and metrics.read_text().count("\n") >= 1):
                assert trainer.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no step finished"
                time.sleep(0.02)
            first.kill()  # SIGKILL: no goodbye to the client
            first.wait(15)
            time.sleep(1.0)
            with serve_process(tmp_path, port=port, name="second"):
                trainer.wait(600)
        finally:
            if trainer.poll() is None:
                trainer.kill()
                trainer.wait(15)
    stderr = log.read_text()
    assert trainer.returncode == 0, stderr[-3000:]
    assert "not answering" in stderr and "answering again" in stderr, stderr[-3000:]
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4]
    assert_same_run(local_run, run_dir)


def test_a_server_swapped_behind_the_url_stops_the_client_in_one_line(lab_teacher):
    port = free_port()
    student, _ = load_model(student_path(), dtype="fp32", device="cpu")
    rollouts = random_rollouts(3, 2)
    with serve_in_thread(lab_teacher[2], port=port) as (url, _):
        remote = RemoteScorer(url, token=TOKEN)
        remote.score(rollouts)
    with serve_in_thread(LocalScorer(lab_teacher[0], vocab_size=V), port=port):  # restarted, same weights: fine
        remote.score(rollouts)
    # same tokenizer, other weights
    with serve_in_thread(LocalScorer(student, vocab_size=V), port=port, files=student_path()):
        with pytest.raises(TeacherRequestError, match="now serves other weights") as error:
            remote.score(rollouts)
        assert "\n" not in str(error.value)
    remote.close()


def test_credentials_and_tokens(server, tmp_path, monkeypatch):
    url, _, _ = server
    with pytest.raises(ConfigError) as error:
        lab_config(
            tmp_path,
            "x",
            "teacher.path=null",
            "teacher.device=auto",
            "teacher.dtype=auto",
            "teacher.url=http://me:s3cret@127.0.0.1:1",
        )
    assert "credentials in the URL" in str(error.value) and "s3cret" not in str(error.value)
    with pytest.raises(ValueError, match="credentials in the URL") as error:
        RemoteScorer("http://me:s3cret@127.0.0.1:1", retry_deadline=0)
    assert "s3cret" not in str(error.value)
    for scheme in ("bearer", "BEARER", "Bearer"):
        assert http_call(url, "GET", "/info", headers={"Authorization": f"{scheme} {TOKEN}"}, token=None)[0] == 200
    from opd.teacher.server import resolve_token

    monkeypatch.setenv("OPD_TEACHER_TOKEN", "jeton-secret-é-0123456789")
    with pytest.raises(ConfigError, match="printable ASCII"):
        resolve_token(None)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["teacher.url=http://127.0.0.1:1"], "teacher.path="),  # lab_config sets path, device and dtype
        (["teacher.path=null", "teacher.url=http://127.0.0.1:1"], "teacher.device=cpu"),
        (["teacher.path=null", "teacher.device=auto", "teacher.url=http://127.0.0.1:1"], "teacher.dtype=fp32"),
        (
            [
                "teacher.path=null",
                "teacher.device=auto",
                "teacher.dtype=auto",
                "teacher.url=http://127.0.0.1:1",
                "teacher_offload=true",
            ],
            "teacher_offload=true",
        ),
    ],
)
def test_contradictory_teacher_settings_are_refused(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as error:
        lab_config(tmp_path, "x", *overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_check_of_a_served_teacher_that_does_not_answer_fails_in_one_line(tmp_path):
    """`opd check` of a served teacher asks its server (/info) first: one that never answers is one line naming its
    URL and the deadline to raise."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "opd.cli",
            "check",
            f"student.path={student_path()}",
            f"data.path={opd_prompts_path()}",
            "teacher.url=http://127.0.0.1:1",
            "teacher.retry_deadline=0",
            f"run.out_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    last = [line for line in result.stderr.splitlines() if line.strip()][-1]
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert last.startswith("error: teacher server http://127.0.0.1:1 did not answer") and "retry_deadline" in last


class _TemperatureBlindScorer(LocalScorer):
    """A teacher server's scorer that ignores the temperature it is asked for (what `served_scores` must catch)."""

    def score(self, rollouts, **kwargs):
        return super().score(rollouts, **{**kwargs, "temperature": 1.0})


def test_startup_check_of_served_scores_passes_a_server_and_stops_one_that_drops_the_temperature(
    server, lab_teacher, tmp_path
):
    from opd.check.scoring import check_served_scores

    url, _, _ = server
    model, tokenizer, _ = lab_teacher
    prompts = [[3, 7, 11, 2, 5, 9, 1, 4], [8, 6, 2, 12, 5]]
    check = dict(top_k=16, vocab_rows=V, pad_id=tokenizer.pad_token_id)
    remote = RemoteScorer(url, token=TOKEN)
    for temperature in (1.0, 0.7):
        row = check_served_scores(remote, prompts, temperature=temperature, **check)
        assert row.status == "pass", row
    remote.close()
    with serve_in_thread(_TemperatureBlindScorer(model, vocab_size=V)) as (blind_url, _):
        blind = RemoteScorer(blind_url, token=TOKEN)
        assert check_served_scores(blind, prompts, temperature=1.0, **check).status == "pass"  # nothing to see at 1
        row = check_served_scores(blind, prompts, temperature=0.7, **check)
        blind.close()
        assert row.status == "fail" and row.hard and "temperature 0.7" in row.detail, row
        from opd.recipes.distill import distill

        token_file = tmp_path / "token"
        token_file.write_text(TOKEN)
        config = lab_config(
            tmp_path, "blind", *served_overrides(blind_url, token_file), "objective.teacher_temperature=0.7"
        )
        with pytest.raises(ValueError, match=r"^opd check: served_scores failed .*temperature 0\.7") as stopped:
            distill(config)
        assert "\n" not in str(stopped.value)
        # one of two teachers: its row is named after it, and the skip hint names the check
        teachers = [
            {"name": "a", "path": str(teacher_path()), "route": {"route_key": "steps", "values": [1, 2]}},
            {"name": "b", "url": blind_url, "token_file": str(token_file), "temperature": 0.7},
        ]
        teachers[1]["route"] = {"route_key": "steps", "values": [3, 4, 5]}
        lab = ["teacher=null", "data.limit=200"]
        config = lab_config(tmp_path, "blind_of_two", *lab, f"teachers={json.dumps(teachers)}")
        with pytest.raises(ValueError, match=r"^opd check: served_scores\[b\] failed .*temperature 0\.7") as stopped:
            distill(config)
        assert "\n" not in str(stopped.value) and str(stopped.value).endswith(
            "pass --skip-check served_scores (skip_checks)"
        )
        assert not list(tmp_path.glob("blind*/checkpoints/*"))  # stopped before the first step


# ------------------------------------------------------------------------------------------------ weights identity


def _one_weight_changed(source: Path, target: Path) -> Path:
    """A copy of the model directory `source` whose largest weight differs in one element (not the first of its
    tensor, nor one a strided sample of it would read): same tokenizer, same config, other weights."""
    import shutil

    from safetensors.torch import save_file

    shutil.copytree(source, target)
    weights = load_file(str(target / "model.safetensors"))
    name = max(weights, key=lambda k: weights[k].numel())
    assert weights[name].numel() > 2048
    weights[name].view(-1)[1] += 1.0
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


@contextmanager
def serve_dir(path: Path, port: int, name: str = "teacher"):
    """`opd serve-teacher --name NAME`'s service for the model directory `path` (loaded as the program loads it), on
    a loopback thread of this process; yields (url, service)."""
    from opd.recipes.serve_teacher import ServeConfig, load_service

    spec = ModelSpec(path=str(path), device="cpu", dtype="fp32")
    config = ServeConfig(model=spec, name=name, compile=False, port=port)
    service = load_service(config)
    with server_in_thread(service, TOKEN, port) as url:
        yield url, service


def test_the_served_fingerprint_hashes_every_weight_and_the_client_notices_a_swap(tmp_path):
    """Two tiny models of one tokenizer and config, one weight apart: `opd serve-teacher` gives them different
    fingerprints (the local teacher's whole-file one), and a client whose server was restarted on the other one
    between two batches stops in one line; restarted on the same files, it goes on."""
    from helpers import make_tiny_model
    from opd.fingerprints import model_fingerprint

    first = tmp_path / "a"
    make_tiny_model(seed=3).save_pretrained(first)
    make_tiny_tokenizer().save_pretrained(first)
    second = _one_weight_changed(first, tmp_path / "b")
    assert (first / "config.json").read_bytes() == (second / "config.json").read_bytes()

    port, rollouts = free_port(), random_rollouts(5, 2)
    with serve_dir(first, port) as (url, service):
        fingerprint_a = service.info["model_fingerprint"]
        remote = RemoteScorer(url, token=TOKEN)
        assert remote.info["model_fingerprint"] == fingerprint_a == model_fingerprint(str(first))
        remote.score(rollouts)
    with serve_dir(first, port):  # restarted on the same files: the same teacher
        remote.score(rollouts)
    with serve_dir(second, port) as (_, service):
        assert service.info["model_fingerprint"] == model_fingerprint(str(second)) != fingerprint_a
        with pytest.raises(TeacherRequestError, match="now serves other weights") as error:
            remote.score(rollouts)
        assert "\n" not in str(error.value) and fingerprint_a in str(error.value)
    remote.close()


def test_replicas_serving_other_weights_are_refused(tmp_path):
    from helpers import make_tiny_model

    first = tmp_path / "a"
    make_tiny_model(seed=3).save_pretrained(first)
    make_tiny_tokenizer().save_pretrained(first)
    second = _one_weight_changed(first, tmp_path / "b")
    with serve_dir(first, 0) as (url_a, _), serve_dir(second, 0) as (url_b, _):
        with pytest.raises(TeacherRequestError, match="model_fingerprint") as error:
            RemoteScorer([url_a, url_b], token=TOKEN, retry_deadline=5)
        assert "\n" not in str(error.value)


def test_resume_refuses_a_served_teacher_whose_weights_changed(tmp_path):
    """`opd distill --resume` with teacher.url: the checkpoint records the served teacher's weights fingerprint; a
    server on the same port, model name, tokenizer and config but other weights is refused in one line."""
    from opd.recipes.distill import distill

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    changed = _one_weight_changed(teacher_path(), tmp_path / "teacher-b")
    port = free_port()
    with serve_dir(teacher_path(), port) as (url, _):
        served = served_overrides(url, token_file)
        run_dir = distill(lab_config(tmp_path, "served", *served, steps=1))
    with serve_dir(changed, port):  # the same name too: only the weights tell them apart
        with pytest.raises(ValueError, match="fingerprint changed") as error:
            distill(lab_config(tmp_path, "served", *served, "run.resume=true", steps=2))
        assert "\n" not in str(error.value)
    assert run_dir.is_dir()
