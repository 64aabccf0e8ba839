"""The scheduler when a batch fails, and its running count, on a tiny random target.

Failures are injected into `DecodeSession` for sessions holding a marked job, told apart by its
token budget (`BAD`, which no other job here uses).
"""

from __future__ import annotations

import threading
import time

import pytest

import jetspec_jax
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.serving.scheduler import Failed, Finished, Job, Scheduler, Tokens

BAD = 13  # the budget of the job whose sessions fail
GENERIC = "serving the request failed (see the server log)"
SECRET = (
    "RESOURCE_EXHAUSTED: out of memory allocating 99.9G"  # internal: the log's, not the client's
)


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


def _record_starts(monkeypatch) -> list[list[int]]:
    """The budgets of every session started (one list per batch decoded), failed starts
    included (patch after `_fail_sessions_with_bad`)."""
    started = []
    start = DecodeSession.start

    def recording(self):
        started.append(self.max_new_tokens)
        start(self)

    monkeypatch.setattr(DecodeSession, "start", recording)
    return started


def _fail_sessions_with_bad(monkeypatch, method: str, before=None) -> None:
    """Makes `DecodeSession.<method>` raise for sessions holding the `BAD` job (after calling
    `before()`, when given)."""
    original = getattr(DecodeSession, method)

    def failing(self, *args, **kwargs):
        if BAD in self.max_new_tokens:
            if before is not None:
                before()
            raise RuntimeError(SECRET)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(DecodeSession, method, failing)


class _Log:
    """Every job's events in delivery order (one worker thread delivers them all)."""

    def __init__(self):
        self.events: list[tuple[str, object]] = []
        self.ended = threading.Semaphore(0)

    def deliver(self, name: str):
        def deliver(event) -> None:
            self.events.append((name, event))
            if isinstance(event, (Finished, Failed)):
                self.ended.release()

        return deliver

    def of(self, name: str) -> list:
        return [event for n, event in self.events if n == name]

    def streamed(self, name: str) -> list[int]:
        return [t for event in self.of(name) if isinstance(event, Tokens) for t in event.tokens]


def _run_batch(
    scheduler: Scheduler, jobs: dict[str, tuple[list[int], int]], log: _Log, made=None
) -> None:
    """Submits `jobs` (name: (prompt, budget)) as one batch, the `Job`s into `made` by name, and
    waits for each one's last event."""
    made = {} if made is None else made
    with scheduler.hold():
        for name, (prompt, budget) in jobs.items():
            made[name] = Job(prompt, budget, SamplingParams(), log.deliver(name))
            scheduler.submit(made[name])
    for _ in jobs:
        assert log.ended.acquire(timeout=120), "a job got no answer"


def _served(target, jobs: dict[str, tuple[list[int], int]], made=None, settle=0.0) -> _Log:
    """The events of `jobs` submitted as one batch to a scheduler of up to 3 rows, which runs
    until each job has its last event, then `settle` seconds more, and stops."""
    log = _Log()
    scheduler = Scheduler(target, max_batch_size=3, chunk_steps=2)
    scheduler.start()
    try:
        _run_batch(scheduler, jobs, log, made)
        time.sleep(settle)
    finally:
        scheduler.stop()
    return log


def _assert_served_as_alone(target, log: _Log, name: str, prompt: list[int], budget: int):
    *_, last = log.of(name)
    assert isinstance(last, Finished), last
    alone = jetspec_jax.generate(target, prompt, max_new_tokens=budget)
    assert last.result.tokens == alone.tokens
    assert last.result.finish_reason == alone.finish_reason
    assert log.streamed(name) == alone.tokens  # each token once


def _running_gauge(scheduler: Scheduler) -> float:
    return scheduler.metrics.registry.get_sample_value("jetspec_running_requests")


def test_a_job_that_fails_its_batch_fails_alone(target, monkeypatch, caplog):
    """A batch failing before any token went out (an out-of-memory at compile or prefill, sized
    by its largest request) is retried one job at a time: only the job that cannot be served
    fails, with a message that keeps the internals in the log."""
    _fail_sessions_with_bad(monkeypatch, "start")
    starts = _record_starts(monkeypatch)
    jobs = {"a": ([5, 6, 7], 6), "bad": ([8, 9], BAD), "b": ([10, 11, 12, 14], 5)}
    log = _Log()
    scheduler = Scheduler(target, max_batch_size=3, chunk_steps=2)
    scheduler.start()
    try:
        with caplog.at_level("ERROR"):
            _run_batch(scheduler, jobs, log)
    finally:
        scheduler.stop()
    assert starts == [[6, BAD, 5], [6], [BAD], [5]]  # the batch, then each job alone, in order
    for name in ("a", "b"):
        _assert_served_as_alone(target, log, name, *jobs[name])
    assert log.of("bad") == [Failed(500, GENERIC)]
    assert SECRET in caplog.text
    metrics = scheduler.metrics.registry
    assert metrics.get_sample_value("jetspec_batch_size_count") == 4  # each decode a batch
    # A job's wait in the queue is observed once, not again for its retry.
    assert metrics.get_sample_value("jetspec_phase_seconds_count", {"phase": "queue"}) == 3


def test_a_job_that_received_tokens_fails_with_its_batch_and_is_not_retried(target, monkeypatch):
    """Once a job has streamed tokens, a new decode would repeat them (or diverge from them):
    when its batch fails after the prefill, it fails with it, its tokens delivered once; a row
    that had finished keeps its answer."""
    _fail_sessions_with_bad(monkeypatch, "advance")
    starts = _record_starts(monkeypatch)
    jobs = {"early": ([5, 6, 7], 1), "streaming": ([10, 11], 9), "bad": ([8, 9], BAD)}
    log = _served(target, jobs, settle=0.2)  # a retry would have started by then
    assert starts == [[1, 9, BAD]]  # no retry
    _assert_served_as_alone(target, log, "early", *jobs["early"])
    for name in ("streaming", "bad"):
        events = log.of(name)
        assert events[-1] == Failed(500, GENERIC)
        first = jetspec_jax.generate(target, jobs[name][0], max_new_tokens=1).tokens
        assert events[:-1] == [Tokens(first)]  # the prefill's token, once


def test_a_job_cancelled_before_its_batch_failed_is_not_decoded_again(target, monkeypatch):
    """A job whose client went away while its batch ran has nobody to be decoded for: when the
    batch fails, the others are retried one by one and it is answered without a decode."""
    jobs = {"a": ([5, 6, 7], 6), "bad": ([8, 9], BAD), "gone": ([10, 11, 12, 14], 5)}
    made = {}
    _fail_sessions_with_bad(monkeypatch, "start", before=lambda: made["gone"].cancel())
    starts = _record_starts(monkeypatch)
    log = _served(target, jobs, made)
    assert starts == [[6, BAD, 5], [6], [BAD]]  # "gone" is not decoded alone
    _assert_served_as_alone(target, log, "a", *jobs["a"])
    assert log.of("bad") == [Failed(500, GENERIC)]
    assert log.of("gone") == [Failed(500, GENERIC)]


def test_no_retry_starts_once_the_scheduler_stops(target, monkeypatch):
    """`stop` cancels the running batch: the jobs of a batch that fails meanwhile are answered
    (the server is shutting down), not decoded again one by one."""
    jobs = {"a": ([5, 6, 7], 6), "bad": ([8, 9], BAD), "b": ([10, 11, 12, 14], 5)}
    made = {}
    stopping = []

    def stop_first():  # on the worker thread: `stop` joins it, so from another thread
        stopping.append(threading.Thread(target=scheduler.stop))
        stopping[0].start()
        deadline = time.monotonic() + 60
        while not all(job.cancelled for job in made.values()):  # `stop` has taken the batch
            assert time.monotonic() < deadline
            time.sleep(0.01)

    _fail_sessions_with_bad(monkeypatch, "start", before=stop_first)
    starts = _record_starts(monkeypatch)
    log = _Log()
    scheduler = Scheduler(target, max_batch_size=3, chunk_steps=2)
    scheduler.start()
    try:
        _run_batch(scheduler, jobs, log, made)
    finally:
        if stopping:
            stopping[0].join(60)
        scheduler.stop()
    assert starts == [[6, BAD, 5]]
    for name in jobs:
        [failed] = log.of(name)
        assert isinstance(failed, Failed) and failed.status == 503
        assert "shut down" in failed.message


def test_the_running_count_leaves_out_finished_rows(target):
    """`running` (/health) and its gauge count the batch's jobs not answered yet: a row that ends
    early leaves the count when its answer goes out, not when its batch ends."""
    seen = {}  # (job, event kind): (running, gauge) when the job's event was delivered
    scheduler = Scheduler(target, max_batch_size=2, chunk_steps=2)
    log = _Log()

    def watching(name):
        deliver = log.deliver(name)

        def deliver_and_look(event):
            key = (name, type(event).__name__)
            seen.setdefault(key, (scheduler.running, _running_gauge(scheduler)))
            deliver(event)

        return deliver_and_look

    scheduler.start()
    try:
        with scheduler.hold():
            for name, budget in (("short", 2), ("long", 40)):
                scheduler.submit(Job([5, 6, 7], budget, SamplingParams(), watching(name)))
        for _ in range(2):
            assert log.ended.acquire(timeout=120)
        deadline = time.monotonic() + 60
        while scheduler.running:  # the worker ends the batch just after the last answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        after = (scheduler.running, _running_gauge(scheduler))
    finally:
        scheduler.stop()
    assert seen[("short", "Tokens")] == (2, 2)
    assert seen[("short", "Finished")] == (1, 1)
    assert seen[("long", "Finished")] == (0, 0)
    assert after == (0, 0)


def test_a_job_arriving_during_a_retry_waits_for_the_next_batch(target, monkeypatch):
    """A retry decodes its job alone: a job submitted meanwhile does not join it."""
    _fail_sessions_with_bad(monkeypatch, "start")
    log = _Log()
    scheduler = Scheduler(target, max_batch_size=3, chunk_steps=2, pad_batch=True)
    deliver_a, late = log.deliver("a"), []

    def deliver(event):
        deliver_a(event)
        if isinstance(event, Tokens) and not late:  # a's first tokens come from its retry
            late.append(Job([8, 9], 4, SamplingParams(), log.deliver("late")))
            scheduler.submit(late[0])

    scheduler.start()
    try:
        with scheduler.hold():
            scheduler.submit(Job([5, 6, 7], 6, SamplingParams(), deliver))
            scheduler.submit(Job([8, 9], BAD, SamplingParams(), log.deliver("bad")))
        for _ in range(3):
            assert log.ended.acquire(timeout=120), "a job got no answer"
    finally:
        scheduler.stop()
    assert isinstance(log.of("late")[-1], Finished)
    assert scheduler.metrics.registry.get_sample_value("jetspec_joined_requests_total") == 0


def test_a_job_that_fails_alone_is_not_decoded_again(target, monkeypatch):
    """A batch of one job that fails has nothing to single out: a retry would fail again."""
    _fail_sessions_with_bad(monkeypatch, "start")
    starts = _record_starts(monkeypatch)
    log = _served(target, {"bad": ([8, 9], BAD)})
    assert starts == [[BAD]] and log.of("bad") == [Failed(500, GENERIC)]


def test_stop_cancels_the_running_batch(target):
    """`stop` cancels the running rows at the next chunk boundary, rather than waiting for a
    long job to finish: it ends "cancelled" with what it had."""
    log, started = _Log(), threading.Event()
    deliver = log.deliver("long")

    def on_event(event):
        deliver(event)
        started.set()

    scheduler = Scheduler(target, max_batch_size=3, chunk_steps=1)
    scheduler.start()
    try:
        scheduler.submit(Job([5, 6, 7], 200, SamplingParams(), on_event))
        assert started.wait(120), "no first tokens"
    finally:
        scheduler.stop()
    last = log.of("long")[-1]
    assert isinstance(last, Finished) and last.result.finish_reason == "cancelled"
    assert len(last.result.tokens) < 200
