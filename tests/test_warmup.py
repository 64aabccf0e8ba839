"""Warming up (`decoding/warmup.py`, `Scheduler(warm_up=True)`, `serve.py --warmup`): after it,
requests within the reserve compile nothing, and /health says when the server is ready."""

from __future__ import annotations

import threading

import httpx
import jax
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.decoding import warmup
from jetspec_jax.decoding.options import PIPELINES, DecodingOptions
from jetspec_jax.decoding.session import COMPILED, DecodeSession
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.serving import BackgroundServer, ServerConfig
from jetspec_jax.serving.scheduler import Finished, Job, Scheduler
from tests.test_continuous_batching import wait_for_batches_to_end
from tests.test_foresight import MIXED, ScaledOracleDraft, foresight_options
from tests.text_fixtures import with_tokenizer

# Two prompt widths (16 and 24: a power of two and a three-quarter bucket; test_buckets.py checks
# the list of widths for longer reserves), each compiled per admission group: every program kind
# warm-up compiles, at half the programs of a reserve of four widths. The caches are cleared before
# each warm-up, and what is counted after it is lowering, which loading a program from the
# persistent cache does not save: other tests' programs of the same sizes cannot stand in.
RESERVE = dict(reserve_prompt_tokens=20, reserve_new_tokens=12)


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def draft(target):
    return jetspec_jax.init_draft(target, variant="jetspec++", num_layers=1, block_size=4)


@pytest.mark.parametrize("method, chunk", [("ar", None), ("jetspec++", None), ("jetspec++", 16)])
def test_after_warming_up_requests_within_the_reserve_compile_nothing(target, draft, method, chunk):
    """A batch of 4 rows: a first request of each prompt bucket beside one done at its prefill
    (read before anything else runs), two that join it together and one that joins alone, a row
    cancelled, and the decode loop; none compiles once `warm_up` ran (which did compile: the
    programs were new). With a prefill chunk of 16, the prompts past it
    are prefilled by the one chunked program."""
    options = DecodingOptions(method, prefill_chunk=chunk)
    kwargs = dict(options=options) if method == "ar" else dict(draft=draft, options=options)
    assert_warm_up_serves_the_reserve(target, kwargs)


@pytest.mark.parametrize("form", [None, *PIPELINES])
def test_after_warming_up_foresight_compiles_nothing(target, draft, form):
    """The same with foresight, on one device and in each pipeline form: the SPMD pipeline's
    rows join a state on the stage mesh both before its first chunk and after it."""
    kwargs = dict(draft=ScaledOracleDraft(draft, MIXED), options=foresight_options(2, form))
    assert_warm_up_serves_the_reserve(target, kwargs)


def assert_warm_up_serves_the_reserve(target, kwargs):
    """`warm_up` for batches of 4 compiles, and then `_serve_after_warming_up` lowers nothing.
    Every cache is cleared first: eager programs an earlier test ran must not stand in for the
    warm-up's."""
    COMPILED.clear()
    jax.clear_caches()
    compiled = warmup.warm_up(target, batch_sizes=[4], **RESERVE, **kwargs)
    assert compiled > 0
    rng = np.random.default_rng(0)
    prompt = lambda n: rng.integers(0, 97, n).tolist()  # noqa: E731
    lowered = []  # every program traced and lowered from here: jitted, eager or AOT

    def count(event, seconds, **kwargs):
        if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(kwargs.get("fun_name", event))  # named in the failure

    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        _serve_after_warming_up(target, prompt, kwargs)
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert not lowered


def _serve_after_warming_up(target, prompt, kwargs):
    # A first batch at each prompt width, joined by a group of two rows and by a request alone, at
    # each width too.
    for first, together in [(5, (20, 3)), (20, (12, 3))]:
        session = DecodeSession(
            target,
            [prompt(first), prompt(3)],
            max_new_tokens=[1, 12],
            pad_batch_to=4,
            stop_token_ids=[],
            **RESERVE,
            **kwargs,
        )
        session.start()
        session.poll()
        session.result(0)  # done at its prefill: answered before any chunk or joiner
        # Joiners, first into the fresh batch's state (as the scheduler's first join does).
        session.admit_many([2, 3], [prompt(n) for n in together], max_new_tokens=[10, 6])
        session.advance(3)
        session.admit(0, prompt(first), max_new_tokens=4)
        session.advance(2)
        session.cancel(2)  # its client went away
        session.advance()
        session.poll()
        assert session.done
        session.result(0)  # one row's answer, as the scheduler reads each finished row
        assert session.timing.compile_seconds == 0, (first, together)


def test_warming_up_needs_a_reserve(target):
    with pytest.raises(ValueError, match="reserve_prompt_tokens .* must both be >= 1"):
        warmup.warm_up(target, reserve_prompt_tokens=0, reserve_new_tokens=8)
    with pytest.raises(ValueError, match="batch_sizes is empty"):
        warmup.warm_up(target, batch_sizes=[], reserve_prompt_tokens=8, reserve_new_tokens=8)
    # Refused by name before anything compiles, not as a comparison's TypeError, an attribute
    # missing from the options, or the sessions' `pad_batch_to`.
    refused = [
        (dict(reserve_prompt_tokens=None), "reserve_prompt_tokens None .* must both be >= 1"),
        (dict(reserve_new_tokens="8"), "reserve_new_tokens '8' must both be >= 1"),
        (dict(batch_sizes=[4, 0]), "each of batch_sizes must be an integer >= 1, got 0"),
        (dict(batch_sizes=4), "batch_sizes must be a list of batch sizes, got 4"),
        (dict(options={"method": "ar"}), "options must be a DecodingOptions, got dict"),
    ]
    for kwargs, message in refused:
        with pytest.raises(ValueError, match=message):
            warmup.warm_up(
                target, **{**dict(reserve_prompt_tokens=8, reserve_new_tokens=8), **kwargs}
            )
    with pytest.raises(ValueError, match="give a reserve"):
        Scheduler(target, warm_up=True, reserve=(16, 0))
    with pytest.raises(ValueError, match="warmup compiles"):
        ServerConfig(warmup=True)


def test_the_scheduler_warms_up_before_its_first_batch(target):
    """Unpadded batches of up to 4 rows: every batch shape is warmed; a batch of 2 jobs and
    then a batch of 1, served after the warm-up, compile nothing. (The reserve of the test
    above: its programs are in the suite's persistent cache, so the warm-up mostly loads.)"""
    COMPILED.clear()
    scheduler = Scheduler(
        target, max_batch_size=4, chunk_steps=2, warm_up=True, reserve=tuple(RESERVE.values())
    )
    assert scheduler.warming_up
    finished = []
    all_done = threading.Semaphore(0)

    def deliver(event):
        if isinstance(event, Finished):
            finished.append(event.result)
            all_done.release()

    for prompt in ([5, 6, 7], list(range(1, 21))):  # queued before the start: one batch
        scheduler.submit(Job(prompt, 12, SamplingParams(), deliver))
    scheduler.start()
    try:
        assert all_done.acquire(timeout=120) and all_done.acquire(timeout=120)
        wait_for_batches_to_end(scheduler, 1)  # submitted sooner, it could join that batch
        scheduler.submit(Job([8, 9], 5, SamplingParams(), deliver))
        assert all_done.acquire(timeout=120)
    finally:
        scheduler.stop()
    assert not scheduler.warming_up
    assert [r.timing.compile_seconds for r in finished] == [0, 0, 0]
    phases = scheduler.metrics.registry.get_sample_value(
        "jetspec_phase_seconds_count", {"phase": "compile"}
    )
    assert phases == 3  # the warm-up's compile time, then each batch's


def test_health_answers_503_while_warming_up(checkpoints, tmp_path, monkeypatch):
    target = jetspec_jax.load_target(with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "t"))
    release, entered = threading.Event(), threading.Event()

    def slow_warm_up(*args, **kwargs):
        entered.set()
        assert release.wait(60)
        return 0.0

    monkeypatch.setattr(warmup, "warm_up", slow_warm_up)
    config = ServerConfig(
        max_batch_size=2, warmup=True, reserve_prompt_tokens=32, reserve_new_tokens=8
    )
    with BackgroundServer(target, None, config) as server:
        assert entered.wait(60)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "warming_up"
        release.set()
        for _ in range(600):
            health = httpx.get(server.url + "/health")
            if health.status_code == 200:
                break
            threading.Event().wait(0.05)
        assert health.json()["status"] == "ok"
