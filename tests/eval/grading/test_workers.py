"""`opd.eval.grading`'s deadlines, threads and worker processes: pathological input is bounded by the timeout,
timeouts are cached, grading from threads, and the worker pool (started once, killed past the hard deadline,
replaced, queueing callers)."""

import concurrent.futures
import threading
import time

import pytest

from helpers_grading import CASES
from opd.eval import grading
from opd.eval.grading import Grade, grade

# A power tower: sympy tries to evaluate it and never finishes unless interrupted.
PATHOLOGICAL = "2^{2^{2^{2^{10}}}}"


def test_main_thread_timeout_bounds_pathological_input():
    grading._verdicts.clear()
    g = grade(f"\\boxed{{{PATHOLOGICAL}}}", "1", timeout=1.0)
    assert g == Grade(False, PATHOLOGICAL, "timeout")


def test_timeouts_are_cached_per_pair():
    grading._verdicts.clear()
    ran, cached = grading._STATS["symbolic"], grading._STATS["cached"]
    assert grade(f"\\boxed{{{PATHOLOGICAL}}}", "2", timeout=0.5).reason == "timeout"
    assert grading._STATS["symbolic"] == ran + 1
    for _ in range(3):  # the same pair again, same or smaller budget: answered from the cache
        assert grade(f"so $\\boxed{{{PATHOLOGICAL}}}$", "\\boxed{2}", timeout=0.3).reason == "timeout"
    assert grading._STATS["symbolic"] == ran + 1 and grading._STATS["cached"] == cached + 3
    # a larger budget tries again
    assert grade(f"\\boxed{{{PATHOLOGICAL}}}", "2", timeout=0.6).reason == "timeout"
    assert grading._STATS["symbolic"] == ran + 2
    # verdicts are cached too
    assert grade("\\boxed{\\sqrt{8}}", "2\\sqrt2").correct and grade("\\boxed{\\sqrt{8}}", "2\\sqrt2").correct
    assert grading._STATS["symbolic"] == ran + 3


# cases that only the symbolic stage can decide
SYMBOLIC_CASES = [c for c in CASES if grading._compare(c[0], c[1], None) == (False, "string")]


def test_grading_from_threads_matches_and_times_out():
    assert len(SYMBOLIC_CASES) >= 20
    grading._verdicts.clear()  # earlier tests graded these in the main thread: make the workers do it
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        # a generous budget: this checks the verdicts from workers, on a machine of any load
        futures = [ex.submit(grade, f"\\boxed{{{a}}}", gt, timeout=60.0) for a, gt, _ in SYMBOLIC_CASES]
        results = [f.result() for f in futures]
        assert [r.correct for r in results] == [e for _, _, e in SYMBOLIC_CASES]
        assert {r.reason for r in results} <= {"symbolic", "numeric", "string"}
        assert threading.current_thread() is threading.main_thread()
        # the deadline holds in workers too: both concurrent pathological grades are interrupted
        for g in ex.map(lambda _: grade(f"\\boxed{{{PATHOLOGICAL}}}", "1", timeout=3.0), range(2)):
            assert g.reason == "timeout" and not g.correct


def test_worker_pool_starts_its_workers_once():
    starts = grading._STATS["worker_starts"]
    pool = grading._WorkerPool(size=2)
    try:
        assert grading._STATS["worker_starts"] == starts + 1  # started with the pool, before the first call
        end = lambda: time.monotonic() + 60.0  # noqa: E731
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            for k in range(6):  # one caller at a time: the first call starts a spare, then no worker ever starts
                assert ex.submit(pool.compare, f"\\sqrt{{{k * k}}}", str(k), end()).result() == (True, "symbolic", True)
        assert grading._STATS["worker_starts"] == starts + 2 and len(pool.all) == 2
    finally:
        pool.close()


def test_a_deadline_landing_in_a_finalizer_is_not_reported():
    """The alarm can land in a finalizer (`__del__`, a weakref callback), where Python hands the exception to
    `sys.unraisablehook` instead of raising it. `_with_alarm` keeps such a `_Deadline` from the hook (under load in CI
    pytest's hook reported one and was itself broken by the repeating alarm), the deadline still ends the work, and
    any other exception in a finalizer still reaches the hook."""
    import signal
    import sys

    from opd.eval.grading import compare

    class AlarmInDel:
        def __del__(self):
            signal.raise_signal(signal.SIGALRM)  # the alarm lands inside the finalizer

    class ErrorInDel:
        def __del__(self):
            raise ValueError("not a deadline")

    def work():
        AlarmInDel()  # finalized at once (reference count): its _Deadline is unraisable
        ErrorInDel()
        while True:  # until the alarm raises here
            time.sleep(0.001)

    reported, hook = [], sys.unraisablehook
    sys.unraisablehook = reported.append
    try:
        with pytest.raises(compare._Deadline):
            compare._with_alarm(work, 0.2)
        assert sys.unraisablehook == reported.append  # restored
    finally:
        sys.unraisablehook = hook
    assert [type(u.exc_value) for u in reported] == [ValueError]


def test_worker_overrunning_hard_deadline_is_killed():
    worker = grading._Worker()
    try:
        assert worker.compare("1", "1", 5.0, hard_deadline_s=60.0) == (True, "symbolic")
        # the worker's own alarm (60 s) is later than our hard deadline (0.5 s): we must give up
        assert worker.compare(PATHOLOGICAL, "1", 60.0, hard_deadline_s=0.5) is None
    finally:
        worker.kill()
    assert worker.proc.poll() is not None


def test_pool_replaces_a_killed_worker(monkeypatch):
    pool = grading._WorkerPool(size=1)
    try:
        assert pool.all[0].wait_ready(time.monotonic() + 60.0)
        # a negative margin puts the worker's own alarm after our deadline: we kill it at the deadline
        monkeypatch.setattr(grading.workers, "_WORKER_MARGIN_S", -5.0)
        first = pool.all[0]
        assert pool.compare(PATHOLOGICAL, "1", time.monotonic() + 1.0) == (False, "timeout", True)
        assert first.proc.poll() is not None and pool.all[0] is not first
        monkeypatch.setattr(grading.workers, "_WORKER_MARGIN_S", 0.25)
        assert pool.compare("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", time.monotonic() + 60.0) == (True, "symbolic", True)
        assert len(pool.all) == 1 and not pool.broken
    finally:
        pool.close()


def test_pool_queues_callers_and_says_busy_at_the_deadline():
    pool = grading._WorkerPool(size=1)
    try:
        assert pool.all[0].wait_ready(time.monotonic() + 60.0)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            slow = ex.submit(pool.compare, PATHOLOGICAL, "3", time.monotonic() + 2.0)
            while pool.idle:  # until it has taken the only worker
                time.sleep(0.01)
            assert pool.compare("\\sqrt{4}", "2", time.monotonic() + 0.5) == (False, "busy", False)
            assert slow.result()[:2] == (False, "timeout")
        assert pool.compare("\\sqrt{4}", "2", time.monotonic() + 60.0) == (True, "symbolic", True)
    finally:
        pool.close()
