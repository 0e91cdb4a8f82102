"""The teacher as an HTTP service that scores *any* token ids, shared by trainers: the app, the batching and the wire
handling behind `opd serve-teacher` (whose program, loading the model and running uvicorn, is
`opd.recipes.serve_teacher`).

One worker thread owns the model and runs `LocalScorer`, the code a local teacher runs, so a served teacher scores
exactly like a local one; the web stack (uvicorn + Starlette) only receives, checks and answers (/score, /info,
/vocab, /metrics, /healthz). Requests that arrive together and ask for the same thing are merged into one scoring
batch; a full queue answers 503. Any address but 127.0.0.1 needs a bearer token. The routes, the batching and the
limits: docs/design.md, "opd.teacher.server".

Omitted on purpose: TLS (use a TLS proxy or an SSH tunnel), several models per process (one server per teacher), and
a server-side cache between requests (a request is stateless, so replicas balance freely and a restart loses nothing).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.config import ConfigError
from opd.config.serve_teacher import MIN_TOKEN_LENGTH, TOKEN_ENV, ServeLimits
from opd.fingerprints import weights_fingerprint
from opd.models import check_tokenizer_compatibility, embedding_rows, fix_rope
from opd.teacher import wire
from opd.teacher.base import head_fingerprint
from opd.teacher.local import LocalScorer
from opd.types import TokenScores

log = logging.getLogger("opd.teacher.server")

INSTANCE_HEADER = "x-opd-teacher-instance"  # this server process: a random nonce drawn at start
FINGERPRINT_HEADER = "x-opd-teacher-fingerprint"  # the weights it serves (/info's `model_fingerprint`)


# ------------------------------------------------------------------------------------------------ identity


def resolve_token(token_file: str | None, env: str = TOKEN_ENV) -> str | None:
    """The bearer token from `token_file`, else from the environment variable `env`, else None. One-line
    `ConfigError` for an unreadable, empty or short token."""
    if token_file is not None:
        origin = f"token_file {token_file}"
        try:
            token = open(os.path.expanduser(token_file), encoding="utf-8").read().strip()
        except OSError as error:
            raise ConfigError(f"token_file: cannot read {token_file}: {error.strerror or error}") from None
        except UnicodeDecodeError:  # the bytes are never shown: they may be the secret
            token = "\ufffd"  # refused below, with the rule
    else:
        token = os.environ.get(env, "").strip()
        origin = f"${env}"
        if not token:
            return None
    check_token(token, origin)
    return token


def check_token(token: str, origin: str) -> None:
    """One-line `ConfigError` naming `origin` (never the token) unless `token` can travel in an HTTP header and is
    long enough: at least MIN_TOKEN_LENGTH printable ASCII characters, no spaces (a non-latin-1 token would otherwise
    fail in http.client's header encoding with a codec error naming neither the token nor where it came from)."""
    if len(token) < MIN_TOKEN_LENGTH or not all("!" <= c <= "~" for c in token):  # what an HTTP header carries
        raise ConfigError(
            f"{origin}: the token must be at least {MIN_TOKEN_LENGTH} characters without spaces, printable ASCII "
            f"only (e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ------------------------------------------------------------------------------------------------ batching


class QueueFull(Exception):
    """More tokens are waiting than the server accepts (answered with 503 + Retry-After)."""


@dataclass(eq=False)  # jobs are told apart by identity: a field-wise == would compare request tensors
class Job:
    request: wire.ScoreRequest
    tokens: int
    arrival: float = field(default_factory=time.monotonic)
    future: Future = field(default_factory=Future)
    answer: str = "scores"  # or a hidden-state answer's wire dtype (/hidden): never merged with the other kind


class ScoringQueue:
    """The requests waiting for the scoring loop. `put` from any thread; `take` from the one worker: the oldest
    request plus the later ones with the same key that fit `max_batch_tokens`, after waiting up to `window_s` from
    the oldest's arrival for more to come (returns early once the batch is full). Cancelled jobs are dropped."""

    def __init__(self, *, max_batch_tokens: int, window_s: float, max_queue_tokens: int):
        self.max_batch_tokens, self.window_s, self.max_queue_tokens = max_batch_tokens, window_s, max_queue_tokens
        self._jobs: deque[Job] = deque()
        self._cond = threading.Condition()
        self.queued_tokens = 0
        self.closed = False

    def put(self, job: Job) -> None:
        with self._cond:
            if self._jobs and self.queued_tokens + job.tokens > self.max_queue_tokens:
                raise QueueFull
            self._jobs.append(job)
            self.queued_tokens += job.tokens
            self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._jobs)

    def close(self) -> None:
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def take(self) -> list[Job] | None:
        """The next batch (blocks); None once closed."""
        with self._cond:
            while True:
                self._drop_cancelled()
                if self.closed:
                    return None
                if not self._jobs:
                    self._cond.wait()
                    continue
                batch = self._compatible()
                left = self._jobs[0].arrival + self.window_s - time.monotonic()
                if sum(j.tokens for j in batch) >= self.max_batch_tokens or left <= 0:
                    break
                self._cond.wait(left)
            for job in batch:
                self._jobs.remove(job)
                self.queued_tokens -= job.tokens
            return batch

    def _compatible(self) -> list[Job]:
        head = self._jobs[0]
        batch, total = [head], head.tokens
        for job in list(self._jobs)[1:]:
            if (
                job.request.key == head.request.key
                and job.answer == head.answer
                and total + job.tokens <= self.max_batch_tokens
            ):
                batch.append(job)
                total += job.tokens
        return batch

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._jobs if j.future.cancelled()]:
            self._jobs.remove(job)
            self.queued_tokens -= job.tokens


def score_requests(scorer: Any, requests: list[wire.ScoreRequest]) -> list[wire.ScoreResponse]:
    """Score requests with equal keys as one batch: their rows are concatenated into one `Rollouts`, scored once,
    and the scored positions are cut back per request."""
    top_k, _, temperature, with_entropy = requests[0].key
    rollouts, requested_BTQ = wire.rollouts_from_requests(requests)
    scores: TokenScores = scorer.score(
        rollouts, top_k=top_k, requested_ids=requested_BTQ, temperature=temperature, with_entropy=with_entropy
    )
    merged = wire.response_from_scores(scores, rollouts.response_mask)
    return wire.split_response(merged, [q.num_positions for q in requests])


def hidden_requests(scorer: Any, requests: list[wire.ScoreRequest]) -> list[torch.Tensor]:
    """The final hidden states [N, E] of each request's scored positions (one forward for the batch, as
    `score_requests`), on the CPU in the model's dtype."""
    rollouts, _ = wire.rollouts_from_requests(requests)
    hidden_BTE = scorer.hidden_states(rollouts)
    merged = hidden_BTE[rollouts.response_mask.bool()].cpu()
    return list(merged.split([q.num_positions for q in requests]))


def answer_jobs(scorer: Any, jobs: list[Job]) -> list[Any]:
    """Jobs of one kind (the queue never merges scores with hidden states): their scores, or their hidden states."""
    requests = [job.request for job in jobs]
    return score_requests(scorer, requests) if jobs[0].answer == "scores" else hidden_requests(scorer, requests)


# ------------------------------------------------------------------------------------------------ the service


class RequestError(ValueError):
    """A request the server refuses: HTTP `status` and a one-line message naming the field, limit and value."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


class TeacherService:
    """The model side of the server: limits, the queue, the one scoring thread, counters and /info.

    scorer:  a `TeacherScorer` (the `LocalScorer` of the served model); only the worker thread calls it
    info:    what /info reports (model, vocab_size, vocab_rows, hashes, dtype, device); limits are added here
    vocab:   the token→id map /vocab serves
    """

    def __init__(
        self, scorer: Any, info: dict, vocab: dict[str, int], config: ServeLimits, *, context: int | None = None
    ):
        self.scorer, self.vocab, self.config = scorer, vocab, config
        self.vocab_size = int(info["vocab_size"])
        # rows beyond the model's context would be scored silently wrong (and hold the scoring thread): not by default
        self.max_positions = config.max_positions or context or 65536
        self.instance = secrets.token_hex(8)
        self.fingerprint = str(info.get("model_fingerprint", ""))
        self.info = {
            **info,
            "wire_version": wire.VERSION,
            "instance": self.instance,
            **{
                k: getattr(config, k)
                for k in (
                    "max_batch_tokens",
                    "forward_tokens",
                    "max_request_bytes",
                    "max_rows",
                    "max_requested_ids",
                    "max_top_k",
                    "max_queue_tokens",
                    "batch_window_ms",
                    "max_inflight_bytes",
                    "max_connections",
                    "request_timeout_s",
                )
            },
            "max_positions": self.max_positions,
        }
        self.inflight_bytes = 0  # request bytes held now (reserved before they are read)
        self.max_inflight_seen = 0
        self.queue = ScoringQueue(
            max_batch_tokens=config.max_batch_tokens,
            window_s=config.batch_window_ms / 1000,
            max_queue_tokens=config.max_queue_tokens,
        )
        self._lock = threading.Lock()
        self.counters = dict(
            requests=0,
            batches=0,
            merged_requests=0,
            max_requests_per_batch=0,
            tokens=0,
            positions=0,
            rejected_busy=0,
            rejected_invalid=0,
            disconnected=0,
            errors=0,
        )
        self._worker: threading.Thread | None = None
        self._head_message: bytes | None = None  # /head's answer, encoded on first ask

    def head_message(self) -> bytes:
        """The /head answer: the served model's output head over its vocabulary range, in its dtype, with what a
        client checks it against (vocab_size, vocab_hash, dtype, head_hash); encoded once, then kept."""
        if self._head_message is None:
            source = self.scorer
            if not hasattr(source, "output_head"):
                raise NotImplementedError("this server's scorer has no output head to serve")
            head = source.output_head()
            dtype = str(head.weight.dtype).replace("torch.", "")
            if dtype not in wire.HIDDEN_DTYPES:
                raise NotImplementedError(f"a head of dtype {dtype} cannot be sent")
            meta = {
                "vocab_size": self.vocab_size,
                "vocab_hash": self.info.get("vocab_hash"),
                "dtype": self.info.get("dtype"),
                "logit_scale": head.logit_scale,
                "softcap": head.softcap,
                "head_hash": head_fingerprint(head),
            }
            self._head_message = wire.encode_head(head.weight, head.bias, meta, dtype)
        return self._head_message

    def count(self, **increments: int) -> None:
        with self._lock:
            for key, value in increments.items():
                self.counters[key] += value

    def metrics(self) -> dict:
        with self._lock:
            return {
                **self.counters,
                "queue_requests": len(self.queue),
                "queue_tokens": self.queue.queued_tokens,
                "inflight_bytes": self.inflight_bytes,
                "max_inflight_bytes_seen": self.max_inflight_seen,
            }

    def reserve(self, nbytes: int) -> bool:
        """Count `nbytes` more request bytes as held, unless that would pass `max_inflight_bytes` (False)."""
        with self._lock:
            if self.inflight_bytes + nbytes > self.config.max_inflight_bytes:
                return False
            self.inflight_bytes += nbytes
            self.max_inflight_seen = max(self.max_inflight_seen, self.inflight_bytes)
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.inflight_bytes -= nbytes

    # -- requests

    def parse(self, body: bytes | bytearray) -> wire.ScoreRequest:
        """Decode and check a request body against the limits and the vocabulary (`RequestError` otherwise)."""
        try:
            request = wire.decode_request(body)
        except wire.WireError as error:
            raise RequestError(str(error)) from None
        cfg, V = self.config, self.vocab_size
        if request.num_rows > cfg.max_rows:
            raise RequestError(
                f"rows: {request.num_rows} rows exceed the server's limit of {cfg.max_rows} per request (max_rows)"
            )
        if request.num_rows and int(request.row_lengths.max()) > self.max_positions:
            b = int(request.row_lengths.argmax())
            raise RequestError(
                f"row_lengths: row {b} has {int(request.row_lengths[b])} tokens, more than the "
                f"server's limit of {self.max_positions} positions per row "
                f"({'max_positions' if cfg.max_positions else 'max_positions: the model context'})"
            )
        for limit, name in sorted(
            ((cfg.max_batch_tokens, "max_batch_tokens"), (cfg.max_queue_tokens, "max_queue_tokens"))
        ):
            if request.num_tokens > limit:  # it could never be scored: 413 even when the queue is empty
                raise RequestError(
                    f"tokens: a request of {request.num_tokens} tokens exceeds the server's limit of {limit} ({name}); "
                    f"send smaller requests",
                    status=413,
                )
        Q = 0 if request.requested_ids is None else request.requested_ids.shape[1]
        if Q > cfg.max_requested_ids:
            raise RequestError(
                f"requested_ids: {Q} ids per position exceed the server's limit of "
                f"{cfg.max_requested_ids} (max_requested_ids)"
            )
        if request.top_k > min(cfg.max_top_k, V):
            raise RequestError(
                f"top_k: {request.top_k} exceeds the server's limit of {min(cfg.max_top_k, V)} "
                f"(max_top_k, and the vocabulary size {V})"
            )
        _check_ids("tokens", request.tokens, V, request.row_lengths)
        if request.requested_ids is not None:
            _check_ids("requested_ids", request.requested_ids, V)
        return request

    def submit(self, request: wire.ScoreRequest, answer: str = "scores") -> Job:
        job = Job(request, tokens=max(1, request.num_tokens), answer=answer)
        try:
            self.queue.put(job)
        except QueueFull:
            self.count(rejected_busy=1)
            raise
        return job

    # -- the scoring loop

    def start(self) -> None:
        self._worker = threading.Thread(target=self._work, name="opd-teacher-scoring", daemon=True)
        self._worker.start()

    def stop(self, timeout: float = 10.0) -> None:
        self.queue.close()
        if self._worker is not None:
            self._worker.join(timeout)

    def _work(self) -> None:
        while (batch := self.queue.take()) is not None:
            batch = [job for job in batch if job.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            try:
                responses = answer_jobs(self.scorer, batch)
            except Exception as error:  # e.g. out of memory
                if len(batch) == 1:
                    self._fail(batch[0], error)
                    continue
                # one request's failure must stay with it: score each request of the merged batch alone
                responses = []
                for job in list(batch):
                    try:
                        responses.append(answer_jobs(self.scorer, [job])[0])
                    except Exception as alone:
                        self._fail(job, alone)
                        batch.remove(job)
                if not batch:
                    continue
            with self._lock:
                c = self.counters
                c["requests"] += len(batch)
                c["batches"] += 1
                c["merged_requests"] += len(batch) if len(batch) > 1 else 0
                c["max_requests_per_batch"] = max(c["max_requests_per_batch"], len(batch))
                c["tokens"] += sum(job.request.num_tokens for job in batch)
                c["positions"] += sum(job.request.num_positions for job in batch)
            for job, response in zip(batch, responses):
                job.future.set_result(response)

    def _fail(self, job: Job, error: Exception) -> None:
        """Fail one request (its client gets a 500 naming the error); one log line, the traceback with OPD_DEBUG=1."""
        text = str(error).splitlines()[0][:300] if str(error) else ""
        log.error("scoring a request of %d tokens failed: %s: %s", job.request.num_tokens, type(error).__name__, text)
        if os.environ.get("OPD_DEBUG"):
            log.error("traceback", exc_info=error)
        self.count(errors=1)
        job.future.set_exception(error)


def _check_ids(name: str, ids: torch.Tensor, vocab_size: int, row_lengths: torch.Tensor | None = None) -> None:
    """RequestError naming the first id outside [0, vocab_size): by row and token for the concatenated tokens [S]
    (`row_lengths` given), by scored position and slot for requested ids [N, Q]."""
    bad = (ids < 0) | (ids >= vocab_size)
    if not bool(bad.any()):
        return
    index = tuple(int(i) for i in bad.nonzero()[0])
    if row_lengths is not None:
        ends = torch.cumsum(row_lengths, 0)
        row = int(torch.searchsorted(ends, torch.tensor(index[0]), right=True))
        where = f"row {row}, token {index[0] - (int(ends[row - 1]) if row else 0)}"
    else:
        where = f"scored position {index[0]}, slot {index[1]}"
    raise RequestError(f"{name}: id {int(ids[index])} at {where} is outside the vocabulary [0, {vocab_size})")


# ------------------------------------------------------------------------------------------------ the web app


def build_app(service: TeacherService, token: str | None):
    """The Starlette app of `service`, behind bearer-token auth when `token` is set (all paths but /healthz)."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"status": "ok"})

    async def info(request: Request) -> JSONResponse:
        return JSONResponse(service.info)

    async def vocab(request: Request) -> JSONResponse:
        return JSONResponse(service.vocab)

    async def metrics(request: Request) -> JSONResponse:
        return JSONResponse(service.metrics())

    async def head(request: Request) -> Response:
        import anyio

        try:
            data = await anyio.to_thread.run_sync(service.head_message)
        except NotImplementedError as failure:
            return _error(404, f"head: {failure}")
        return Response(data, media_type="application/octet-stream")

    async def score(request: Request) -> Response:
        limit = service.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > limit):
            service.count(rejected_invalid=1)
            return _error(
                413,
                f"body: request of {declared[:20]} bytes exceeds the server's limit of {limit} bytes "
                f"(max_request_bytes)",
                Connection="close",
            )
        return await _receive(service, request, int(declared) if declared is not None else None)

    app = Starlette(
        routes=[
            Route("/healthz", healthz),
            Route("/info", info),
            Route("/vocab", vocab),
            Route("/metrics", metrics),
            Route("/score", score, methods=["POST"]),
            Route("/hidden", score, methods=["POST"]),
            Route("/head", head),
        ],
        lifespan=_lifespan(service),
    )
    return Identified(BearerAuth(app, token) if token is not None else app, service)


async def _receive(service: TeacherService, request, declared: int | None):
    """Read the body of a /score request within request_timeout_s, holding its bytes against max_inflight_bytes
    until answered; `declared`: its content-length, or None when chunked."""
    import anyio
    from starlette.requests import ClientDisconnect
    from starlette.responses import Response

    limit, held = service.config.max_request_bytes, 0

    def hold(nbytes: int) -> bool:
        nonlocal held
        if not service.reserve(nbytes):
            return False
        held += nbytes
        return True

    busy = _error(
        503,
        f"busy: more than {service.config.max_inflight_bytes} request bytes are held (max_inflight_bytes); retry",
        **{"Retry-After": "1", "Connection": "close"},
    )
    try:
        if declared is not None and not hold(declared):
            service.count(rejected_busy=1)
            return busy
        body = bytearray()
        try:
            with anyio.fail_after(service.config.request_timeout_s):
                async for chunk in request.stream():
                    if declared is None and not hold(len(chunk)):  # chunked: held as it arrives
                        service.count(rejected_busy=1)
                        return busy
                    body += chunk
                    if len(body) > limit:
                        service.count(rejected_invalid=1)
                        return _error(
                            413,
                            f"body: request exceeds the server's limit of {limit} bytes (max_request_bytes)",
                            Connection="close",
                        )
        except TimeoutError:
            service.count(rejected_invalid=1)
            return _error(
                408,
                f"body: not received within {service.config.request_timeout_s:g} s (request_timeout_s)",
                Connection="close",
            )
        except ClientDisconnect:
            service.count(disconnected=1)
            return Response(status_code=400)
        return await _answer(service, request, body)  # not copied: the held bytes are what is counted
    finally:
        service.release(held)


def _error(status: int, message: str, **headers: str):
    """A JSON error response: {"error": message}."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": message}, status_code=status, headers=headers or None)


async def _answer(service: TeacherService, request, body: bytes | bytearray):
    """Parse, queue and score one received /score body; the client's leaving cancels its job."""
    import anyio
    from starlette.responses import Response

    try:
        parsed = await anyio.to_thread.run_sync(service.parse, body)
    except RequestError as failure:
        service.count(rejected_invalid=1)
        return _error(failure.status, str(failure))
    if isinstance(body, bytearray):  # the parsed arrays are copies: the wire bytes are not kept while it waits
        body.clear()
    answer = "scores"
    if request.url.path == "/hidden":  # the same request; the answer is the hidden states, in the asked wire dtype
        answer = request.query_params.get("dtype", "bfloat16")
        if answer not in wire.HIDDEN_DTYPES:
            service.count(rejected_invalid=1)
            return _error(400, f"dtype: must be one of {', '.join(wire.HIDDEN_DTYPES)}, got {answer[:20]!r}")
        if parsed.top_k or parsed.requested_ids is not None:
            service.count(rejected_invalid=1)
            return _error(400, "/hidden: send top_k=0 and no requested_ids (the answer is the hidden states)")
    try:
        job = service.submit(parsed, answer)
    except QueueFull:
        return _error(
            503,
            f"busy: more than {service.config.max_queue_tokens} tokens are waiting (max_queue_tokens); retry",
            **{"Retry-After": "1"},
        )
    result = asyncio.wrap_future(job.future)
    gone = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    if result not in done:  # the client left: a queued job is skipped, a running one's result dropped
        job.future.cancel()
        result.cancel()
        service.count(disconnected=1)
        return Response(status_code=400)
    gone.cancel()
    try:
        response = result.result()
    except Exception as failure:
        text = (str(failure).splitlines() or [""])[0][:300]
        return _error(500, f"scoring failed: {type(failure).__name__}: {text}")
    if answer != "scores":
        data = await anyio.to_thread.run_sync(wire.encode_hidden, response, answer)
    else:
        data = await anyio.to_thread.run_sync(wire.encode_response, response, parsed.logprobs)
    return Response(data, media_type="application/octet-stream")


class Identified:
    """ASGI middleware: every response names this server process (a nonce drawn at start) and the weights it serves,
    so that a client notices a server swapped behind the same address (also after a silent keep-alive reconnect)."""

    def __init__(self, app, service: TeacherService):
        self.app = app
        self._headers = [
            (INSTANCE_HEADER.encode(), service.instance.encode()),
            (FINGERPRINT_HEADER.encode(), service.fingerprint.encode()),
        ]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_identified(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self._headers]}
            await send(message)

        await self.app(scope, receive, send_identified)


async def _disconnected(request) -> None:
    """Returns when the client disconnects (the body has been read: the next ASGI message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _lifespan(service: TeacherService):
    @asynccontextmanager
    async def lifespan(app):
        service.start()
        try:
            yield
        finally:
            service.stop()

    return lifespan


class BearerAuth:
    """ASGI middleware: 401 unless `Authorization: Bearer <token>` (constant-time comparison); /healthz is open."""

    OPEN_PATHS = ("/healthz",)

    def __init__(self, app, token: str):
        self.app = app
        if not all("!" <= c <= "~" for c in token):
            raise ConfigError("token: only printable ASCII characters without spaces can travel in an HTTP header")
        self._expected = token.encode("ascii")

    def _token(self, headers) -> bytes:
        """The credentials of `Authorization: Bearer <token>`; the scheme is case-insensitive (RFC 7235)."""
        for name, value in headers:
            if name == b"authorization":
                scheme, _, credentials = value.strip().partition(b" ")
                if scheme.lower() == b"bearer":
                    return credentials.strip()
        return b""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.OPEN_PATHS:
            if not hmac.compare_digest(self._token(scope["headers"]), self._expected):
                from starlette.responses import JSONResponse

                response = JSONResponse(
                    {
                        "error": "unauthorized: send the server's token as 'Authorization: Bearer "
                        "<token>' (teacher.token_file or $OPD_TEACHER_TOKEN)"
                    },
                    status_code=401,
                    headers={"WWW-Authenticate": "Bearer", **_closing(scope["headers"])},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _closing(headers) -> dict[str, str]:
    """`Connection: close` for a refused request that announces a body: the connection closes after the answer, so
    the body of an unauthenticated peer is never read (kept alive, the server would read and drop all of it first)."""
    for name, value in headers:
        if (name == b"content-length" and value.strip() not in (b"", b"0")) or name == b"transfer-encoding":
            return {"Connection": "close"}
    return {}


# ------------------------------------------------------------------------------------------------ serving


def service_for(
    model: torch.nn.Module,
    tokenizer: Any,
    config: ServeLimits,
    *,
    name: str,
    device: str = "",
    fingerprint: str | None = None,
) -> TeacherService:
    """A `TeacherService` over an already loaded model and its tokenizer (the benchmark serves random weights).
    `fingerprint`: what identifies the weights served (`opd serve-teacher` gives its model directory's, every byte
    of every file: `opd.fingerprints.model_fingerprint`); None: the hash of every byte of the weights in memory
    (`weights_fingerprint`). Every response carries it, so a client notices a server restarted on other weights."""
    rows = embedding_rows(model)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    # a length-dependent RoPE gets one table, for the longest row it accepts; /info says which (the client checks it)
    rope = fix_rope(model, config.max_positions or (context if isinstance(context, int) else None) or 65536)
    vocab = check_tokenizer_compatibility(tokenizer, tokenizer, student_vocab_size=rows, teacher_vocab_size=rows)
    # ids beyond the tokenizer are embedding padding rows: never a top-k candidate (SPEC §1), as in load_teacher
    scorer = LocalScorer(model, vocab_size=vocab.tokenizer_size, max_tokens_per_batch=config.forward_tokens)
    info = {
        "model": name,
        "vocab_size": vocab.tokenizer_size,
        "vocab_rows": rows,
        **wire.tokenizer_fingerprints(tokenizer),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": device or str(next(model.parameters()).device),
        "model_fingerprint": fingerprint or weights_fingerprint(model),
        "rope": None if rope is None else rope.to_info(),
    }
    info["hidden_size"] = int(scorer.output_head().weight.shape[1])  # a /hidden answer's width (E)
    return TeacherService(
        scorer, info, tokenizer.get_vocab(), config, context=context if isinstance(context, int) else None
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on (host, port); port 0 picks a free one (read it back with getsockname)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ConfigError(f"port: cannot bind {host}:{port}: {error.strerror or error}") from None
    sock.listen(2048)
    return sock


def make_server(service: TeacherService, token: str | None):
    """The uvicorn server of `service` (run it with `.run(sockets=[bind(...)])`; `.should_exit = True` stops it)."""
    import uvicorn

    config = uvicorn.Config(
        build_app(service, token),
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_keep_alive=120,
        timeout_graceful_shutdown=5,
        http=guarded_protocol(connection_cap(service.config.max_connections), service.config.request_timeout_s),
    )
    return uvicorn.Server(config)


SPARE_DESCRIPTORS = 32  # kept free beyond the connections: the listening socket's accept, files, threads, pipes


def connection_cap(max_connections: int) -> int:
    """`max_connections`, or fewer where the process's descriptor limit (`ulimit -n`) could not hold them: the cap
    only works while a newcomer can still be accepted (to evict the oldest half-open connection for it); at the limit,
    accept() fails with EMFILE and every new client, /healthz included, waits until an old one leaves. The soft limit
    is first raised toward the hard one as far as the connections need; the cap keeps SPARE_DESCRIPTORS free besides
    the descriptors open now. A lowered cap is logged."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (macOS): a generous guess at what a loaded model keeps open
        open_now = 64
    wanted = open_now + SPARE_DESCRIPTORS + max_connections
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return max_connections
    cap = max(2, soft - open_now - SPARE_DESCRIPTORS)
    log.warning(
        "max_connections %d lowered to %d: the process may open %d descriptors (ulimit -n), %d are open",
        max_connections,
        cap,
        soft,
        open_now,
    )
    return cap


def guarded_protocol(max_connections: int, header_timeout_s: float):
    """uvicorn's h11 protocol with two bounds that hold before authentication: a connection that has not sent a
    request's headers within `header_timeout_s` (from its opening, or from its previous answer) is closed; and
    beyond `max_connections` open ones, the oldest that is idle or still sending headers is closed for the newcomer
    (the newcomer itself when every connection is busy with a request), so half-open clients cannot starve others."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Guarded(H11Protocol):
        waiting: dict = {}  # connection → when it started waiting for request headers (shared by this server)

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._await_headers()
            if len(self.connections) > max_connections:
                idle = [c for c in self.waiting if c is not self and not c.transport.is_closing()]
                victim = min(idle, key=self.waiting.__getitem__) if idle else self
                victim._give_up()

        def _await_headers(self) -> None:
            self._cycle_seen = self.cycle
            self.waiting[self] = time.monotonic()
            self._header_timer = self.loop.call_later(header_timeout_s, self._give_up)

        def _give_up(self) -> None:
            self.waiting.pop(self, None)
            self._header_timer.cancel()
            if not self.transport.is_closing():
                self.transport.close()

        def _check_headers(self) -> None:
            if self.cycle is not self._cycle_seen and self in self.waiting:  # a request's headers are in
                self.waiting.pop(self, None)
                self._header_timer.cancel()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._check_headers()

        def on_response_complete(self) -> None:
            self._header_timer.cancel()
            if not self.transport.is_closing():
                self._await_headers()  # keep-alive: the next request's headers within the timeout too
            super().on_response_complete()  # (may start a pipelined request)
            self._check_headers()

        def connection_lost(self, exc) -> None:
            self.waiting.pop(self, None)
            self._header_timer.cancel()
            super().connection_lost(exc)

    return Guarded


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def run(service: TeacherService, sock: socket.socket, token: str | None, *, banner: str = "") -> None:
    """Serve `service` on the bound socket until SIGINT / SIGTERM."""
    auth = "bearer token required" if token else "no token (loopback only)"
    print(f"opd serve-teacher: {banner or service.info['model']} listening on {url_of(sock)} ({auth})", flush=True)
    make_server(service, token).run(sockets=[sock])
