"""Grading worker subprocesses: the symbolic stage for callers outside the main thread, where SIGALRM cannot run.

A worker is a fresh `python -c` interpreter that imports `opd.eval.grading` from the parent's own files (whatever
its `sys.path`) and speaks JSON lines over pipes: `[pred, gold, timeout]` → `[correct, reason]`. It applies the
main thread's alarm, ending `_WORKER_MARGIN_S` before our deadline; one that has not answered at the deadline (a
C-level loop) is killed and replaced at once. The pool starts its first worker when it is made; callers queue first
come first served, and one that gets no worker in time answers "busy", which is not cached (that was the load,
not the pair).

Omitted: non-POSIX systems (the pool relies on `select` over pipes).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from collections import Counter, deque

import opd

_log = logging.getLogger(__name__)

_WORKER_MARGIN_S = 0.25  # the worker's own alarm ends this long before our deadline, so it can still answer
# of all grading: "symbolic": comparisons run, "cached": cache hits, "timeout", "worker_starts"
_STATS: Counter[str] = Counter()

# The `opd` package is loaded from the parent's `opd/__init__.py` (argv[1]), so the worker grades with the
# parent's code even where its `sys.path` finds none or another copy; its subpackages follow from that file's folder.
_WORKER_BOOT = (
    "import importlib.util, sys\n"
    "spec = importlib.util.spec_from_file_location('opd', sys.argv[1])\n"
    "opd = sys.modules['opd'] = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(opd)\n"
    "from opd.eval.grading.compare import _worker_main\n"
    "_worker_main()\n"
)


class _WorkerError(Exception):
    pass


class _Worker:
    """One grading subprocess speaking JSON lines: `[pred, gold, timeout]` → `[correct, reason]`."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT, os.path.abspath(opd.__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        _STATS["worker_starts"] += 1
        self.ready = False
        self._buf = b""

    def _readline(self, deadline: float) -> bytes | None:
        """Next line from the worker, None at the deadline; raises `_WorkerError` if it died."""
        assert self.proc.stdout is not None  # Popen(stdout=PIPE)
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                raise _WorkerError("worker exited")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait_ready(self, deadline: float) -> bool:
        """Whether the worker has finished starting by `deadline` (raises `_WorkerError` if it cannot start)."""
        if not self.ready:
            line = self._readline(deadline)
            if line is None:
                return False
            if line != b"ready":
                raise _WorkerError("worker did not start")
            self.ready = True
        return True

    def compare(self, pred: str, gold: str, timeout: float, hard_deadline_s: float) -> tuple[bool, str] | None:
        """Verdict, or None if the worker overran `hard_deadline_s` (it must then be killed)."""
        if not self.wait_ready(time.monotonic() + hard_deadline_s):
            return None
        data = memoryview(json.dumps([pred, gold, timeout]).encode() + b"\n")
        assert self.proc.stdin is not None  # Popen(stdin=PIPE)
        try:
            while data:
                data = data[os.write(self.proc.stdin.fileno(), data) :]
        except OSError as e:
            raise _WorkerError("worker exited") from e
        line = self._readline(time.monotonic() + hard_deadline_s)
        if line is None:
            return None
        correct, reason = json.loads(line)
        return bool(correct), str(reason)

    def kill(self) -> None:
        try:
            self.proc.kill()
            self.proc.wait(timeout=10)
        except Exception:
            pass


class _WorkerPool:
    """Up to `size` workers, each used by one thread at a time; an overrunning worker is replaced at once.

    The first worker starts when the pool is made; taking the last idle one starts a spare (up to `size`), so a
    second concurrent caller rarely waits for a start-up."""

    def __init__(self, size: int) -> None:
        self.size, self.idle = size, []
        self.all: list[_Worker] = []
        self.waiting: deque[list[_Worker]] = deque()  # one slot per waiting caller, in arrival order
        self.cv = threading.Condition()
        self.pid = os.getpid()
        self.broken = False  # workers cannot start here at all: stop trying
        self.ever_ready = False
        try:
            self.idle.append(self._spawn())
        except OSError as e:
            self.broken = True
            _log.warning("opd grading worker failed to start (%s): symbolic comparison skipped", e)

    def compare(self, pred: str, gold: str, end: float) -> tuple[bool, str, bool]:
        """(correct, reason, cacheable) by the deadline `end` (monotonic seconds)."""
        if self.broken:
            return False, "unavailable", False
        worker = self._acquire(end)
        if worker is None:
            return False, "busy", False
        healthy = True
        try:
            if not worker.wait_ready(end - _WORKER_MARGIN_S):
                return False, "busy", False  # still starting: it stays in the pool for the next call
            self.ever_ready = True
            left = end - time.monotonic()
            if left <= _WORKER_MARGIN_S:
                return False, "timeout", False
            result = worker.compare(pred, gold, left - _WORKER_MARGIN_S, left)
            healthy = result is not None
            return (*result, True) if result is not None else (False, "timeout", True)
        except (_WorkerError, OSError, ValueError) as e:
            healthy = False
            if not self.ever_ready and not worker.ready:
                self.broken = True
            _log.warning("opd grading worker failed (%s): symbolic comparison skipped", e)
            return False, "unavailable", False
        finally:
            self._release(worker, healthy)

    def _acquire(self, end: float) -> _Worker | None:
        """An idle worker, a new one while fewer than `size` exist, else the next one released, first come
        first served (a thread that releases one cannot take it straight back); None at the deadline."""
        with self.cv:
            if self.idle and not self.waiting:
                worker = self.idle.pop()
                if not self.idle and len(self.all) < self.size:
                    try:  # a spare starts warming now, for the next concurrent caller
                        self.idle.append(self._spawn())
                    except OSError:
                        pass
                return worker
            if not self.idle and len(self.all) < self.size:
                try:
                    return self._spawn()
                except OSError as e:
                    _log.warning("opd grading worker failed to start (%s): symbolic comparison skipped", e)
                    return None
            slot: list[_Worker] = []
            self.waiting.append(slot)
            while not slot:
                left = end - time.monotonic()
                if left <= 0:
                    self.waiting.remove(slot)
                    return None
                self.cv.wait(timeout=left)
            return slot[0]

    def _spawn(self) -> _Worker:
        """A new worker, counted in `all` (callers hold `cv`, or are the constructor)."""
        w = _Worker()
        self.all.append(w)
        return w

    def _release(self, worker: _Worker, healthy: bool) -> None:
        if not healthy:
            worker.kill()
        with self.cv:
            free: _Worker | None = worker
            if not healthy:
                if worker in self.all:
                    self.all.remove(worker)
                free = None
                if not self.broken:
                    try:
                        free = self._spawn()  # start warming up now, not on the next call
                    except OSError:
                        pass
            if free is not None and self.waiting:
                self.waiting.popleft().append(free)
                self.cv.notify_all()
            elif free is not None:
                self.idle.append(free)

    def close(self) -> None:
        if os.getpid() != self.pid:  # a forked child inherits this atexit hook: the workers are not its own
            return
        with self.cv:
            workers, self.all, self.idle = self.all, [], []
        for w in workers:
            w.kill()


_pool_lock = threading.Lock()
_pool_state: dict[int, _WorkerPool] = {}  # by pid: a forked child must not share its parent's workers


def _pool() -> _WorkerPool:
    pid = os.getpid()
    with _pool_lock:
        pool = _pool_state.get(pid)
        if pool is None:
            _pool_state.clear()
            pool = _pool_state[pid] = _WorkerPool(size=max(2, min(8, os.cpu_count() or 2)))
            atexit.register(pool.close)
        return pool
