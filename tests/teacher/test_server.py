"""`opd serve-teacher` (`opd.teacher.server`, CPU, loopback only): served == local, concurrency and dynamic batching,
auth, every limit, garbage, disconnects, back-pressure, replicas, and hostile clients.

Servers run as real `opd serve-teacher` subprocesses on the shipped lab teacher (fp32, CPU), on free ports, always
stopped in a `finally`; the few tests that need to hold the scoring loop (back-pressure, a queued request whose
client leaves) serve in process from a thread, the same app and service (tests/helpers_served_teacher.py)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import torch

from helpers import make_tiny_tokenizer
from helpers_served_teacher import (
    BATCHING_ATOL,
    TOKEN,
    V,
    assert_scores_close,
    error_of,
    free_port,
    http_call,
    random_rollouts,
    serve_in_thread,
)
from opd.config import ConfigError, ModelSpec, validate_config
from opd.lab import teacher_path
from opd.models import TokenizerMismatchError, check_tokenizer_compatibility, load_model
from opd.teacher import wire
from opd.teacher.base import TeacherScorer, start_scoring
from opd.teacher.client import RemoteScorer, TeacherRequestError, TeacherUnavailableError
from opd.teacher.local import LocalScorer

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

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
