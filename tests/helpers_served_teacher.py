"""Helpers of the served-teacher tests (tests/teacher/): an `opd serve-teacher` subprocess on the shipped lab teacher
(fp32, CPU, a free port, always stopped) or the same app and service in a thread, raw HTTP calls, random rows of lab
ids, and the tolerance of scores batched another way. Their fixtures (`lab_teacher`, `server`):
tests/teacher/conftest.py.
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
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from helpers import server_in_thread
from opd.config import ModelSpec
from opd.lab import teacher_path
from opd.models import load_model
from opd.types import Rollouts, TokenScores

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
def serve_process(tmp_path: Path, *extra: str, port: int | None = None, name: str = "server", preexec_fn=None):
    """An `opd serve-teacher` subprocess on the lab teacher; yields (url, process, log path); always stopped.
    `preexec_fn`: run in the child before the server starts (e.g. to lower its descriptor limit)."""
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
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=preexec_fn)
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
