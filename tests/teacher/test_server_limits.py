"""What an unauthenticated peer can hold of a served teacher (`opd.teacher.server`), over real sockets on loopback:
connections within the process's descriptor limit (so that the connection cap can still evict a half-open client
for a newcomer), no body read from a peer that is refused before it sends one, and tokens that could not travel in a
header refused where they are given. The header timeout and the cap
at plenty of descriptors: test_server.py."""

from __future__ import annotations

import resource
import socket

import pytest

from helpers_served_teacher import http_call, serve_in_thread, serve_process
from opd.config import ConfigError
from opd.teacher.client import RemoteScorer
from opd.teacher.server import SPARE_DESCRIPTORS, connection_cap, resolve_token

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")

DESCRIPTORS = 256


def _few_descriptors() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (DESCRIPTORS, DESCRIPTORS))


def _half_open(url: str, count: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sockets = []
    for _ in range(count):  # unauthenticated, headers never finished
        s = socket.create_connection((host, int(port)), timeout=60)
        s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        sockets.append(s)
    return sockets


@pytest.mark.slow
def test_half_open_clients_beyond_the_descriptor_limit_cannot_starve_healthz(tmp_path):
    # 400 half-open clients against a server that may open 256 descriptors, with the default max_connections (256)
    # and a header timeout far away: without a cap below the descriptor limit, accept() fails (EMFILE) and /healthz
    # is never answered while they stay.
    with serve_process(tmp_path, "request_timeout_s=600", preexec_fn=_few_descriptors) as (url, _, log_path):
        clients = _half_open(url, 400)
        try:
            assert http_call(url, "GET", "/healthz", token=None)[0] == 200  # (http_call waits at most 60 s)
        finally:
            for s in clients:
                s.close()
        assert "max_connections 256 lowered to" in log_path.read_text()


def test_the_connection_cap_fits_the_descriptor_limit():
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert connection_cap(4) == 4
    if soft != resource.RLIM_INFINITY:  # never more connections than descriptors left to accept them with
        assert connection_cap(10 * soft) <= soft - SPARE_DESCRIPTORS


def test_an_unauthenticated_body_is_never_read(lab_teacher):
    # the peer announces 45 MB and sends none of it: the 401 comes at once and the server closes the connection
    # instead of waiting to read (and drop) the body; request_timeout_s is far away, so only that close ends it
    with serve_in_thread(lab_teacher[2], request_timeout_s=600) as (url, _):
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 47185920\r\n\r\n")
            received = b""
            while chunk := s.recv(65536):
                received += chunk
        assert received.startswith(b"HTTP/1.1 401")
        assert b"connection: close" in received.lower()


def test_a_token_that_cannot_travel_in_a_header_is_refused_naming_its_origin(tmp_path, monkeypatch):
    secret = "tökén-0123456789-ŝecret"  # not latin-1: http.client would fail with a codec error naming nothing
    with pytest.raises(ConfigError) as raised:
        RemoteScorer("http://127.0.0.1:1", token=secret)
    assert "RemoteScorer token" in str(raised.value) and secret not in str(raised.value)
    monkeypatch.setenv("MY_TOKEN", secret)
    with pytest.raises(ConfigError) as raised:
        resolve_token(None, "MY_TOKEN")
    assert "$MY_TOKEN" in str(raised.value) and secret not in str(raised.value)
    token_file = tmp_path / "token"
    token_file.write_bytes(b"\xff\xfe" + b"s3cret-0123456789abcdef")  # not UTF-8
    with pytest.raises(ConfigError) as raised:
        resolve_token(str(token_file))
    assert str(token_file) in str(raised.value) and "s3cret" not in str(raised.value)


@pytest.mark.slow
def test_a_held_request_costs_its_parsed_arrays_not_also_its_wire_bytes(lab_teacher):
    # requests held behind a busy scorer: what the server keeps of each is its parsed arrays, not also the body as
    # received and a copy of it (which made eight 45 MB bodies cost ~0.8 GB)
    import threading
    import time
    import tracemalloc

    import torch

    from helpers_served_teacher import random_rollouts
    from opd.teacher import wire

    class Gated:
        def __init__(self, inner):
            self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

        def score(self, *args, **kwargs):
            self.entered.set()
            assert self.gate.wait(120)
            return self.inner.score(*args, **kwargs)

    rollouts = random_rollouts(3, 64, min_response=40, max_response=60)
    requested = torch.zeros(*rollouts.response_ids.shape, 64, dtype=torch.long)
    body = wire.encode_request(wire.request_from_rollouts(rollouts, requested))
    parsed = wire.decode_request(body)
    decoded = sum(t.nbytes for t in (parsed.tokens, parsed.row_lengths, parsed.requested_ids) if t is not None)
    count = 6
    gated = Gated(lab_teacher[2])
    statuses: list[int] = []

    def post() -> None:
        statuses.append(http_call(url, "POST", "/score", body)[0])

    def wait(condition) -> None:
        deadline = time.monotonic() + 120
        while not condition():
            assert time.monotonic() < deadline
            time.sleep(0.01)

    with serve_in_thread(gated, batch_window_ms=0, max_requested_ids=64) as (url, service):
        posts = [threading.Thread(target=post) for _ in range(count + 1)]
        posts[0].start()  # the first one holds the scoring loop at the gate; the others queue behind it
        wait(gated.entered.is_set)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for thread in posts[1:]:
                thread.start()
            wait(lambda: len(service.queue) == count)
            held = tracemalloc.get_traced_memory()[0] - before
        finally:
            tracemalloc.stop()
            gated.gate.set()
            for thread in posts:
                thread.join(120)
    assert statuses == [200] * (count + 1)
    assert held < count * (decoded + len(body)), (held, count * decoded, count * len(body))
