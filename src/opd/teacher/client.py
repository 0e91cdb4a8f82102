"""`RemoteScorer`: the `TeacherScorer` of a teacher behind `opd serve-teacher` (one server or several replicas).

    teacher: {url: http://gpu-host:8765, token_file: ~/.opd-teacher-token}
    teacher: {url: [http://10.0.0.5:8765, http://10.0.0.6:8765]}   # replicas

A `score` call is cut into requests of at most `request_tokens` tokens, sent concurrently to the replica with the
fewest tokens outstanding; connection errors, timeouts and 503 are retried with backoff until `retry_deadline`
(scoring is pure, so a resent request repeats nothing), other 4xx are not (`TeacherRequestError`). `check_tokenizer`
raises the local check's one-line `TokenizerMismatchError`. Retries, outages and the checks: docs/design.md,
"opd.teacher.client". HTTP is the standard library's `http.client` (keep-alive, one connection per worker thread
and replica): the trainer is synchronous, and this adds no dependency to the trainer side.
"""

from __future__ import annotations

import http.client
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from opd.forward import needed_lengths, split_by_token_budget
from opd.models import RopeChoice, check_tokenizer_compatibility
from opd.scoring import OutputHead
from opd.teacher import wire
from opd.teacher.base import PendingScores, head_fingerprint
from opd.teacher.server import FINGERPRINT_HEADER, INSTANCE_HEADER, check_token, resolve_token
from opd.types import Rollouts, TokenScores

BACKOFF_START, BACKOFF_MAX = 0.5, 10.0
_TRANSIENT_STATUS = (502, 503, 504)
# what must not change across a restart, and what replicas of one teacher share (model_fingerprint: its weights)
_IDENTITY = ("model", "model_fingerprint", "vocab_hash", "vocab_size", "vocab_rows", "dtype")


class TeacherRequestError(ValueError):
    """The teacher server refused a request (4xx) or answered something unusable; the message is one line."""


class TeacherUnavailableError(ConnectionError, ValueError):
    """No replica answered within the retry deadline. (Also a ValueError so that the CLI prints it as one line.)"""


class _Transient(Exception):
    def __init__(self, reason: str, retry_after: float | None = None, outage: bool = True):
        super().__init__(reason)
        self.retry_after, self.outage = retry_after, outage


@dataclass
class Replica:
    url: str
    host: str
    port: int
    https: bool
    outstanding: int = 0  # tokens sent and not yet answered
    down_since: float | None = None
    info: dict = field(default_factory=dict)
    fingerprint: str | None = None  # of the weights served, recorded on first contact
    instance: str | None = None  # the server process answering (changes on a restart)


def parse_url(url: str) -> Replica:
    parts = urllib.parse.urlsplit(url)
    if "@" in parts.netloc:  # never echo it: the part before @ may be a password
        raise ValueError(
            "teacher.url: credentials in the URL (user:password@) are not accepted (they would be printed and saved "
            "in config.yaml); give the token in teacher.token_file or $OPD_TEACHER_TOKEN"
        )
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        raise ValueError(f"teacher.url: expected http://host:port (or https://), got {url!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise ValueError(f"teacher.url: bad port in {url!r}") from None
    return Replica(url.rstrip("/"), parts.hostname, port, parts.scheme == "https")


class RemoteScorer:
    """`TeacherScorer` over HTTP (see the module docstring).

    urls:           one URL or replicas of the same teacher
    token:          the server's bearer token, or None
    timeout:        seconds without progress on one request before it counts as failed (and is retried)
    retry_deadline: seconds of failure (per request) after which `TeacherUnavailableError` is raised
    request_tokens: tokens per request; a larger batch becomes several requests, sent concurrently
    logprobs:       "float32" (exact) or "bfloat16" (half the bytes of the log-probs, ~3 significant digits)
    concurrency:    requests in flight at once from this client
    log:            where waiting / recovery messages go (default: stderr)
    """

    serves_requested_ids = True  # the server's `LocalScorer` scores any ids

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        token: str | None = None,
        timeout: float = 300.0,
        retry_deadline: float = 600.0,
        request_tokens: int = 16384,
        logprobs: str = "float32",
        concurrency: int = 8,
        log: Callable[[str], None] | None = None,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("teacher.url: give at least one URL")
        if logprobs not in wire.LOGPROB_DTYPES:
            raise ValueError(f"teacher.logprobs must be one of {', '.join(wire.LOGPROB_DTYPES)}, got {logprobs!r}")
        if request_tokens < 1 or timeout <= 0 or retry_deadline < 0 or concurrency < 1:
            raise ValueError(
                "RemoteScorer: request_tokens and concurrency must be ≥ 1, timeout > 0, retry_deadline ≥ 0"
            )
        if token is not None:
            check_token(token, "RemoteScorer token")
        self.replicas = [parse_url(u) for u in urls]
        self.token, self.timeout, self.retry_deadline = token, timeout, retry_deadline
        self.request_tokens, self.logprobs = request_tokens, logprobs
        self.log = log or (lambda message: print(message, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="opd-teacher-client")
        self.info = self._connect()
        self._head: OutputHead | None = None

    # -- identity

    def _connect(self) -> dict:
        """/info of every replica (waiting for them like any request); they must serve the same teacher."""
        infos = [self._with_retries(r, lambda r: self._get_json(r, "/info")) for r in self.replicas]
        for replica, info in zip(self.replicas, infos):
            replica.info = info
            if info.get("wire_version") != wire.VERSION:
                raise TeacherRequestError(
                    f"teacher server {replica.url} speaks wire version "
                    f"{info.get('wire_version')}, this client version {wire.VERSION}"
                )
            differs = [k for k in _IDENTITY if info.get(k) != infos[0].get(k)]
            if differs:
                raise TeacherRequestError(
                    f"teacher.url: replicas {self.replicas[0].url} and {replica.url} serve "
                    f"different teachers ({differs[0]}: {infos[0].get(differs[0])!r} vs "
                    f"{info.get(differs[0])!r})"
                )
        return infos[0]

    @property
    def vocab_size(self) -> int:
        return int(self.info["vocab_size"])

    def check_rope(self, run_length: int) -> None:
        """The served model's length-dependent RoPE (its /info `rope`: the table `opd.models.fix_rope` fixed for the
        server's `max_positions`) must be the one this run's longest sequence chooses; a one-line ValueError naming
        both otherwise. A server whose RoPE does not depend on the length reports none: nothing to check."""
        served = self.info.get("rope")
        if not served:
            return
        choice = RopeChoice.from_info(served)
        wanted = choice.at(run_length)
        if wanted.setting != choice.setting:
            raise ValueError(
                f"the teacher served at {self.replicas[0].url} fixed its rope_type {choice.rope_type!r} to its "
                f"{choice.setting} (max_positions {choice.length}); this run's sequences (up to {run_length} tokens) "
                f"need its {wanted.setting}: restart opd serve-teacher with max_positions={run_length}"
            )

    def check_tokenizer(self, student_tokenizer: Any, *, student_rows: int | None = None):
        """The `VocabInfo` of the student and this teacher, or the local check's one-line `TokenizerMismatchError`."""
        if wire.tokenizer_fingerprints(student_tokenizer)["vocab_hash"] == self.info["vocab_hash"]:
            teacher_tokenizer = student_tokenizer
        else:  # say what differs, exactly as the local check would
            replica = self.replicas[0]
            teacher_tokenizer = _Vocab(self._with_retries(replica, lambda r: self._get_json(r, "/vocab")))
        vocab = check_tokenizer_compatibility(
            student_tokenizer,
            teacher_tokenizer,
            student_vocab_size=student_rows,
            teacher_vocab_size=int(self.info["vocab_rows"]),
        )
        if wire.tokenizer_fingerprints(student_tokenizer)["chat_template_hash"] != self.info["chat_template_hash"]:
            self.log(
                f"note: the teacher at {self.replicas[0].url} has another chat template than the student "
                f"(scoring uses the student's token ids, so this only matters if you render prompts for it)"
            )
        return vocab

    # -- scoring

    def score(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> TokenScores:
        return self.score_async(
            rollouts, top_k=top_k, requested_ids=requested_ids, temperature=temperature, with_entropy=with_entropy
        ).result()

    def score_async(
        self,
        rollouts: Rollouts,
        *,
        top_k: int = 16,
        requested_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        with_entropy: bool = True,
    ) -> PendingScores:
        """Send the requests now and return at once; `result()` collects them into `TokenScores` on the rollouts'
        device (zeros at masked positions, as `LocalScorer`)."""
        if top_k < 0:
            raise ValueError(f"top_k must be ≥ 0 (0 = no top-k), got {top_k}")
        device = rollouts.response_ids.device
        cpu = rollouts.to("cpu")
        requested_BTQ = None if requested_ids is None else requested_ids.to("cpu")
        mask_BT = cpu.response_mask.bool()
        groups = self._split(cpu, requested_BTQ, top_k)
        futures = []
        for rows in groups:
            request = wire.request_from_rollouts(
                cpu.select(rows),
                None if requested_BTQ is None else requested_BTQ[rows],
                top_k=top_k,
                temperature=temperature,
                with_entropy=with_entropy,
                logprobs=self.logprobs,
            )
            futures.append(self._pool.submit(self._send, wire.encode_request(request), request.num_tokens))

        def finish() -> TokenScores:
            B, T = mask_BT.shape
            Q = None if requested_BTQ is None else requested_BTQ.shape[-1]
            out = TokenScores(
                torch.zeros(B, T),
                torch.zeros(B, T, top_k, dtype=torch.long) if top_k else None,
                torch.zeros(B, T, top_k) if top_k else None,
                torch.zeros(B, T) if with_entropy else None,
                None if Q is None else torch.zeros(B, T, Q),
            )
            for rows, future in zip(groups, futures):
                response = wire.decode_response(future.result())
                b_N, t_N = mask_BT[rows].nonzero(as_tuple=True)
                b_N = rows[b_N]
                if response.sampled.shape[0] != b_N.numel():
                    raise TeacherRequestError(
                        f"teacher server answered {response.sampled.shape[0]} positions for a request of {b_N.numel()}"
                    )
                for name in ("sampled", "topk_ids", "topk_logprobs", "entropy", "requested_logprobs"):
                    grid, values = (
                        getattr(out, "sampled_logprobs" if name == "sampled" else name),
                        getattr(response, name),
                    )
                    if grid is not None:
                        if values is None:
                            raise TeacherRequestError(f"teacher server left out {name} from its answer")
                        grid[b_N, t_N] = values.to(grid.dtype)
            return out.to(device)

        return PendingScores(finish)

    def width_error(self, top_k: int, requested: int) -> str | None:
        """Why requests of `top_k` and `requested` ids per position exceed the server's limits (its /info), or None."""
        info = self.info
        if requested > info["max_requested_ids"]:
            return (
                f"requested_ids: {requested} ids per position exceed the teacher server's limit of "
                f"{info['max_requested_ids']} (its max_requested_ids)"
            )
        if top_k > min(info["max_top_k"], info["vocab_size"]):
            return (
                f"top_k: {top_k} exceeds the teacher server's limit of {min(info['max_top_k'], info['vocab_size'])} "
                f"(its max_top_k, and the vocabulary size)"
            )
        return None

    # -- hidden states (`opd.teacher.base.HiddenStateSource`)

    hidden_dtype = "bfloat16"  # the wire dtype /hidden is asked for (teacher.hidden_dtype)

    @property
    def hidden_size(self) -> int | None:
        """E of the served model's hidden states (/info), or None for a server that does not say."""
        value = self.info.get("hidden_size")
        return int(value) if isinstance(value, int) else None

    def output_head(self) -> OutputHead:
        """The served model's output head, fetched from /head once and checked against /info: its vocabulary size,
        tokenizer hash and dtype must be the server's, its bytes must hash to the head_hash it names; anything else
        is refused here, at startup, in one line (`TeacherRequestError`)."""
        if self._head is None:
            replica = self.replicas[0]
            data = self._with_retries(replica, lambda r: self._request(r, "GET", "/head"))
            try:
                weight, bias, meta = wire.decode_head(data)
            except wire.WireError as error:
                raise TeacherRequestError(f"teacher server {replica.url}/head: {error}") from None
            head = OutputHead(weight, bias, float(meta.get("logit_scale", 1.0)), meta.get("softcap"))
            self._head = check_served_head(head, meta, self.info, replica.url)
        return self._head

    def hidden_states(self, rollouts: Rollouts) -> torch.Tensor:
        """[B, T, E] the served model's final hidden states at the response positions, in the wire dtype
        (`hidden_dtype`), zero at masked positions, on the rollouts' device: the /score request, sent to /hidden."""
        width = self.hidden_size
        if width is None:
            raise TeacherRequestError(f"teacher server {self.replicas[0].url} does not serve hidden states (/info)")
        device = rollouts.response_ids.device
        cpu = rollouts.to("cpu")
        mask_BT = cpu.response_mask.bool()
        groups = self._split(cpu, None, 0)
        futures = []
        for rows in groups:
            request = wire.request_from_rollouts(cpu.select(rows), None, top_k=0, with_entropy=False)
            body, tokens = wire.encode_request(request), request.num_tokens
            path = f"/hidden?dtype={self.hidden_dtype}"
            futures.append(self._pool.submit(self._post, path, body, tokens))
        B, T = mask_BT.shape
        dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[self.hidden_dtype]
        out = torch.zeros(B, T, width, dtype=dtype)
        for rows, future in zip(groups, futures):
            b_N, t_N = mask_BT[rows].nonzero(as_tuple=True)
            try:
                hidden_NE = wire.decode_hidden(future.result(), int(b_N.numel()), width)
            except wire.WireError as error:
                raise TeacherRequestError(f"teacher server /hidden answer refused: {error}") from None
            out[rows[b_N], t_N] = hidden_NE.to(dtype)
        return out.to(device)

    def _split(self, rollouts: Rollouts, requested_BTQ: torch.Tensor | None, top_k: int) -> list[torch.Tensor]:
        """Row groups, one request each: ≤ request_tokens tokens (a longer row goes alone), within the server's
        row, byte and per-row limits; rows with nothing to score are left out."""
        info = self.info
        Q = 0 if requested_BTQ is None else requested_BTQ.shape[-1]
        too_wide = self.width_error(top_k, Q)
        if too_wide is not None:
            raise TeacherRequestError(too_wide)
        lengths_B = needed_lengths(rollouts) + 1  # + the target token of the last position
        lengths_B = torch.where(rollouts.response_mask.any(1), lengths_B, 0)
        if lengths_B.numel() and int(lengths_B.max()) > info["max_positions"]:
            b = int(lengths_B.argmax())
            raise TeacherRequestError(
                f"row {b} has {int(lengths_B[b])} tokens, more than the teacher server's limit "
                f"of {info['max_positions']} per row (its max_positions)"
            )
        bytes_per_token = 5 + 4 * Q  # token + mask + requested ids, an upper bound per sent token
        budget = min(self.request_tokens, max(1, (info["max_request_bytes"] - 4096) // bytes_per_token))
        groups = []
        for group in split_by_token_budget(lengths_B, budget, padded=False):
            groups.extend(group.split(int(info["max_rows"])))
        return groups

    # -- HTTP with retries

    def _post(self, path: str, body: bytes, tokens: int) -> bytes:
        return self._with_retries(None, lambda replica: self._request(replica, "POST", path, body), tokens=tokens)

    def _send(self, body: bytes, tokens: int) -> bytes:
        return self._with_retries(None, lambda replica: self._request(replica, "POST", "/score", body), tokens=tokens)

    def _acquire(self, tokens: int) -> Replica:
        """The replica with the fewest tokens in flight, preferring those up (a down one is tried again after
        `BACKOFF_MAX` seconds, or when all are down)."""
        now = time.monotonic()
        with self._lock:
            replica = min(
                self.replicas,
                key=lambda r: (r.down_since is not None and now - r.down_since < BACKOFF_MAX, r.outstanding),
            )
            replica.outstanding += tokens
            return replica

    def _with_retries(self, replica: Replica | None, call: Callable[[Replica], Any], tokens: int = 0) -> Any:
        """`call(replica)` until it succeeds or `retry_deadline` seconds have passed since its first failure.
        replica None: each attempt goes to `_acquire`'s choice (requests move to replicas that are up)."""
        started, delay = None, BACKOFF_START
        while True:
            target = replica or self._acquire(tokens)
            try:
                if target.down_since is not None and target.info:
                    self._check_identity(target)  # after an outage: the same teacher must be back
                result = call(target)
            except _Transient as failure:
                now = time.monotonic()
                started = now if started is None else started
                if failure.outage:
                    self._mark_down(target, str(failure))
                if now - started >= self.retry_deadline:
                    raise TeacherUnavailableError(
                        f"teacher server {target.url} did not answer for {now - started:.0f} s ({failure}); start "
                        f"it (opd serve-teacher) or raise teacher.retry_deadline"
                    ) from None
                time.sleep(min(max(delay, failure.retry_after or 0.0), self.retry_deadline - (now - started)))
                delay = min(2 * delay, BACKOFF_MAX)
                continue
            finally:
                if replica is None:
                    with self._lock:
                        target.outstanding -= tokens
            if target.down_since is not None:
                self._mark_up(target)
            return result

    def _mark_down(self, replica: Replica, reason: str) -> None:
        with self._lock:
            if replica.down_since is not None:
                replica.down_since = time.monotonic()  # still down: back to the end of its probe interval
                return
            replica.down_since = time.monotonic()
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + self.retry_deadline))
        self.log(
            f"teacher server {replica.url} not answering ({reason}); waiting and retrying until {until} "
            f"(teacher.retry_deadline={self.retry_deadline:g} s)"
        )

    def _mark_up(self, replica: Replica) -> None:
        with self._lock:
            if replica.down_since is None:
                return
            replica.down_since = None
        self.log(f"teacher server {replica.url} answering again")

    def _check_identity(self, replica: Replica) -> None:
        info = self._get_json(replica, "/info")
        differs = [k for k in _IDENTITY if info.get(k) != replica.info.get(k)]
        if differs:
            raise TeacherRequestError(
                f"teacher server {replica.url} came back serving another teacher "
                f"({differs[0]}: {replica.info.get(differs[0])!r} → {info.get(differs[0])!r}); "
                f"restart it with the same model"
            )

    def _check_instance(self, replica: Replica, response: http.client.HTTPResponse) -> None:
        """Every response names the server process and the weights it serves: recorded on first contact; a server
        restarted with the same weights is followed, one serving other weights stops the run (one line)."""
        fingerprint = response.getheader(FINGERPRINT_HEADER)
        instance = response.getheader(INSTANCE_HEADER)
        with self._lock:
            if replica.fingerprint is None and replica.instance is None:
                replica.fingerprint, replica.instance = fingerprint, instance
                return
            if fingerprint == replica.fingerprint:
                replica.instance = instance
                return
            before = replica.fingerprint
        raise TeacherRequestError(
            f"teacher server {replica.url} now serves other weights (model fingerprint {before} → {fingerprint}): it "
            f"was replaced while in use; restart it with the teacher this run started with"
        )

    def _connection(self, replica: Replica) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's keep-alive connection to `replica`, and whether it was used before."""
        pool = self._local.__dict__.setdefault("connections", {})
        if replica.url in pool:
            return pool[replica.url], True
        cls = http.client.HTTPSConnection if replica.https else http.client.HTTPConnection
        pool[replica.url] = cls(replica.host, replica.port, timeout=self.timeout)
        return pool[replica.url], False

    def _request(self, replica: Replica, method: str, path: str, body: bytes | None = None) -> bytes:
        headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        for attempt in range(2):
            conn, reused = self._connection(replica)
            try:
                conn.request(method, path, body=body, headers=headers)
                response = conn.getresponse()
                data = response.read()
                self._check_instance(replica, response)
                break
            except (OSError, http.client.HTTPException) as error:
                conn.close()
                self._local.connections.pop(replica.url, None)
                stale = reused and isinstance(
                    error, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)
                )
                if stale and attempt == 0:  # the server closed an idle keep-alive connection: just reconnect
                    continue
                raise _Transient(_describe(error)) from None
        if response.status == 200:
            return data
        message = _error_text(data)
        if response.status in _TRANSIENT_STATUS:
            retry_after = response.getheader("Retry-After")
            raise _Transient(
                f"HTTP {response.status}: {message}",
                retry_after=float(retry_after) if retry_after and retry_after.isdigit() else None,
                outage=response.status != 503,
            )
        raise TeacherRequestError(
            f"teacher server {replica.url} refused {method} {path} ({response.status}): {message}"
        )

    def _get_json(self, replica: Replica, path: str) -> Any:
        data = self._request(replica, "GET", path)
        try:
            return json.loads(data)
        except json.JSONDecodeError:
            raise TeacherRequestError(
                f"teacher server {replica.url}{path} did not answer JSON; is it an `opd serve-teacher`?"
            ) from None

    def close(self) -> None:
        """Stop the request threads (idempotent); requests not yet sent are dropped."""
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclass
class _Vocab:
    """The teacher's token→id map as `check_tokenizer_compatibility` reads a tokenizer."""

    vocab: dict[str, int]

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def _describe(error: BaseException) -> str:
    if isinstance(error, ConnectionRefusedError):
        return "connection refused"
    if isinstance(error, TimeoutError):
        return "timed out"
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__


def _error_text(data: bytes) -> str:
    try:
        return str(json.loads(data)["error"])
    except (ValueError, KeyError, TypeError):
        return data[:200].decode("utf-8", "replace") or "(no message)"


def check_served_head(head: OutputHead, meta: dict, info: dict, url: str) -> OutputHead:
    """`head` if it is the served teacher's (/info): its rows the vocabulary size, its tokenizer hash and dtype the
    server's, its bytes hashing to the head_hash sent with it; else `TeacherRequestError` in one line."""
    dtype = str(head.weight.dtype).replace("torch.", "")
    problems = [
        (
            head.weight.shape[0] != info.get("vocab_size"),
            f"{head.weight.shape[0]} rows",
            f"vocab_size {info.get('vocab_size')}",
        ),
        (
            meta.get("vocab_hash") != info.get("vocab_hash"),
            f"vocab_hash {meta.get('vocab_hash')}",
            f"{info.get('vocab_hash')}",
        ),
        (
            dtype != info.get("dtype") or meta.get("dtype") != info.get("dtype"),
            f"dtype {dtype}",
            f"{info.get('dtype')}",
        ),
        (
            head.weight.shape[1] != info.get("hidden_size"),
            f"hidden size {head.weight.shape[1]}",
            f"{info.get('hidden_size')}",
        ),
        (
            head_fingerprint(head) != meta.get("head_hash"),
            f"bytes hashing to {head_fingerprint(head)}",
            f"{meta.get('head_hash')}",
        ),
    ]
    for bad, got, expected in problems:
        if bad:
            raise TeacherRequestError(
                f"teacher server {url}/head: a head of {got} does not match the served teacher's {expected} (/info); "
                f"refusing hidden states projected with it"
            )
    return head


def remote_scorer(spec: Any) -> RemoteScorer:
    """A `RemoteScorer` for a teacher config (`opd.config.TeacherSpec` with `url` set)."""
    scorer = _remote_scorer(spec)
    scorer.hidden_dtype = getattr(spec, "hidden_dtype", "bfloat16")
    return scorer


def _remote_scorer(spec: Any) -> RemoteScorer:
    return RemoteScorer(
        spec.url,
        token=resolve_token(spec.token_file, spec.token_env),
        timeout=spec.timeout,
        retry_deadline=spec.retry_deadline,
        request_tokens=spec.request_tokens,
        logprobs=spec.logprobs,
    )
