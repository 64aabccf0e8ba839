"""The batching scheduler: a bounded queue of generation jobs, decoded in batches on one thread.

One worker thread owns the device. It takes up to `max_batch_size` waiting jobs, decodes them as
one `DecodeSession` (rows with different prompts, budgets and sampling parameters batch together:
those are per-row arrays), and after the prefill and after every `chunk_steps` target forwards
hands each job its new tokens through the job's `deliver` callback; a job whose row is done (its
stop token, its budget, or cancelled) gets its `Finished` at that chunk boundary, not when the
batch ends.

Continuous batching (the default): at each chunk boundary, waiting jobs join the running batch,
in order, in the rows that finished jobs left and in the batch's padding rows
(`DecodeSession.admit_many`: those joining at once are prefilled together, in groups of up to
half the batch, and each decodes as it would alone). A job joins only if the batch's shapes
hold it (`DecodeSession.fits`: its budget within the output buffer, its prompt plus budget
within the cache); the first that does not waits, with every job behind it, until the batch
ends and a new one is sized for it (`reserve` sizes every batch for jobs up to a given prompt
length and budget, so that those always join).
At most `max_batch_size` jobs run at once. A batch smaller than a full one (unpadded, started by
fewer jobs) takes no job while more wait than it has room for: it ends, and the next batch is
sized for them (joining one at a time would keep it at its size while the queue has work).
With `continuous=False`, jobs that arrive wait for the next batch, and a finished row stays idle
until its batch ends.

With `warm_up`, the worker first compiles every program a job within the reserve needs
(`decoding.warmup.warm_up`: the prefills of each prompt bucket, the decode loop, the joining
groups' prefills and row writes); jobs submitted meanwhile wait in the queue, and `warming_up`
says so (/health answers 503).

The queue is bounded: `submit` raises `QueueFull` rather than letting work pile up unseen. A job
can be cancelled at any time (its row stops at the next chunk boundary). `begin_shutdown` refuses
new and waiting jobs and lets the running batch finish; `cancel_running` also cancels the
running batch, and `stop` then joins the worker.

A batch that fails (say out of memory for one large request: the session's cache is sized by the
batch's largest prompt and budget, for every row) is decoded again one job at a time, for each
unfinished job that nothing was delivered to yet (those that joined it included), so that only a
job that cannot be served fails.
A job that has received tokens fails with its batch: a new decode would repeat what it streamed,
or diverge from it. Failures answer 500 with a generic message; the exception goes to the log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from jetspec_jax.decoding import warmup
from jetspec_jax.decoding.buckets import buckets_up_to
from jetspec_jax.decoding.continuous import ContinuousBatch
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.request_checks import check_budget, check_token_ids
from jetspec_jax.decoding.results import GenerationResult, Timing
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.serving.metrics import ServerMetrics

logger = logging.getLogger(__name__)

# What a job that serving failed is told: the exception (internal detail) goes to the log only.
FAILED_MESSAGE = "serving the request failed (see the server log)"


class QueueFull(Exception):
    """The queue holds `queue_size` waiting jobs already."""


class ShuttingDown(Exception):
    """The scheduler no longer accepts jobs."""


@dataclasses.dataclass(frozen=True)
class Tokens:
    """Event: new tokens of the job (in order)."""

    tokens: list[int]


@dataclasses.dataclass(frozen=True)
class Finished:
    """Event: the job is done; `result.finish_reason` says why. Last event of a job."""

    result: GenerationResult


@dataclasses.dataclass(frozen=True)
class Failed:
    """Event: the job was not (fully) served. Last event of a job.

    Attributes:
        status: the HTTP status that describes it (503: shutting down; 500: serving failed).
        message: what went wrong.
    """

    status: int
    message: str


Event = Tokens | Finished | Failed


@dataclasses.dataclass(eq=False)
class Job:
    """One request for the scheduler.

    Attributes:
        prompt_ids: the prompt's token ids (validated by `Scheduler.check`).
        max_new_tokens: the token budget.
        sampling: the request's sampling parameters.
        deliver: called on the worker thread with each `Event`; must not block or raise.
        submitted_at: when it was made (`time.perf_counter`), for the queue-wait metric.
    """

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    deliver: Callable[[Event], None]
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stops the job: dropped if waiting, stopped at the next chunk boundary if running."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        """`cancel` was called (the client went away, or the server is stopping)."""
        return self._cancelled.is_set()


def check_sizes(**sizes) -> None:
    """Raises a ValueError naming the first of `sizes` that is not an integer >= 1."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class Scheduler:
    """Serves `Job`s of one target (and draft) in batches on a worker thread.

    Args:
        target: the loaded target.
        draft: the draft head of speculative methods; None for "ar".
        options: how every batch is decoded (`DecodingOptions`; None: "ar"); its pairing with
            `draft` is checked here, at start-up.
        max_batch_size: at most this many jobs per batch.
        queue_size: at most this many jobs waiting (not counting the running batch).
        chunk_steps: target forwards between two deliveries of new tokens.
        pad_batch: pad every batch to the rows of a full one (`max_batch_size` rounded up to a
            power of two): one compiled batch shape instead of one per power of two, at the cost
            of computing padding rows (which continuous batching fills as jobs arrive).
        continuous: waiting jobs join the running batch at chunk boundaries (see the module
            docstring); False: each batch runs to its end with the jobs it started with.
        reserve: `(prompt_tokens, new_tokens)`: every batch's shapes hold at least a prompt of
            this many tokens with this budget, so that such jobs can join it
            (`DecodeSession`'s `reserve_prompt_tokens` and `reserve_new_tokens`).
        warm_up: before the first batch, compile the programs of jobs within the reserve (both
            its sizes >= 1), for each batch shape the scheduler uses (one with `pad_batch`,
            else one per power of two up to `max_batch_size`).
        metrics: where to record batch sizes, phase times, tau and tokens.
    """

    def __init__(
        self,
        target,
        *,
        draft=None,
        options: DecodingOptions | None = None,
        max_batch_size: int = 8,
        queue_size: int = 64,
        chunk_steps: int = 8,
        pad_batch: bool = False,
        continuous: bool = True,
        reserve: tuple[int, int] = (0, 0),
        warm_up: bool = False,
        metrics: ServerMetrics | None = None,
    ):
        check_sizes(max_batch_size=max_batch_size, queue_size=queue_size, chunk_steps=chunk_steps)
        self.target = target
        self.draft = draft
        self.options = DecodingOptions() if options is None else options
        # Refuse a bad pairing or reserve now, not at the first request: a one-row session
        # validates them.
        self._reserve = dict(reserve_prompt_tokens=reserve[0], reserve_new_tokens=reserve[1])
        DecodeSession(
            target, [[0]], draft=draft, options=self.options, max_new_tokens=1, **self._reserve
        )
        self.max_batch_size = max_batch_size
        self.queue_size = queue_size
        self.chunk_steps = chunk_steps
        self._pad_to = max_batch_size if pad_batch else 1
        if warm_up:
            warmup.check_warm_up_reserve(*reserve)
        self._warming_up = warm_up
        self.continuous = continuous
        self.metrics = metrics or ServerMetrics()
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._accepting = True
        self._stopping = False
        self._held = 0
        self._running: list[Job] = []
        self._thread: threading.Thread | None = None
        # Read at each scrape: a cancelled waiting job leaves the count at once, as in /health.
        self.metrics.queue_depth.set_function(lambda: self.queue_depth)
        self.metrics.running.set_function(lambda: self.running)

    # -- client side ------------------------------------------------------------------------

    def check(self, prompt_ids, max_new_tokens: int) -> list[int]:
        """The validated prompt, or ValueError (bad ids, prompt plus budget beyond the context)."""
        ids = check_token_ids(prompt_ids, self.target.config.vocab_size)
        check_budget(self.target.config, len(ids), max_new_tokens)
        return ids

    def submit(self, job: Job) -> None:
        """Queues a job (validate it with `check` first).

        Raises:
            QueueFull: `queue_size` jobs are waiting already.
            ShuttingDown: the scheduler is stopping.
        """
        with self._cond:
            if not self._accepting:
                raise ShuttingDown("the server is shutting down")
            # Jobs cancelled while waiting leave the queue only when a batch is taken: drop them
            # now, or clients that went away would count against the limit.
            self._waiting = deque(job for job in self._waiting if not job.cancelled)
            if len(self._waiting) >= self.queue_size:
                raise QueueFull(
                    f"the request queue is full ({self.queue_size} waiting); retry later"
                )
            self._waiting.append(job)
            self._cond.notify()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting (not counting cancelled ones)."""
        with self._cond:  # the worker pops from the queue meanwhile
            return self._live_waiting()

    def _live_waiting(self) -> int:
        """Waiting jobs not cancelled; the caller holds `_cond`."""
        return sum(not job.cancelled for job in self._waiting)

    @property
    def running(self) -> int:
        """Jobs of the running batch not answered yet (a row leaves when its answer goes out;
        a job that joins it counts from then)."""
        return len(self._running)

    @property
    def accepting(self) -> bool:
        """New jobs are taken (False after `begin_shutdown`)."""
        return self._accepting

    @property
    def warming_up(self) -> bool:
        """The worker is compiling before its first batch (`warm_up`); jobs wait meanwhile."""
        return self._warming_up

    @contextlib.contextmanager
    def hold(self):
        """While inside, no new batch starts and no job joins the running one (jobs keep
        queueing): for maintenance and tests."""
        with self._cond:
            self._held += 1
        try:
            yield
        finally:
            with self._cond:
                self._held -= 1
                self._cond.notify_all()

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the worker thread."""
        if self._thread is not None:
            raise RuntimeError("the scheduler has already started")
        self._thread = threading.Thread(target=self._work, name="jetspec-scheduler", daemon=True)
        self._thread.start()

    def begin_shutdown(self) -> None:
        """Refuses new jobs, fails the waiting ones (503); the running batch finishes."""
        with self._cond:
            self._accepting = False
            waiting, self._waiting = list(self._waiting), deque()
            self._cond.notify_all()
        for job in waiting:
            job.deliver(Failed(503, "the server is shutting down"))

    def cancel_running(self) -> None:
        """`begin_shutdown`, and cancels the running batch's rows: each gets its `Finished`
        ("cancelled") at its next chunk boundary, and no job starts or joins after. Returns at
        once (the shutdown's deadline, on the event loop)."""
        self.begin_shutdown()
        with self._cond:
            self._stopping = True
            for job in self._running:
                job.cancel()
            self._cond.notify_all()

    def stop(self, timeout: float = 30.0) -> None:
        """`cancel_running`, and joins the worker."""
        self.cancel_running()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("the scheduler thread did not stop within %.0f s", timeout)

    # -- worker -----------------------------------------------------------------------------

    def _work(self) -> None:
        if self._warming_up:
            self._warm_up()
        while True:
            with self._cond:
                while not self._stopping and (self._held or not self._waiting):
                    self._cond.wait()
                if self._stopping:
                    return
                batch = []
                while self._waiting and len(batch) < self.max_batch_size:
                    job = self._waiting.popleft()
                    if not job.cancelled:
                        batch.append(job)
                self._running = list(batch)  # `_answer` removes each job as it is answered
            if batch:
                self._serve(batch)
            with self._cond:
                self._running = []

    def _warm_up(self) -> None:
        """Compiles the programs of jobs within the reserve. A failure is logged (with what it
        means for the jobs) and serving goes on: each job then compiles what it needs."""
        if self._pad_to > 1:
            batch_sizes = [self._pad_to]
        else:
            batch_sizes = buckets_up_to(self.max_batch_size, minimum=1)
        start = time.perf_counter()
        try:
            compile_seconds = warmup.warm_up(
                self.target,
                draft=self.draft,
                options=self.options,
                batch_sizes=batch_sizes,
                **self._reserve,
            )
            self.metrics.phase_seconds.labels("compile").observe(compile_seconds)
            logger.info(
                "warmed up in %.1f s (%.1f s compiling): batches of %s rows, prompts up to %d "
                "tokens, budgets up to %d",
                time.perf_counter() - start,
                compile_seconds,
                "/".join(map(str, batch_sizes)),
                *self._reserve.values(),
            )
        except Exception:
            logger.exception("warming up failed; requests compile their programs as they come")
        finally:
            with self._cond:
                self._warming_up = False

    def _serve(self, batch: list[Job]) -> None:
        """Decodes `batch`, giving each job its last event as soon as its row is done. When the
        batch fails, each unfinished job that nothing was delivered to yet is decoded again
        alone, in order, so that one job that cannot be served (the batch's cache is sized by its
        largest request) fails alone. A job's own failure is final (500). The retries finish
        the running batch: `hold` does not delay them, but none starts once `cancel_running` (or
        `stop`) was called (the job is answered 503, as a cancelled row is)."""
        untouched, served = self._attempt(batch, first=True)
        if served == 1:  # it failed alone: a retry would fail again
            for job in untouched:
                self._answer(job, Failed(500, FAILED_MESSAGE))
            return
        if untouched:
            logger.warning("decoding %d of its requests again, one at a time", len(untouched))
        for job in untouched:
            with self._cond:
                stopping = self._stopping
            if stopping:
                self._answer(job, Failed(503, "the server shut down before the request finished"))
            elif job.cancelled:  # its client went away: nobody to decode it for
                self._answer(job, Failed(500, FAILED_MESSAGE))
            else:
                for failed in self._attempt([job], first=False)[0]:
                    self._answer(failed, Failed(500, FAILED_MESSAGE))

    def _attempt(self, batch: list[Job], *, first: bool) -> tuple[list[Job], int]:
        """Decodes `batch` once (on the `first` attempt, waiting jobs may join it; a retry
        decodes its job alone) and records its metrics (the queue wait only on the first
        attempt: a retried job waited once). A failure anywhere (decoding, recording metrics) is
        logged and fails, with a 500, the unfinished jobs that have received tokens, never the
        worker thread. Returns the unfinished jobs that received nothing, in order (they can be
        retried), and how many jobs the attempt served."""
        m = self.metrics
        # The unfinished jobs, in order (the batch's, then those that joined it; a dict as an
        # ordered set), and those of them that received tokens. An answered job leaves both: a
        # batch that jobs keep joining runs for as long as they come (steady load), and must not
        # hold every job it ever served (its prompt, its client's delivery callback and queue).
        unfinished: dict[Job, None] = dict.fromkeys(batch)
        streamed: set[Job] = set()
        served = len(batch)

        def tokens(job: Job, new_tokens: list[int]) -> None:
            streamed.add(job)
            job.deliver(Tokens(new_tokens))

        def finish(job: Job, result: GenerationResult) -> None:
            m.prompt_tokens.inc(result.prompt_length)
            m.generated_tokens.inc(len(result.tokens))
            if len(result.acceptance_lengths) > 1:
                m.tau.observe(result.tau)
            self._answer(job, Finished(result))
            unfinished.pop(job, None)
            streamed.discard(job)

        def joined(job: Job) -> None:
            nonlocal served
            served += 1
            unfinished[job] = None
            m.joined.inc()
            m.phase_seconds.labels("queue").observe(time.perf_counter() - job.submitted_at)

        try:
            m.batch_size.observe(len(batch))
            started = time.perf_counter()
            if first:
                for job in batch:
                    m.phase_seconds.labels("queue").observe(started - job.submitted_at)
            join = joined if first and self.continuous else None
            timing = self._decode(batch, tokens, finish, join)
            m.phase_seconds.labels("compile").observe(timing.compile_seconds)
            m.phase_seconds.labels("prefill").observe(timing.prefill_seconds)
            m.phase_seconds.labels("decode").observe(timing.decode_seconds)
        except Exception:
            logger.exception("serving a batch of %d requests failed", served)
            for job in unfinished:
                if job in streamed:
                    self._answer(job, Failed(500, FAILED_MESSAGE))
            return [job for job in unfinished if job not in streamed], served
        return [], served

    def _answer(self, job: Job, event: Finished | Failed) -> None:
        """Gives `job` its last event, once it has left the running count: a client that reads
        the count (/health) on receiving its answer does not see itself."""
        with self._cond:
            if job in self._running:
                self._running.remove(job)
        job.deliver(event)

    def _decode(
        self,
        batch: list[Job],
        tokens: Callable[[Job, list[int]], None],
        finish: Callable[[Job, GenerationResult], None],
        joined: Callable[[Job], None] | None,
    ) -> Timing:
        """Decodes `batch` as one session: `tokens(job, new_tokens)` for every job with new
        tokens after the prefill and every `chunk_steps` forwards, and `finish(job, result)` once
        per job, when it is done (a job that ends early is answered while the others decode).
        With `joined`, waiting jobs join at chunk boundaries (`_join`), each announced by
        `joined(job)` before its prefill. Returns the batch's timing."""
        session = DecodeSession(
            self.target,
            [job.prompt_ids for job in batch],
            draft=self.draft,
            options=self.options,
            max_new_tokens=[job.max_new_tokens for job in batch],
            sampling=[job.sampling for job in batch],
            pad_batch_to=self._pad_to,
            **self._reserve,
        )
        rows = ContinuousBatch(session, batch)
        rows.start()
        while True:
            for job, new_tokens in rows.poll():
                tokens(job, new_tokens)
            for job in rows.running():
                if job.cancelled:
                    rows.cancel(job)
            for job, result in rows.take_finished():
                finish(job, result)
            if joined is not None and self._join(rows, joined):
                continue  # deliver the joiners' first tokens before decoding on
            if rows.done:
                return rows.timing
            rows.advance(self.chunk_steps)

    def _join(self, rows: ContinuousBatch, joined: Callable[[Job], None]) -> bool:
        """Admits waiting jobs, in order, into the batch's free rows, never past `max_batch_size`
        running jobs (padding rows are not room for more). Stops at the first job the batch does
        not fit (it waits for the next batch, and so does every job behind it). A batch smaller
        than a full one takes no job while more wait than it has room for: joining one at a time
        as rows free would keep it running, at its size, for as long as the queue has work; it
        ends instead, and the next batch takes them together. True if any job joined."""
        holds = min(rows.session.batch_size, self.max_batch_size)  # jobs at once
        free, taken = min(rows.free_rows, holds - len(rows.running())), []
        with self._cond:
            if self._stopping or not self._accepting or self._held:
                return False
            if holds < self.max_batch_size and self._live_waiting() > free:
                return False
            while len(taken) < free and self._waiting:
                job = self._waiting[0]
                if not job.cancelled and not rows.fits(len(job.prompt_ids), job.max_new_tokens):
                    break
                self._waiting.popleft()
                if not job.cancelled:
                    self._running.append(job)
                    taken.append(job)
        for job in taken:  # all announced first: a failed admission leaves none unaccounted
            joined(job)
        if taken:  # prefilled together
            rows.admit_many(
                [(job, job.prompt_ids, job.max_new_tokens, job.sampling) for job in taken]
            )
        return bool(taken)
