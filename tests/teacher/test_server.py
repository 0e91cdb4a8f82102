"""`opd serve-teacher` and `RemoteScorer` (CPU, loopback only): the wire format, served == local, `opd distill` and
`opd prompts score` with `teacher.url` == with the local teacher, concurrency and dynamic batching, auth, every
limit, garbage, disconnects, back-pressure, replicas, and a server killed and restarted in the middle of a run.

Servers run as real `opd serve-teacher` subprocesses on the shipped lab teacher (fp32, CPU), on free ports, always
stopped in a `finally`; the few tests that need to hold the scoring loop (back-pressure, a queued request whose
client leaves) serve in process from a thread, the same app and service.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import make_tiny_tokenizer, server_in_thread
from opd.config import ConfigError, DistillConfig, ModelSpec, build_config, validate_config
from opd.io import read_jsonl
from opd.lab import opd_prompts_path, student_path, teacher_path
from opd.models import TokenizerMismatchError, check_tokenizer_compatibility, load_model
from opd.teacher import wire
from opd.teacher.base import TeacherScorer, start_scoring
from opd.teacher.client import RemoteScorer, TeacherRequestError, TeacherUnavailableError
from opd.teacher.local import LocalScorer
from opd.train.checkpoint import latest_checkpoint
from opd.types import Rollouts, TokenScores

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

TOKEN = "test-token-0123456789abcdef"
V = 34  # the lab tokenizer's vocabulary (= the lab models' rows)
# Small limits, so that every limit can be crossed cheaply (and the client must split to respect them).
LIMITS = ["max_rows=8", "max_positions=128", "max_requested_ids=16", "max_top_k=20", "max_request_bytes=65536"]
FIELDS = ("sampled_logprobs", "topk_ids", "topk_logprobs", "entropy", "requested_logprobs")
START_TIMEOUT = 180  # seconds for a server subprocess to import torch and load the lab teacher on a busy CPU


# ------------------------------------------------------------------------------------------------ helpers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve_process(tmp_path: Path, *extra: str, port: int | None = None, name: str = "server"):
    """An `opd serve-teacher` subprocess on the lab teacher; yields (url, process, log path); always stopped."""
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    log_path = tmp_path / f"{name}.log"
    port = free_port() if port is None else port
    command = [
        sys.executable,
        "-m",
        "opd.cli",
        "serve-teacher",
        "--model",
        str(teacher_path()),
        "--device",
        "cpu",
        "--dtype",
        "fp32",
        "--port",
        str(port),
        "--token-file",
        str(token_file),
        *extra,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while "listening on" not in log_path.read_text():
            assert process.poll() is None, f"server exited: {log_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.1)
        url = re.search(r"listening on (http://\S+)", log_path.read_text()).group(1)
        yield url, process, log_path
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(15)


@contextmanager
def serve_in_thread(scorer, token: str | None = TOKEN, port: int = 0, files: Path | None = None, **config):
    """The same app and service in this process (for tests that must hold the scoring loop); always stopped. `files`:
    the model directory the scorer's weights were loaded from (default: the lab teacher's), whose fingerprint the
    server gives, as `opd serve-teacher` gives its model's."""
    from opd.fingerprints import model_fingerprint
    from opd.recipes.serve_teacher import ServeConfig
    from opd.teacher.server import service_for

    model = scorer.model if hasattr(scorer, "model") else scorer.inner.model
    _, tokenizer = load_model(teacher_path(), dtype="fp32", device="cpu")
    cfg = ServeConfig(model=ModelSpec(path=str(teacher_path())), **config)
    fingerprint = model_fingerprint(str(files or teacher_path()))
    service = service_for(model, tokenizer, cfg, name=str(teacher_path()), device="cpu", fingerprint=fingerprint)
    service.scorer = scorer
    with server_in_thread(service, token, port) as url:
        yield url, service


def http_call(url: str, method: str, path: str, body=None, headers=None, token: str | None = TOKEN, **kwargs):
    """(status, headers, body) of one raw HTTP request."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    headers = dict(headers or {})
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    try:
        conn.request(method, path, body=body, headers=headers, **kwargs)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def error_of(body: bytes) -> str:
    return json.loads(body)["error"]


def random_rollouts(
    seed: int, rows: int, max_prompt: int = 8, max_response: int = 12, min_response: int = 0
) -> Rollouts:
    """Right-padded rows of random lab ids: prompts of 1..max_prompt tokens, responses of min..max_response."""
    g = torch.Generator().manual_seed(seed)
    prompt_B = torch.randint(1, max_prompt + 1, (rows,), generator=g)
    response_B = torch.randint(min_response, max_response + 1, (rows,), generator=g)
    T, L = int(response_B.max()), int((prompt_B + response_B).max())
    ids = torch.randint(0, V, (rows, L), generator=g)
    attention = torch.arange(L)[None] < (prompt_B + response_B)[:, None]
    ids = ids.masked_fill(~attention, 0)
    response_mask = torch.arange(T)[None] < response_B[:, None]
    index = (prompt_B[:, None] + torch.arange(T)[None]).clamp(max=L - 1)
    response_ids = torch.where(response_mask, ids.gather(1, index), 0)
    return Rollouts(
        ids, attention, prompt_B, response_ids, response_mask, torch.arange(rows), torch.zeros(rows, dtype=torch.bool)
    )


# Scoring the same rows in another batch (other rows beside them, other padding) changes fp32 results by rounding:
# measured up to 1.1e-4 on the lab teacher between two local calls that only group rows differently (its log-probs
# reach -30, so that is ~5e-6 relative). Served results equal local ones to 1e-6 (in fact exactly) when the server
# scores the rows as one batch, as the local call does; where the client splits a batch or the server merges
# requests, this is the tolerance. A mixed-up response is off by whole nats.
BATCHING_ATOL = 1e-3


def assert_scores_close(a: TokenScores, b: TokenScores, atol: float, ids: bool = True) -> None:
    """Every field of two `TokenScores` within atol; ids equal unless `ids=False` (near-ties may swap under
    rounding: the log-probs still identify a response)."""
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None and (ids or x.is_floating_point()):
            assert x.shape == y.shape and x.dtype == y.dtype, name
            assert x.numel() == 0 or float((x.double() - y.double()).abs().max()) <= atol, name


@pytest.fixture(scope="module")
def lab_teacher():
    model, tokenizer = load_model(teacher_path(), dtype="fp32", device="cpu")
    return model, tokenizer, LocalScorer(model, vocab_size=V)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The module's `opd serve-teacher` (lab teacher, token, small limits): yields (url, token file, log path)."""
    tmp = tmp_path_factory.mktemp("server")
    with serve_process(tmp, *LIMITS) as (url, _, log_path):
        yield url, tmp / "token", log_path


# ------------------------------------------------------------------------------------------------ wire format


def test_wire_request_round_trip_is_exact():
    rollouts = random_rollouts(0, 6)
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 5))
    request = wire.request_from_rollouts(
        rollouts, requested, top_k=7, temperature=0.7, with_entropy=False, logprobs="bfloat16"
    )
    decoded = wire.decode_request(wire.encode_request(request))
    for name in ("row_lengths", "prompt_lengths", "tokens", "mask", "requested_ids"):
        assert torch.equal(getattr(decoded, name), getattr(request, name).to(getattr(decoded, name).dtype)), name
    assert (decoded.top_k, decoded.temperature, decoded.with_entropy, decoded.logprobs) == (7, 0.7, False, "bfloat16")
    rebuilt, grid = wire.rollouts_from_requests([decoded])
    mask = rollouts.response_mask
    scored = mask.any(1)
    assert torch.equal(rebuilt.response_mask.sum(1), mask.sum(1) * scored)
    assert torch.equal(rebuilt.response_ids[rebuilt.response_mask], rollouts.response_ids[mask])
    assert torch.equal(grid[rebuilt.response_mask], requested[mask])


@pytest.mark.parametrize("logprobs, atol", [("float32", 0.0), ("bfloat16", 2**-8)])  # bf16: 8 mantissa bits
def test_wire_response_round_trip(logprobs, atol):
    g = torch.Generator().manual_seed(1)
    response = wire.ScoreResponse(
        -torch.rand(9, generator=g) * 5,
        torch.randint(0, 1000, (9, 4), generator=g),
        -torch.rand(9, 4, generator=g),
        torch.rand(9, generator=g),
        -torch.rand(9, 3, generator=g),
    )
    decoded = wire.decode_response(wire.encode_response(response, logprobs))
    assert torch.equal(decoded.topk_ids, response.topk_ids)
    for name in ("sampled", "topk_logprobs", "entropy", "requested_logprobs"):
        x, y = getattr(decoded, name), getattr(response, name)
        assert x.dtype == torch.float32
        assert torch.allclose(x, y, rtol=atol, atol=0), name
    empty = wire.decode_response(wire.encode_response(wire.ScoreResponse(torch.zeros(0))))
    assert empty.sampled.shape == (0,) and empty.topk_ids is None


def test_wire_bytes_per_position_match_the_docstring():
    rollouts = random_rollouts(2, 4, max_prompt=1, max_response=40)
    positions = int(rollouts.response_mask.sum())
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 16))
    request = wire.request_from_rollouts(rollouts, requested)
    request_bytes = len(wire.encode_request(request))
    response = wire.ScoreResponse(
        torch.zeros(positions),
        torch.zeros(positions, 16, dtype=torch.long),
        torch.zeros(positions, 16),
        torch.zeros(positions),
        torch.zeros(positions, 16),
    )
    # per position: request 69 B + 4 B per prompt token (one here); response 200 B fp32, 132 B bf16 (+ headers)
    assert 69 * positions < request_bytes <= 73 * positions + 400
    assert 200 * positions < len(wire.encode_response(response)) <= 200 * positions + 400
    assert 132 * positions < len(wire.encode_response(response, "bfloat16")) <= 132 * positions + 400


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda b: b[:5], "shorter than"),
        (lambda b: b"XXXX" + b[4:], "not an opd teacher message"),
        (lambda b: b[:4] + bytes([9]) + b[5:], "unknown wire version 9"),
        (lambda b: b[:-3], "needs"),
        (lambda b: b + b"\0" * 8, "bytes after the last array"),
        (lambda b: b[:12] + b"\xff" + b[13:], "not valid UTF-8 JSON"),
    ],
)
def test_wire_rejects_malformed_messages(mutate, message):
    body = wire.encode_request(wire.request_from_rollouts(random_rollouts(3, 2), None))
    with pytest.raises(wire.WireError, match=message):
        wire.decode_request(mutate(body))


def test_wire_rejects_inconsistent_arrays():
    ok = wire.request_from_rollouts(random_rollouts(4, 3), None)
    bad = wire.ScoreRequest(ok.row_lengths, ok.prompt_lengths, ok.tokens[:-1], ok.mask)
    with pytest.raises(wire.WireError, match="tokens: .* row_lengths add up to"):
        wire.decode_request(wire.encode_request(bad))
    bad = wire.ScoreRequest(ok.row_lengths, ok.row_lengths + 1, ok.tokens, ok.mask)
    with pytest.raises(wire.WireError, match="prompt_lengths: row 0"):
        wire.decode_request(wire.encode_request(bad))
    bad = wire.ScoreRequest(
        ok.row_lengths, ok.prompt_lengths, ok.tokens, ok.mask, torch.zeros(ok.num_positions + 1, 2, dtype=torch.long)
    )
    with pytest.raises(wire.WireError, match="requested_ids: shape"):
        wire.decode_request(wire.encode_request(bad))


# ------------------------------------------------------------------------------------------------ served == local


@pytest.mark.parametrize(
    "top_k, R, temperature, with_entropy",
    [(16, 16, 1.0, True), (0, None, 1.0, False), (5, 3, 0.7, True), (20, 8, 1.3, False)],
)
def test_served_equals_local(server, lab_teacher, top_k, R, temperature, with_entropy):
    url, _, _ = server
    _, _, local = lab_teacher
    remote = RemoteScorer(url, token=TOKEN)
    for seed in range(3):  # ≤ 8 rows: one request, scored as the local call scores them
        rollouts = random_rollouts(10 * seed + top_k, rows=8)
        g = torch.Generator().manual_seed(seed)
        requested = None if R is None else torch.randint(0, V, (*rollouts.response_ids.shape, R), generator=g)
        kwargs = dict(top_k=top_k, requested_ids=requested, temperature=temperature, with_entropy=with_entropy)
        assert_scores_close(remote.score(rollouts, **kwargs), local.score(rollouts, **kwargs), atol=1e-6)
    remote.close()


def test_a_batch_split_into_requests_equals_local(server, lab_teacher):
    url, _, _ = server
    _, _, local = lab_teacher
    remote = RemoteScorer(url, token=TOKEN)
    rollouts = random_rollouts(11, rows=21, max_response=40)  # > max_rows=8 and > max_request_bytes: 4+ requests
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 16))
    got = remote.score(rollouts, top_k=16, requested_ids=requested)
    assert_scores_close(got, local.score(rollouts, top_k=16, requested_ids=requested), atol=BATCHING_ATOL, ids=False)
    remote.close()


def test_start_scoring_gives_the_scores_of_a_served_and_of_a_local_teacher(server, lab_teacher):
    """`start_scoring` is `score_async` of any `TeacherScorer` (the served one sends its requests at once, the local one
    scores at once); both have every member of the protocol and score requested ids; `close` is idempotent."""
    url, _, _ = server
    _, _, local = lab_teacher
    remote = RemoteScorer(url, token=TOKEN)
    rollouts = random_rollouts(12, rows=8)  # one request, scored as the local call scores them
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 4), generator=torch.Generator().manual_seed(0))
    kwargs = dict(top_k=4, requested_ids=requested)
    for scorer in (remote, local):
        assert isinstance(scorer, TeacherScorer) and scorer.serves_requested_ids
        assert_scores_close(
            start_scoring(scorer, rollouts, **kwargs).result(), local.score(rollouts, **kwargs), atol=1e-6
        )
        scorer.close()
    remote.close()


def test_served_bf16_wire_is_close(server, lab_teacher):
    url, _, _ = server
    remote = RemoteScorer(url, token=TOKEN, logprobs="bfloat16")
    rollouts = random_rollouts(5, 6)
    a, b = remote.score(rollouts, top_k=4), lab_teacher[2].score(rollouts, top_k=4)
    assert torch.equal(a.topk_ids, b.topk_ids)
    assert torch.allclose(a.topk_logprobs, b.topk_logprobs, rtol=2**-8, atol=1e-6)


def test_client_refuses_another_tokenizer_with_the_local_message(server, lab_teacher):
    url, _, _ = server
    _, lab_tokenizer, _ = lab_teacher
    other = make_tiny_tokenizer()
    with pytest.raises(TokenizerMismatchError) as local:
        check_tokenizer_compatibility(other, lab_tokenizer)
    remote = RemoteScorer(url, token=TOKEN)
    with pytest.raises(TokenizerMismatchError) as served:
        remote.check_tokenizer(other)
    assert str(served.value) == str(local.value) and "\n" not in str(served.value)
    assert remote.check_tokenizer(lab_tokenizer, student_rows=V).tokenizer_size == V


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


# ------------------------------------------------------------------------------------------------ concurrency


@pytest.mark.slow
def test_concurrent_clients_get_their_own_answers_and_requests_merge(server, lab_teacher):
    url, _, _ = server
    _, _, local = lab_teacher
    clients, per_client = 16, 50
    cases = {}
    for c in range(clients):
        for i in range(per_client):
            rollouts = random_rollouts(1000 * c + i, rows=1 + (c + i) % 3, max_response=10)
            requested = torch.randint(
                0, V, (*rollouts.response_ids.shape, 4), generator=torch.Generator().manual_seed(c * 7919 + i)
            )
            cases[c, i] = (rollouts, requested)
    # the expected scores of all 800 cases from one local call (cheap), cut back per case
    requests = [wire.request_from_rollouts(r, q) for r, q in cases.values()]
    merged, requested_BTR = wire.rollouts_from_requests(requests)
    everything = wire.response_from_scores(
        local.score(merged, top_k=8, requested_ids=requested_BTR), merged.response_mask
    )
    expected = dict(zip(cases, wire.split_response(everything, [q.num_positions for q in requests])))
    expected_requests = sum(q.num_positions > 0 for q in requests)  # a call with nothing to score sends nothing
    before = json.loads(http_call(url, "GET", "/metrics")[2])
    mixed_up, failures = [], []

    def client(c: int) -> None:
        try:
            remote = RemoteScorer(url, token=TOKEN)
            for i in range(per_client):
                rollouts, requested = cases[c, i]
                got = wire.response_from_scores(
                    remote.score(rollouts, top_k=8, requested_ids=requested), rollouts.response_mask
                )
                want = expected[c, i]
                # merged with other clients' rows: equal up to batching rounding; a mixed-up answer is nats off
                for name in ("sampled", "topk_logprobs", "entropy", "requested_logprobs"):
                    x, y = getattr(got, name), getattr(want, name)
                    if x.shape != y.shape or (x.numel() and float((x - y).abs().max()) > BATCHING_ATOL):
                        mixed_up.append((c, i, name))
            remote.close()
        except Exception as error:  # surfaced below
            failures.append(repr(error))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not failures and not any(t.is_alive() for t in threads)
    assert mixed_up == []
    after = json.loads(http_call(url, "GET", "/metrics")[2])
    scored = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    assert scored == expected_requests
    assert after["merged_requests"] > before["merged_requests"] and batches < scored  # dynamic batching merged


def test_replicas_share_the_work(server, lab_teacher):
    url, _, _ = server
    _, _, local = lab_teacher
    with serve_in_thread(local, max_rows=8) as (second, service):
        remote = RemoteScorer([url, second], token=TOKEN, request_tokens=40, concurrency=8)
        rollouts = random_rollouts(77, rows=40, max_response=12)
        for _ in range(3):
            assert_scores_close(
                remote.score(rollouts, top_k=8), local.score(rollouts, top_k=8), atol=BATCHING_ATOL, ids=False
            )
        remote.close()
        assert service.metrics()["requests"] > 0  # the in-process replica got some of the requests


# ------------------------------------------------------------------------------------------------ auth, limits


def test_auth(server):
    url, _, log_path = server
    assert http_call(url, "GET", "/healthz", token=None)[0] == 200
    for path, method in (("/info", "GET"), ("/metrics", "GET"), ("/vocab", "GET"), ("/score", "POST")):
        assert http_call(url, method, path, body=b"" if method == "POST" else None, token=None)[0] == 401
        assert http_call(url, method, path, body=b"" if method == "POST" else None, token=TOKEN[:-1] + "x")[0] == 401
    assert http_call(url, "GET", "/info")[0] == 200
    body = wire.encode_request(wire.request_from_rollouts(random_rollouts(1, 2), None))
    assert http_call(url, "POST", "/score", body)[0] == 200
    with pytest.raises(TeacherRequestError, match="401"):
        RemoteScorer(url, token="wrong-token-0123456789")
    assert TOKEN not in log_path.read_text()


def _request(rows=2, R=None, **meta):
    """A valid request of `rows` rows, each with at least one scored position; `meta` overrides its fields."""
    rollouts = random_rollouts(8, rows, min_response=1)
    requested = None if R is None else torch.zeros(*rollouts.response_ids.shape, R, dtype=torch.long)
    request = wire.request_from_rollouts(rollouts, requested)
    for key, value in meta.items():
        setattr(request, key, value)
    return request


def _post(url, body, **kwargs):
    status, headers, data = http_call(url, "POST", "/score", body, **kwargs)
    return status, headers, (error_of(data) if status != 200 else data)


def test_each_limit_answers_its_4xx(server):
    url, _, _ = server
    status, _, message = _post(url, wire.encode_request(_request(rows=9)))
    assert (status, message) == (400, "rows: 9 rows exceed the server's limit of 8 per request (max_rows)")
    long_row = wire.request_from_rollouts(random_rollouts(2, 1, min_response=130, max_response=130), None)
    status, _, message = _post(url, wire.encode_request(long_row))
    assert status == 400 and message.startswith("row_lengths: row 0 has") and "(max_positions)" in message
    status, _, message = _post(url, wire.encode_request(_request(R=17)))
    assert status == 400 and message.startswith("requested_ids: 17 ids per position") and "max_requested_ids" in message
    status, _, message = _post(url, wire.encode_request(_request(top_k=21)))
    assert status == 400 and message.startswith("top_k: 21") and "max_top_k" in message
    out_of_vocab = _request()
    out_of_vocab.tokens[0] = V
    status, _, message = _post(url, wire.encode_request(out_of_vocab))
    assert (status, message) == (400, f"tokens: id {V} at row 0, token 0 is outside the vocabulary [0, {V})")
    bad_requested = _request(R=2)
    bad_requested.requested_ids[0, 1] = -1
    status, _, message = _post(url, wire.encode_request(bad_requested))
    assert (status, message) == (
        400,
        f"requested_ids: id -1 at scored position 0, slot 1 is outside the vocabulary [0, {V})",
    )
    status, headers, message = _post(url, b"\0" * 70000)
    assert status == 413 and "max_request_bytes" in message
    chunks = (b"\0" * 8192 for _ in range(10))  # no Content-Length: counted while it streams
    status, _, message = _post(url, chunks, encode_chunked=True, headers={"Transfer-Encoding": "chunked"})
    assert status == 413 and "max_request_bytes" in message


@pytest.mark.parametrize(
    "body, message",
    [
        (b"", "shorter than"),
        (b"GET / HTTP/1.1\r\n\r\n", "not an opd teacher message"),
        (wire.MAGIC + bytes([2, 0, 0, 0]) + b"\0" * 8, "unknown wire version 2"),
        (bytes(range(256)) * 4, "not an opd teacher message"),
    ],
)
def test_garbage_bodies_get_400_and_the_server_goes_on(server, body, message):
    url, _, _ = server
    status, _, text = _post(url, body)
    assert status == 400 and message in text and "\n" not in text
    assert _post(url, wire.encode_request(_request()))[0] == 200


def test_bad_meta_values_get_400(server):
    url, _, _ = server
    for meta, message in (
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"logprobs": "float16"}, "logprobs"),
    ):
        request = _request()
        kind, header_meta, arrays = wire.decode_message(wire.encode_request(request))
        body = wire.encode_message(
            kind,
            {**header_meta, **meta},
            [(name, arrays[name], "uint8" if name == "mask" else "int32") for name in arrays],
        )
        status, _, text = _post(url, body)
        assert status == 400 and text.startswith(message), text


def test_client_checks_limits_before_sending(server):
    url, _, _ = server
    remote = RemoteScorer(url, token=TOKEN)
    rollouts = random_rollouts(1, 2)
    with pytest.raises(TeacherRequestError, match="max_requested_ids"):
        remote.score(rollouts, requested_ids=torch.zeros(*rollouts.response_ids.shape, 17, dtype=torch.long))
    with pytest.raises(TeacherRequestError, match="top_k: 21"):
        remote.score(rollouts, top_k=21)
    remote.close()


def test_the_queue_drops_a_cancelled_job_behind_others():
    """A client that leaves while its job waits behind another one: the job is dropped, the queue keeps serving.
    (Jobs compared field-wise made `deque.remove` compare request tensors and killed the scoring thread.)"""
    from opd.teacher.server import Job, ScoringQueue

    queue = ScoringQueue(max_batch_tokens=10_000, window_s=0.0, max_queue_tokens=10_000)
    first, left, last = (Job(_request(rows=2), tokens=8) for _ in range(3))
    for job in (first, left, last):
        queue.put(job)
    assert left.future.cancel()
    assert queue.take() == [first, last] and len(queue) == 0


def test_a_client_disconnecting_mid_request_does_not_break_the_server(server):
    url, _, _ = server
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = wire.encode_request(_request(rows=4))
    head = (
        f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    for cut in (len(head) // 2, len(head) + len(body) // 2, len(head) + len(body)):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall((head + body)[:cut])  # then leave: mid-headers, mid-body, right after the body
    assert http_call(url, "GET", "/healthz", token=None)[0] == 200
    assert _post(url, body)[0] == 200


def test_non_loopback_needs_a_token_and_short_tokens_are_refused(tmp_path, monkeypatch):
    from opd.recipes.serve_teacher import ServeConfig, check_serve_config, serve

    monkeypatch.delenv("OPD_TEACHER_TOKEN", raising=False)
    config = ServeConfig(model=ModelSpec(path=str(tmp_path / "no-model")), host="0.0.0.0")
    with pytest.raises(ConfigError, match="host=0.0.0.0 is not a loopback address"):
        serve(config)  # refused before any model loads (the path does not even exist)
    monkeypatch.setenv("OPD_TEACHER_TOKEN", TOKEN)
    assert check_serve_config(config) == TOKEN
    (tmp_path / "short").write_text("abc\n")
    with pytest.raises(ConfigError, match="at least 16 characters"):
        check_serve_config(config.model_copy(update={"token_file": str(tmp_path / "short")}))
    with pytest.raises(ConfigError, match="give model.device"):
        validate_config(ServeConfig, {"model": {"path": "x", "device": "cpu"}, "device_map": "auto"})


# ------------------------------------------------------------------------------------------------ back-pressure


class Gated:
    """Holds the scoring loop until `gate` is set (so the queue fills behind it); scores with `inner`."""

    def __init__(self, inner):
        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

    def score(self, *args, **kwargs):
        self.entered.set()
        assert self.gate.wait(60)
        return self.inner.score(*args, **kwargs)


def _wait(condition, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_full_queue_answers_503_with_retry_after_and_clients_retry(lab_teacher):
    gated = Gated(lab_teacher[2])
    body = wire.encode_request(_request(rows=2))
    tokens = wire.decode_request(body).num_tokens
    with serve_in_thread(gated, max_queue_tokens=tokens, batch_window_ms=0) as (url, service):
        results = {}
        first = threading.Thread(target=lambda: results.setdefault("first", _post(url, body)))
        first.start()
        assert gated.entered.wait(30)  # the worker has taken the first request and waits at the gate
        second = threading.Thread(target=lambda: results.setdefault("second", _post(url, body)))
        second.start()
        _wait(lambda: len(service.queue) == 1)
        status, headers, message = _post(url, body)
        assert status == 503 and headers.get("retry-after") == "1" and "max_queue_tokens" in message
        remote = RemoteScorer(url, token=TOKEN)
        retried = remote.score_async(random_rollouts(8, 2), top_k=4)  # 503 now; retried until the gate opens
        time.sleep(1.0)
        gated.gate.set()
        assert_scores_close(retried.result(), lab_teacher[2].score(random_rollouts(8, 2), top_k=4), atol=1e-6)  # alone
        first.join(30)
        second.join(30)
        assert results["first"][0] == 200 and results["second"][0] == 200
        assert service.metrics()["rejected_busy"] >= 2
        remote.close()


def test_a_queued_request_whose_client_leaves_is_skipped(lab_teacher):
    gated = Gated(lab_teacher[2])
    body = wire.encode_request(_request(rows=2))
    with serve_in_thread(gated, batch_window_ms=0) as (url, service):
        holder = threading.Thread(target=lambda: _post(url, body))
        holder.start()
        assert gated.entered.wait(30)  # taken by the worker, held at the gate
        host, port = url.removeprefix("http://").rsplit(":", 1)
        head = (
            f"POST /score HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(head + body)
            _wait(lambda: len(service.queue) == 1)
        _wait(lambda: service.metrics()["disconnected"] == 1)
        gated.gate.set()
        holder.join(30)
        _wait(lambda: service.metrics()["requests"] == 1)
        time.sleep(0.2)
        assert service.metrics()["requests"] == 1 and len(service.queue) == 0  # the left request was never scored


def test_unreachable_server_fails_after_the_deadline_in_one_line():
    messages = []
    start = time.monotonic()
    with pytest.raises(TeacherUnavailableError) as error:
        RemoteScorer(f"http://127.0.0.1:{free_port()}", retry_deadline=1.0, log=messages.append)
    assert time.monotonic() - start < 30
    assert "did not answer" in str(error.value) and "\n" not in str(error.value)
    assert isinstance(error.value, ValueError)  # the CLI prints it as one line
    assert len(messages) == 1 and "not answering (connection refused)" in messages[0]


def test_device_map_auto_loads_and_scores_like_a_plain_load(lab_teacher):
    pytest.importorskip("accelerate")
    mapped, _ = load_model(teacher_path(), dtype="fp32", device="cpu", device_map="auto")
    rollouts = random_rollouts(3, 5)
    requested = torch.randint(0, V, (*rollouts.response_ids.shape, 4))
    assert_scores_close(
        LocalScorer(mapped, vocab_size=V).score(rollouts, requested_ids=requested),
        lab_teacher[2].score(rollouts, requested_ids=requested),
        atol=1e-6,
    )


# ------------------------------------------------------------------------------------------------ a hostile client
# issue 22 items 1-5: a buggy or hostile client on a shared machine must not fail others' requests, exhaust the
# server, or make a run use another teacher without a word.


def _body_with(request: wire.ScoreRequest, dtypes: dict[str, str] | None = None, meta: dict | None = None) -> bytes:
    """`request` framed with some arrays in another wire dtype and some meta fields replaced."""
    kind, header_meta, arrays = wire.decode_message(wire.encode_request(request))
    dtypes = {"mask": "uint8", **(dtypes or {})}
    return wire.encode_message(
        kind, {**header_meta, **(meta or {})}, [(n, a, dtypes.get(n, "int32")) for n, a in arrays.items()]
    )


def _raw_message(header: dict | bytes, payload: bytes = b"") -> bytes:
    data = header if isinstance(header, bytes) else json.dumps(header).encode()
    prefix = wire._PREFIX.pack(wire.MAGIC, wire.VERSION, len(data))
    return prefix + data + b"\0" * (-(len(prefix) + len(data)) % 8) + payload


HOSTILE_BODIES = [
    (_body_with(_request(), {"tokens": "float32"}), "tokens: dtype float32, expected int32"),
    (_body_with(_request(), {"row_lengths": "float32"}), "row_lengths: dtype float32, expected int32"),
    (_body_with(_request(), {"mask": "int32"}), "mask: dtype int32, expected uint8"),
    (_body_with(_request(R=2), {"requested_ids": "bfloat16"}), "requested_ids: dtype bfloat16, expected int32"),
    (_body_with(_request(), meta={"temperature": 1e-300}), "temperature: expected a number in"),
    # extents whose int64 product wraps to zero (2**32 * 2**32) or overflows: refused, not reshaped
    (_raw_message({"kind": "score", "meta": {}, "arrays": [["tokens", "uint8", [2**32, 2**32]]]}), "header.arrays"),
    (_raw_message({"kind": "score", "meta": {}, "arrays": [["tokens", "int32", [2**62, 4]]]}), "header.arrays"),
    (_raw_message({"kind": "score", "meta": {"x": [[[[[[[[[[1]]]]]]]]]]}, "arrays": []}), "header: nested deeper"),
    (_raw_message(b"[" * 60000 + b"]" * 5000), "header: nested deeper"),
    (_raw_message({"kind": "score", "meta": {}, "arrays": [["extra", "int32", [0]]]}), "extra: not an array"),
]


@pytest.mark.parametrize("body, message", HOSTILE_BODIES)
def test_every_wire_field_is_checked_before_scoring(server, body, message):
    url, _, log_path = server
    status, _, text = _post(url, body)
    assert status == 400 and text.startswith(message) and "\n" not in text, text
    assert _post(url, wire.encode_request(_request()))[0] == 200
    assert "Traceback" not in log_path.read_text()  # a bad request logs at most one line, never a traceback


def test_a_hostile_client_fails_none_of_the_requests_of_others(lab_teacher):
    """Bad-dtype requests sent while well-behaved clients score, merged into their batches if they got through."""
    good = [wire.encode_request(_request(rows=2)) for _ in range(4)]
    bad = [body for body, _ in HOSTILE_BODIES[:4]]
    with serve_in_thread(lab_teacher[2], batch_window_ms=20) as (url, service):
        results: dict[str, list[int]] = {"good": [], "bad": []}

        def client(kind: str, bodies: list[bytes], repeats: int) -> None:
            for _ in range(repeats):
                for body in bodies:
                    results[kind].append(_post(url, body)[0])

        threads = [threading.Thread(target=client, args=("good", [body], 8)) for body in good]
        threads.append(threading.Thread(target=client, args=("bad", bad, 8)))
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        assert results["good"] == [200] * 32 and set(results["bad"]) == {400}
        assert service.metrics()["errors"] == 0


class FailsOnMarker:
    """The lab teacher, except that scoring a batch holding a row that starts with `marker` raises (as a request
    that breaks the model would): the failure must stay with that request."""

    def __init__(self, inner, marker: int):
        self.inner, self.marker, self.model = inner, marker, inner.model

    def score(self, rollouts, **kwargs):
        if bool((rollouts.input_ids[:, 0] == self.marker).any()):
            raise RuntimeError("this row breaks the model")
        return self.inner.score(rollouts, **kwargs)


def test_a_failing_request_in_a_merged_batch_fails_alone(lab_teacher, caplog):
    gated = Gated(FailsOnMarker(lab_teacher[2], marker=V - 1))
    poisoned = _request(rows=2)
    poisoned.tokens[0] = V - 1
    good_body, bad_body = wire.encode_request(_request(rows=2)), wire.encode_request(poisoned)
    with serve_in_thread(gated, batch_window_ms=0) as (url, service):
        results: list = []
        holder = threading.Thread(target=lambda: results.append(("holder", _post(url, good_body)[0])))
        holder.start()
        assert gated.entered.wait(30)  # the worker holds the first request: the next ones queue and merge
        posts = [
            threading.Thread(target=lambda b=b, k=k: results.append((k, _post(url, b)[0])))
            for k, b in (("good", good_body), ("bad", bad_body), ("good", good_body))
        ]
        for thread in posts:
            thread.start()
        _wait(lambda: len(service.queue) == 3)
        gated.gate.set()
        for thread in [holder, *posts]:
            thread.join(60)
        assert sorted(results) == [("bad", 500), ("good", 200), ("good", 200), ("holder", 200)]
        assert service.metrics()["max_requests_per_batch"] == 2  # the merged batch's good requests were re-scored
    failures = [r for r in caplog.records if r.name == "opd.teacher.server" and r.levelname == "ERROR"]
    assert len(failures) == 1 and failures[0].exc_info is None and "\n" not in failures[0].getMessage()


def test_requests_no_batch_can_hold_get_413_and_rows_stay_within_the_context(lab_teacher):
    with serve_in_thread(lab_teacher[2], max_batch_tokens=16) as (url, service):
        assert service.info["max_positions"] == 256  # the lab models' context, not 65536
        status, _, message = _post(url, wire.encode_request(_request(rows=4)))  # > 16 tokens, the queue is empty
        assert status == 413 and "(max_batch_tokens)" in message
    with serve_in_thread(lab_teacher[2]) as (url, _):
        long_row = wire.request_from_rollouts(random_rollouts(2, 1, min_response=300, max_response=300), None)
        status, _, message = _post(url, wire.encode_request(long_row))
        assert status == 400 and "max_positions" in message and "256" in message


def test_request_bytes_in_flight_are_bounded(lab_teacher):
    gated = Gated(lab_teacher[2])
    body = wire.encode_request(wire.request_from_rollouts(random_rollouts(4, 8, min_response=60, max_response=90)))
    limit = 3 * len(body)
    with serve_in_thread(gated, batch_window_ms=0, max_request_bytes=len(body), max_inflight_bytes=limit) as (
        url,
        service,
    ):
        statuses: list[int] = []
        posts = [
            threading.Thread(target=lambda: statuses.append(http_call(url, "POST", "/score", body)[0]))
            for _ in range(8)
        ]
        for thread in posts:
            thread.start()
        _wait(lambda: len(statuses) >= 5)  # 3 held (one at the gate, two queued); the others are turned away
        assert service.metrics()["inflight_bytes"] <= limit
        gated.gate.set()
        for thread in posts:
            thread.join(60)
        assert sorted(statuses) == [200] * 3 + [503] * 5
        metrics = service.metrics()
        assert metrics["max_inflight_bytes_seen"] <= limit and metrics["inflight_bytes"] == 0


def test_half_open_clients_are_closed_and_cannot_starve_healthz(lab_teacher):
    with serve_in_thread(lab_teacher[2], max_connections=8, request_timeout_s=2.0) as (url, service):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        half_open = []
        for _ in range(20):  # unauthenticated, headers never finished
            s = socket.create_connection((host, int(port)), timeout=20)
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
            half_open.append(s)
        assert http_call(url, "GET", "/healthz", token=None)[0] == 200  # (http_call waits at most 60 s)
        try:
            for s in half_open:  # all closed by the server: evicted for newcomers, or at the header timeout
                try:
                    assert s.recv(1024) == b""
                except ConnectionResetError:
                    pass
        finally:
            for s in half_open:
                s.close()
        assert _post(url, wire.encode_request(_request()))[0] == 200


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
