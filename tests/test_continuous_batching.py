"""The scheduler's continuous batching: waiting jobs join the running batch at chunk boundaries.

A job submitted while a batch runs is made to arrive at a known point: the running job's
`deliver` submits it on receiving its first tokens (deliveries run on the worker thread, before
the chunk boundary's joins), so every test here is deterministic.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest

import jetspec_jax
from jetspec_jax.decoding.options import PIPELINES
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.serving.scheduler import Failed, Finished, Job, Scheduler, Tokens
from tests.test_foresight import MIXED, ScaledOracleDraft, foresight_options

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


class Client:
    """Jobs and their events; `then` submits more jobs (or calls a callable with the client) when
    a job gets its first tokens; `order` names the jobs in the order they got their last event."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.events: dict[str, list] = {}
        self.jobs: dict[str, Job] = {}
        self.ended = threading.Semaphore(0)
        self.order: list[str] = []
        self.then: dict[str, list] = {}  # (name, prompt, budget) to submit, or a callable
        self.most_running = 0  # the most jobs running at once, seen at any delivery

    def submit(self, name: str, prompt: list[int], budget: int) -> None:
        self.events[name] = []

        def deliver(event) -> None:
            self.most_running = max(self.most_running, self.scheduler.running)
            first_tokens = isinstance(event, Tokens) and not self.events[name]
            self.events[name].append(event)
            if first_tokens:
                for then in self.then.pop(name, []):
                    if callable(then):
                        then(self)
                    else:
                        self.submit(*then)
            if isinstance(event, (Finished, Failed)):
                self.order.append(name)
                self.ended.release()

        self.jobs[name] = Job(prompt, budget, GREEDY, deliver)
        self.scheduler.submit(self.jobs[name])

    def wait(self, count: int) -> None:
        for _ in range(count):
            assert self.ended.acquire(timeout=120), "a job got no answer"

    def result(self, name: str):
        *_, last = self.events[name]
        assert isinstance(last, Finished), last
        streamed = [t for e in self.events[name] if isinstance(e, Tokens) for t in e.tokens]
        assert streamed == last.result.tokens  # each token once
        return last.result


def _count(scheduler: Scheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(name) or 0.0


def wait_for_batches_to_end(scheduler: Scheduler, count: int) -> None:
    """Waits until the worker has ended `count` batches. A job's answer comes before the
    worker's last look at the queue (a job waiting then could still join that batch); the
    batch's decode time is recorded after it."""
    deadline = time.monotonic() + 60
    registry = scheduler.metrics.registry
    while registry.get_sample_value("jetspec_phase_seconds_count", {"phase": "decode"}) != count:
        assert time.monotonic() < deadline, f"{count} batches did not end"
        time.sleep(0.01)


def _batches(scheduler: Scheduler) -> float:
    return _count(scheduler, "jetspec_batch_size_count")


def _assert_as_alone(target, client: Client, name: str, prompt: list[int], budget: int):
    alone = jetspec_jax.generate(target, prompt, max_new_tokens=budget, stop_token_ids=[])
    assert client.result(name).tokens == alone.tokens, name


def _serve(target, jobs, then, answers=None, **options):
    """Serves `jobs` (submitted together) and the jobs `then` submits, until `answers` jobs are
    answered (None: each of `jobs` and each entry of `then`, a callable counted as the one job it
    submits); returns the client and the scheduler (stopped)."""
    settings = dict(max_batch_size=4, chunk_steps=2, pad_batch=True) | options
    scheduler = Scheduler(target, **settings)
    client = Client(scheduler)
    client.then = then
    scheduler.start()
    try:
        with scheduler.hold():
            for args in jobs:
                client.submit(*args)
        client.wait(len(jobs) + sum(map(len, then.values())) if answers is None else answers)
    finally:
        scheduler.stop()
    return client, scheduler


@pytest.fixture(autouse=True)
def _no_stop_tokens(monkeypatch):
    """Budgets, not a random model's end-of-sequence token, end every job here."""
    init = DecodeSession.__init__

    def without_stops(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "stop_token_ids": []})

    monkeypatch.setattr(DecodeSession, "__init__", without_stops)


def test_a_job_that_arrives_mid_batch_joins_it(target):
    long, short = ([5, 6, 7], 16), ([8, 9], 6)
    client, scheduler = _serve(target, [("long", *long)], {"long": [("short", *short)]})
    assert _count(scheduler, "jetspec_joined_requests_total") == 1
    assert _batches(scheduler) == 1  # one batch served both
    _assert_as_alone(target, client, "long", *long)
    _assert_as_alone(target, client, "short", *short)
    assert scheduler.running == 0 and scheduler.queue_depth == 0


def test_with_static_batching_it_waits_for_the_next_batch(target):
    long, short = ([5, 6, 7], 16), ([8, 9], 6)
    client, scheduler = _serve(
        target, [("long", *long)], {"long": [("short", *short)]}, continuous=False
    )
    assert _count(scheduler, "jetspec_joined_requests_total") == 0
    assert _batches(scheduler) == 2
    _assert_as_alone(target, client, "short", *short)


def test_an_unpadded_batch_too_small_for_the_queue_ends_and_the_next_holds_the_queue(target):
    """Without padding, a job alone gets a one-row batch. Jobs that arrive while it runs do not
    join it one at a time as its row frees (the batch would never end while the queue has work,
    and would serve one job at a time): it ends, and the next batch takes them all."""
    long = ([5, 6, 7], 16)
    then = {"long": [(name, [8, 9, i], 6) for i, name in enumerate("abc")]}
    client, scheduler = _serve(target, [("long", *long)], then, pad_batch=False)
    assert _count(scheduler, "jetspec_joined_requests_total") == 0
    assert _batches(scheduler) == 2
    assert client.most_running == 3
    for i, name in enumerate("abc"):
        _assert_as_alone(target, client, name, [8, 9, i], 6)


def test_an_unpadded_batch_takes_a_joiner_it_can_hold(target):
    """The batch ends only when the queue outgrows it: one waiting job joins the row that the
    job alone leaves, without a new batch."""
    long, short = ([5, 6, 7], 16), ([8, 9], 6)
    client, scheduler = _serve(
        target, [("long", *long)], {"long": [("short", *short)]}, pad_batch=False
    )
    assert _count(scheduler, "jetspec_joined_requests_total") == 1
    assert _batches(scheduler) == 1
    _assert_as_alone(target, client, "short", *short)


def test_joiners_never_run_more_jobs_than_max_batch_size(target):
    """max_batch_size 3 pads batches to 4 rows: the fourth row is padding, not room for a
    fourth job, which joins once a row is free."""
    jobs = [(name, [5, 6, i], 8) for i, name in enumerate("abc")]
    client, scheduler = _serve(target, jobs, {"a": [("d", [8, 9], 6)]}, max_batch_size=3)
    assert client.most_running == 3
    assert _count(scheduler, "jetspec_joined_requests_total") == 1
    assert _batches(scheduler) == 1
    _assert_as_alone(target, client, "d", [8, 9], 6)


def test_a_job_the_batch_does_not_fit_waits_and_so_do_those_behind_it(target):
    """FIFO: the job whose prompt and budget exceed the running batch's cache (prompt bucket
    16 + output buffer 16) waits for the next batch, and the job behind it, which would fit,
    waits with it."""
    long = ([5, 6, 7], 16)
    too_long, small = (list(range(1, 30)), 4), ([8, 9], 4)
    then = {"long": [("too_long", *too_long), ("small", *small)]}
    client, scheduler = _serve(target, [("long", *long)], then)
    assert _count(scheduler, "jetspec_joined_requests_total") == 0
    assert _batches(scheduler) == 2  # the two waiting jobs were batched together
    _assert_as_alone(target, client, "too_long", *too_long)
    _assert_as_alone(target, client, "small", *small)


def test_a_reserve_sizes_the_batch_for_the_job_that_did_not_fit(target):
    """The previous test's jobs with a reserve of 32 prompt tokens and 8 new ones: the first
    batch's cache holds the longer prompt, so both waiting jobs join it."""
    long = ([5, 6, 7], 16)
    too_long, small = (list(range(1, 30)), 4), ([8, 9], 4)
    then = {"long": [("too_long", *too_long), ("small", *small)]}
    client, scheduler = _serve(target, [("long", *long)], then, reserve=(32, 8))
    assert _count(scheduler, "jetspec_joined_requests_total") == 2
    assert _batches(scheduler) == 1
    for name, job in (("long", long), ("too_long", too_long), ("small", small)):
        _assert_as_alone(target, client, name, *job)


def test_a_reserve_beyond_the_context_is_refused_at_start(target):
    context = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="reserve_prompt_tokens=.* exceeds the model's context"):
        Scheduler(target, reserve=(context, 1))
    with pytest.raises(ValueError, match="reserve_new_tokens must be an integer >= 0"):
        Scheduler(target, reserve=(0, -1))


def test_a_joined_job_whose_admission_fails_is_retried_alone(target, monkeypatch):
    """The admission's prefill failing fails the batch; the joined job, which received nothing,
    is decoded again alone, and served."""
    admit_many = DecodeSession.admit_many
    failures = []

    def failing_once(self, rows, prompts, **kwargs):
        if not failures:
            failures.extend(rows)
            raise RuntimeError("out of memory")
        return admit_many(self, rows, prompts, **kwargs)

    monkeypatch.setattr(DecodeSession, "admit_many", failing_once)
    long, short = ([5, 6, 7], 16), ([8, 9], 6)
    client, scheduler = _serve(target, [("long", *long)], {"long": [("short", *short)]})
    assert failures == [1]
    assert isinstance(client.events["long"][-1], Failed)  # it had streamed: it fails
    _assert_as_alone(target, client, "short", *short)
    assert scheduler.running == 0


def test_a_full_size_batch_takes_a_joiner_while_more_wait(target):
    """A batch of the most rows (2) is never ended for its queue: of two jobs that arrive while
    one runs, the first joins at once and finishes before the long job; the second joins
    when a row frees."""
    then = {"long": [("a", [8, 9], 4), ("b", [8, 10], 4)]}
    client, scheduler = _serve(target, [("long", [5, 6, 7], 16)], then, max_batch_size=2)
    assert client.order.index("a") < client.order.index("long")
    assert _count(scheduler, "jetspec_joined_requests_total") == 2 and _batches(scheduler) == 1


def test_a_batch_that_jobs_keep_joining_keeps_no_job_it_answered(target):
    """Under steady load a batch runs for as long as jobs join it (a server's for days): it
    must not hold the jobs it answered (each holds its prompt and its client's delivery
    callback). Nine short jobs go through the three rows beside a long one, each submitted as
    the one before it gets its first tokens; when the last joins, the first six, answered and
    their rows taken by others, are gone while the long job still decodes."""
    shorts, gone = [], []

    def submit_short(i):
        def submit(client):
            name = f"s{i}"
            client.submit(name, [8, 9, i], 2)
            shorts.append(weakref.ref(client.jobs.pop(name)))  # the scheduler's alone
            client.then[name] = [submit_short(i + 1) if i < 8 else check]

        return submit

    def check(client):
        assert "long" not in client.order  # the batch still runs
        gc.collect()
        gone.extend(ref() is None for ref in shorts[:6])

    long = [("long", [5, 6, 7], 16)]
    _, scheduler = _serve(target, long, {"long": [submit_short(0)]}, answers=10)
    assert _count(scheduler, "jetspec_joined_requests_total") == 9 and _batches(scheduler) == 1
    assert gone == [True] * 6


def test_no_job_joins_while_the_scheduler_is_held(target):
    scheduler = Scheduler(target, max_batch_size=4, chunk_steps=2, pad_batch=True)
    client = Client(scheduler)
    held = scheduler.hold()

    def hold_then_submit(client):
        held.__enter__()
        client.submit("short", [8, 9], 6)

    client.then = {"long": [hold_then_submit]}
    scheduler.start()
    try:
        client.submit("long", [5, 6, 7], 16)
        client.wait(1)
        assert client.order == ["long"] and client.events["short"] == []
        wait_for_batches_to_end(scheduler, 1)  # released sooner, "short" could join it
        held.__exit__(None, None, None)
        client.wait(1)
    finally:
        scheduler.stop()
    assert _count(scheduler, "jetspec_joined_requests_total") == 0 and _batches(scheduler) == 2
    _assert_as_alone(target, client, "short", [8, 9], 6)


def test_a_job_cancelled_while_waiting_neither_joins_nor_counts_as_waiting(target):
    """An unpadded batch of one row: of two jobs queued behind it, the first is cancelled; it is
    not admitted into the row, nor counted among the waiting (which would end the batch
    instead): the other joins."""

    def submit_two_cancel_one(client):
        client.submit("gone", [8, 10], 6)
        client.submit("short", [8, 9], 6)
        client.jobs["gone"].cancel()

    then = {"long": [submit_two_cancel_one]}
    client, scheduler = _serve(target, [("long", [5, 6, 7], 16)], then, pad_batch=False)
    assert client.events["gone"] == []
    assert _count(scheduler, "jetspec_joined_requests_total") == 1 and _batches(scheduler) == 1
    _assert_as_alone(target, client, "short", [8, 9], 6)


def test_a_job_cancelled_while_waiting_is_not_taken_into_a_new_batch(target):
    """Cancelled after it was queued, before the worker takes a batch: dropped there, not
    prefilled and then cancelled (no event; the batch holds the other job alone)."""
    scheduler = Scheduler(target, max_batch_size=4, chunk_steps=2)
    client = Client(scheduler)
    scheduler.start()
    try:
        with scheduler.hold():
            client.submit("gone", [8, 10], 6)
            client.submit("kept", [5, 6, 7], 6)
            client.jobs["gone"].cancel()
        client.wait(1)
        wait_for_batches_to_end(scheduler, 1)
    finally:
        scheduler.stop()
    assert client.events["gone"] == []
    assert _count(scheduler, "jetspec_batch_size_sum") == 1
    _assert_as_alone(target, client, "kept", [5, 6, 7], 6)


def test_each_delivery_after_the_prefill_is_one_chunk_of_tokens(target):
    """AR commits one token per forward: the prefill delivers 1, each chunk `chunk_steps`."""
    client, _ = _serve(target, [("job", [5, 6, 7], 10)], {}, chunk_steps=3)
    assert [len(e.tokens) for e in client.events["job"] if isinstance(e, Tokens)] == [1, 3, 3, 3]


def test_a_running_job_its_client_cancels_stops_at_the_next_chunk(target):
    """Cancelled as its prefill's token is delivered (on the worker thread, so before the next
    chunk starts), the row decodes nothing more."""
    scheduler = Scheduler(target, max_batch_size=4, chunk_steps=2)
    client = Client(scheduler)
    client.then = {"long": [lambda client: client.jobs["long"].cancel()]}
    scheduler.start()
    try:
        client.submit("long", [5, 6, 7], 200)
        client.wait(1)
    finally:
        scheduler.stop()
    *_, last = client.events["long"]
    assert isinstance(last, Finished) and last.result.finish_reason == "cancelled"
    assert len(last.result.tokens) == 1


@pytest.mark.parametrize("form", PIPELINES)
def test_a_pipelined_batch_takes_joiners_and_cancels(target, form):
    """Foresight decoding with each pipeline form: a job that arrives mid-batch joins it and
    decodes as alone, and a job its client cancels stops, while the others go on."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", num_layers=1, block_size=4)
    long, cancelled, short = ([5, 6, 7], 16), ([1, 2], 40), ([8, 9], 6)
    client, scheduler = _serve(
        target,
        [("long", *long), ("cancelled", *cancelled)],
        {
            "long": [("short", *short)],
            "cancelled": [lambda client: client.jobs["cancelled"].cancel()],
        },
        answers=3,
        draft=ScaledOracleDraft(draft, MIXED),
        options=foresight_options(1, form),
    )
    assert _count(scheduler, "jetspec_joined_requests_total") == 1
    assert _batches(scheduler) == 1
    _assert_as_alone(target, client, "long", *long)
    _assert_as_alone(target, client, "short", *short)
    *_, last = client.events["cancelled"]
    assert isinstance(last, Finished) and last.result.finish_reason == "cancelled"
    assert len(last.result.tokens) < cancelled[1]


def test_tau_is_observed_for_requests_with_a_verification_round_only(target):
    """A one-token answer is its prefill's token alone, no round: left out of the tau histogram
    (its tau of 1.0 would pull the served mean toward AR's)."""
    client, scheduler = _serve(target, [("one", [5, 6, 7], 1), ("more", [8, 9], 5)], {})
    assert _count(scheduler, "jetspec_tau_count") == 1
    assert _count(scheduler, "jetspec_tau_sum") == client.result("more").tau
