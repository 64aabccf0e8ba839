"""Continuous batching: a request admitted into a running batch decodes as it would alone.

Requests join a `DecodeSession` mid-flight (`admit`, `admit_many`), into rows whose request
finished and into the batch's padding rows, alone or prefilled together; every request's tokens,
streamed chunks and per-round outcomes (and foresight's hit logs) equal those of decoding it
alone, for every decoding method, the hybrid target's recurrent state, and both pipeline forms.
The near-bigram target and accepting draft of `test_foresight.py` make the speculative rounds
accept drafts, so outcomes vary from round to round and a row admitted with another row's stale
state would show.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.decoding.admission import batch_axis, write_rows
from jetspec_jax.decoding.continuous import ContinuousBatch
from jetspec_jax.decoding.options import PIPELINES, DecodingOptions
from jetspec_jax.decoding.request_checks import check_reserve
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.sampling import SamplingParams
from tests.test_foresight import MIXED, ScaledOracleDraft, foresight_options, make_accepting_draft
from tests.tiny_models import near_bigram, with_target_norm

GREEDY = SamplingParams()
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=11)


@pytest.fixture(scope="module")
def target(checkpoints):
    return near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))


@pytest.fixture(scope="module")
def draft(target):
    return make_accepting_draft(target)


def requests(seed: int = 3):
    """Two first requests (a short budget that frees its row early, and a long one) and three
    that join later, one of them sampled and one with a prompt past the first batch's prompt
    bucket (16, its budget as much shorter): `(prompt, max_new_tokens, sampling)`."""
    rng = np.random.default_rng(seed)
    prompt = lambda n: rng.integers(0, 97, n).tolist()  # noqa: E731
    # Budgets in one output bucket (16): the rows alone share their compiled programs.
    first = [(prompt(9), 3, GREEDY), (prompt(5), 16, GREEDY)]
    later = [(prompt(12), 12, GREEDY), (prompt(4), 14, SAMPLED), (prompt(21), 8, GREEDY)]
    return first, later


def alone(target, request, **kwargs):
    prompt, budget, sampling = request
    session = DecodeSession(
        target, [prompt], max_new_tokens=budget, sampling=[sampling], stop_token_ids=[], **kwargs
    )
    session.start()
    session.advance()
    return session.results()[0]


def with_admissions(target, first, later, *, chunk_steps=2, **kwargs):
    """Decodes `first` as a batch padded to 4 rows and admits `later`, in order, into the free
    rows (finished ones, then the next padding rows) at chunk boundaries, all that find a row at
    one boundary together (`admit_many`). Returns each request's result, streamed tokens and the
    rows used, in request order."""
    session = DecodeSession(
        target,
        [p for p, _, _ in first],
        max_new_tokens=[n for _, n, _ in first],
        sampling=[s for _, _, s in first],
        stop_token_ids=[],
        pad_batch_to=4,
        **kwargs,
    )
    session.start()
    owner = list(range(len(first)))  # the request each row holds
    results, streamed, rows = {}, {i: [] for i in range(len(first) + len(later))}, {}
    waiting = list(enumerate(later, start=len(first)))
    while True:
        for row, tokens in enumerate(session.poll()):
            streamed[owner[row]] += tokens
            if session.row_done[row] and owner[row] not in results:
                results[owner[row]] = session.result(row)
        finished = [row for row in range(session.num_rows) if owner[row] in results]
        free = finished + list(range(session.num_rows, session.batch_size))
        joining = [(free.pop(0), *waiting.pop(0)) for _ in range(min(len(free), len(waiting)))]
        if joining:
            session.admit_many(
                [row for row, _, _ in joining],
                [prompt for _, _, (prompt, _, _) in joining],
                max_new_tokens=[budget for _, _, (_, budget, _) in joining],
                sampling=[sampling for _, _, (_, _, sampling) in joining],
            )
        for row, index, _ in joining:
            owner[row : row + 1] = [index]
            rows[index] = row
        if session.done and not waiting:
            break
        session.advance(chunk_steps)
    order = range(len(first) + len(later))
    return [results[i] for i in order], [streamed[i] for i in order], rows


def assert_as_alone(target, first, later, **kwargs):
    results, streamed, rows = with_admissions(target, first, later, **kwargs)
    # Both padding rows together (prompts of 12 and 4 tokens, one sampled), then a finished row
    # alone (a prompt past the first batch's prompt bucket).
    assert rows == {2: 2, 3: 3, 4: 0}
    for i, (request, result) in enumerate(zip(first + later, results, strict=True)):
        expected = alone(target, request, pad_batch_to=4, **kwargs)  # the batch's programs
        assert result.tokens == expected.tokens, i
        assert streamed[i] == result.tokens, i
        assert result.outcomes == expected.outcomes, i
        assert result.foresight_hits == expected.foresight_hits, i
        assert len(result.tokens) == request[1], i
    return results


@pytest.mark.parametrize("method", ["ar", "jetspec++", "foresight"])
def test_admitted_requests_decode_as_alone(target, draft, method):
    first, later = requests()
    if method == "ar":
        kwargs = {}
    elif method == "jetspec++":
        # Wider weights than `draft`'s: its drafts depend on the context (the draft cache), so a
        # row admitted with a stale draft cache would show in the outcomes.
        wide = jetspec_jax.init_draft(
            target, variant="jetspec++", num_layers=1, block_size=5, init_std=0.05, seed=4
        )
        kwargs = dict(draft=with_target_norm(wide, target), options=DecodingOptions("jetspec++"))
    else:
        kwargs = dict(draft=ScaledOracleDraft(draft, MIXED), options=foresight_options(2))
    results = assert_as_alone(target, first, later, **kwargs)
    if method != "ar":
        assert any(k > 0 for r in results for k, _ in r.outcomes)  # drafts were accepted


def test_admitted_requests_on_the_hybrid_target_decode_as_alone(checkpoints):
    """Qwen3.5: the admitted row's recurrent and conv states are its own prefill's."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    first, later = requests(seed=5)
    assert_as_alone(target, first, later)


@pytest.mark.parametrize("form", PIPELINES)
def test_admitted_requests_in_a_pipeline_decode_as_alone(target, draft, form):
    """SPMD: rows written into the state replicated over the stage mesh; MPMD: into a state split
    between the two devices."""
    first, later = requests(seed=7)
    options = foresight_options(1, form)
    assert_as_alone(target, first, later, draft=ScaledOracleDraft(draft, MIXED), options=options)


def test_an_admitted_row_has_its_own_timing(target):
    first, later = requests()
    session = DecodeSession(target, [first[0][0]], max_new_tokens=2, stop_token_ids=[])
    session.start()
    session.advance()
    session.poll()
    decoded = session.timing.decode_seconds
    session.admit(0, later[0][0], max_new_tokens=later[0][1])
    session.advance()
    session.poll()
    timing = session.result(0).timing
    assert 0 < timing.decode_seconds == session.timing.decode_seconds - decoded
    assert 0 < timing.prefill_seconds < session.timing.prefill_seconds


def test_admission_is_refused_clearly(target):
    prompts = [[1, 2, 3], [4, 5]]
    session = DecodeSession(target, prompts, max_new_tokens=[1, 8], stop_token_ids=[])
    with pytest.raises(RuntimeError, match="start"):
        session.admit(0, [1], max_new_tokens=1)
    session.start()
    session.poll()  # row 0 is done (a budget of 1), row 1 is not
    with pytest.raises(ValueError, match="still decoding"):
        session.admit(1, [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="next unused row"):
        session.admit(2, [1], max_new_tokens=1)  # the batch has 2 rows
    with pytest.raises(ValueError, match="row must be an integer"):
        session.admit(True, [1], max_new_tokens=1)
    with pytest.raises(ValueError, match="does not fit"):
        session.admit(0, list(range(25)), max_new_tokens=8)  # the cache holds 16 + 16
    with pytest.raises(ValueError, match="does not fit"):
        session.admit(0, [1], max_new_tokens=17)  # the output buffer holds 16
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        session.admit(0, [1], max_new_tokens=0)
    with pytest.raises(ValueError, match="outside the vocabulary|in \\[0"):
        session.admit(0, [97], max_new_tokens=1)
    with pytest.raises(ValueError, match="SamplingParams"):
        session.admit(0, [1], max_new_tokens=1, sampling=dict(temperature=1.0))
    assert session.fits(16, 16) and session.fits(24, 8) and session.fits(31, 1)
    assert not session.fits(17, 16) and not session.fits(1, 17) and not session.fits(25, 8)
    session.admit(0, [1], max_new_tokens=2)  # the refusals left the session usable
    session.advance()
    session.poll()
    assert len(session.result(0).tokens) == 2 and len(session.result(1).tokens) == 8


def test_several_admissions_are_refused_as_a_whole_and_prefilled_in_groups(target):
    session = DecodeSession(target, [[1, 2]], max_new_tokens=1, stop_token_ids=[], pad_batch_to=4)
    session.start()
    session.poll()  # row 0 is done; rows 1 to 3 are unused padding
    assert session.admission_group_size == 2
    admit = session.admit_many
    with pytest.raises(ValueError, match="one row, prompt and sampling per request"):
        admit([0, 1], [[1]], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match="3 values of max_new_tokens"):
        admit([0, 1], [[1], [2]], max_new_tokens=[1, 1, 1])
    with pytest.raises(ValueError, match="one SamplingParams per request"):
        admit([0, 1], [[1], [2]], max_new_tokens=1, sampling=SAMPLED)
    with pytest.raises(ValueError, match="given twice"):
        admit([0, 0], [[1], [2]], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match="rows are used in order"):
        admit([2, 1], [[1], [2]], max_new_tokens=[1, 1])
    with pytest.raises(ValueError, match="does not fit"):
        admit([0, 1], [[1], list(range(40))], max_new_tokens=[1, 8])
    assert session.num_rows == 1  # nothing was admitted
    admit([0, 1, 2], [[1], [2, 3], [4]], max_new_tokens=[2, 3, 1])  # a group of 2, then of 1
    session.advance()
    session.poll()
    results = [session.result(row) for row in range(3)]
    assert [len(r.tokens) for r in results] == [2, 3, 1]
    prefills = [r.timing.prefill_seconds for r in results]
    assert prefills[0] == prefills[1] != prefills[2]  # a group's prefill is each of its rows'


def test_an_admission_group_is_prefilled_at_a_power_of_two_of_rows(target):
    """Three joiners of a batch of 8 are prefilled as a group of 4 rows (one of padding, not
    written): the program a group of 4 compiled serves them, as warm-up compiles only groups of
    powers of two."""
    session = DecodeSession(target, [[1, 2]], max_new_tokens=1, stop_token_ids=[], pad_batch_to=8)
    session.start()
    session.poll()
    assert session.admission_group_size == 4
    session.admit_many([1, 2, 3, 4], [[1], [2], [3], [4]], max_new_tokens=1)
    session.poll()  # done after their prefill (a budget of 1)
    compiled = session.timing.compile_seconds
    session.admit_many([1, 2, 3], [[1], [2, 3], [4]], max_new_tokens=[2, 3, 1])
    assert session.timing.compile_seconds == compiled
    session.advance()
    session.poll()
    assert [len(session.result(row).tokens) for row in (1, 2, 3)] == [2, 3, 1]


@pytest.mark.parametrize("method", ["ar", "jetspec++"])
def test_a_reserve_admits_what_the_first_batch_would_not_fit(target, draft, method):
    """Reserved for 40-token prompts and 24 new tokens, a session of short requests (buckets 16
    and 16) admits a 40-token prompt with a 24-token budget; it decodes as alone."""
    kwargs = {} if method == "ar" else dict(draft=draft, options=DecodingOptions(method))
    session = DecodeSession(
        target,
        [[1, 2, 3]],
        max_new_tokens=2,
        stop_token_ids=[],
        reserve_prompt_tokens=40,
        reserve_new_tokens=24,
        **kwargs,
    )
    assert session.fits(40, 24) and session.fits(48 + 32 - 24, 24)  # buckets 48 and 32
    assert not session.fits(1, 33) and not session.fits(48 + 32 - 23, 24)
    session.start()
    session.advance()
    session.poll()
    rng = np.random.default_rng(9)
    request = (rng.integers(0, 97, 40).tolist(), 24, GREEDY)
    session.admit(0, request[0], max_new_tokens=24)
    session.advance()
    session.poll()
    result, expected = session.result(0), alone(target, request, **kwargs)
    assert result.tokens == expected.tokens and result.outcomes == expected.outcomes


def test_a_reserve_is_checked(target):
    context = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="reserve_prompt_tokens must be an integer >= 0"):
        DecodeSession(target, [[1]], reserve_prompt_tokens=-1)
    with pytest.raises(ValueError, match="reserve_new_tokens must be an integer >= 0"):
        DecodeSession(target, [[1]], reserve_new_tokens=1.5)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        DecodeSession(target, [[1]], reserve_prompt_tokens=context - 3, reserve_new_tokens=4)
    assert check_reserve(target.config, context - 4, 4) == (context - 4, 4)  # the whole context


def test_a_session_fits_only_what_it_admits(target):
    """A session's cache (prompt bucket 1536 plus output bucket 1024 here) may hold more than the
    model's context (2048): `fits` is True for exactly the requests `admit` takes, so a request
    past the context, or with no budget, is no fit whatever the cache holds."""
    context = target.config.max_position_embeddings
    session = DecodeSession(target, [[1] * 1100], max_new_tokens=900)  # not started: no compile
    assert session.fits(1100, context - 1100) and session.fits(context - 1, 1)
    assert not session.fits(1100, context - 1100 + 1) and not session.fits(context, 1)
    assert not session.fits(1, 0) and not session.fits(0, 1)


def test_the_batch_axis_is_the_one_axis_where_the_new_rows_are_fewer():
    assert batch_axis((3, 4, 5), (3, 1, 5), 4) == 1
    assert batch_axis((3, 4, 5), (3, 2, 5), 4) == 1
    assert batch_axis((2, 6), (2, 6), 1) is None  # a one-row batch: the whole leaf
    refused = [((4, 4), (1, 1)), ((3, 4), (3, 4)), ((4, 5), (1, 6)), ((4,), (8,)), ((4,), (4,))]
    for full, part in refused:
        with pytest.raises(ValueError, match="exactly one"):
            batch_axis(full, part, 4, where="x")


def test_new_rows_are_written_into_their_rows_and_padding_is_dropped():
    def full():
        return {"a": jnp.zeros((2, 4, 3)), "b": jnp.zeros((4,))}

    part = {"a": jnp.ones((2, 2, 3)) * jnp.asarray([1.0, 2.0])[None, :, None], "b": jnp.ones(2)}
    written = write_rows(full(), part, [3, 1], 4)  # new row 0 into row 3, new row 1 into row 1
    np.testing.assert_array_equal(written["a"].sum(axis=(0, 2)), [0, 12, 0, 6])
    written = write_rows(full(), part, [2], 4)  # new row 1 is padding
    np.testing.assert_array_equal(written["a"].sum(axis=(0, 2)), [0, 0, 6, 0])
    np.testing.assert_array_equal(written["b"], [0, 0, 1, 0])
    batch = full()
    refused = [([1, 1], "distinct"), ([], "1 to 2"), ([0, 1, 2], "1 to 2"), ([4], r"\[0, 4\)")]
    # A negative row would wrap around in the scatter and overwrite the batch's last row.
    refused.append(([-1], r"\[0, 4\)"))
    for rows, message in refused:
        with pytest.raises(ValueError, match=message):
            write_rows(batch, part, rows, 4)
    # As many leaves of the same shapes, under other keys: not the batch's state.
    with pytest.raises(ValueError, match="structure"):
        write_rows(batch, {"a": part["a"], "c": part["b"]}, [0], 4)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        write_rows(batch, {"a": part["a"], "b": jnp.ones((5,))}, [0], 4)
    with pytest.raises(ValueError, match="one count"):
        write_rows(batch, {"a": part["a"], "b": jnp.ones((1,))}, [0], 4)
    assert float(batch["a"].sum()) == 0  # refused before any leaf was written (donated)
    # A part of another dtype is cast to the batch's: JAX deprecates a scatter's implicit cast.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cast = write_rows(jnp.zeros((4, 2), jnp.bfloat16), jnp.ones((1, 2), jnp.float32), [1], 4)
    assert cast.dtype == jnp.bfloat16 and float(cast.sum()) == 2


@pytest.mark.parametrize("method", ["ar", "jetspec++"])
def test_generate_as_completed_gives_generate_batchs_results(target, draft, method):
    """Six prompts through 2 rows (continuous batching) against one batch of six: the same
    tokens (and outcomes), with one SamplingParams drawing each prompt with its own seed."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 14, 7, 9, 5, 11)]
    kwargs = dict(max_new_tokens=[4, 16, 9, 2, 12, 6], stop_token_ids=[])
    if method == "ar":
        kwargs["sampling"] = SAMPLED
    else:
        kwargs.update(draft=draft, method=method)
    want = jetspec_jax.generate_batch(target, prompts, **kwargs)
    got = list(jetspec_jax.generate_as_completed(target, prompts, max_batch_size=2, **kwargs))
    assert sorted(i for i, _ in got) == list(range(len(prompts)))
    for i, result in got:
        assert result.tokens == want[i].tokens, i
        assert result.outcomes == want[i].outcomes, i


def test_generate_as_completed_reads_stop_ids_given_as_an_iterator_once(target):
    """The call's validation reads the stop ids; every batch then stops on them, as
    `generate_batch` does, not on an iterator that validation spent."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, 97, n).tolist() for n in (3, 14, 7, 9, 5, 11)]
    kwargs = dict(max_new_tokens=[4, 16, 9, 2, 12, 6])
    free = jetspec_jax.generate_batch(target, prompts, stop_token_ids=[], **kwargs)
    stop = free[1].tokens[5]
    want = jetspec_jax.generate_batch(target, prompts, stop_token_ids=[stop], **kwargs)
    assert want[1].finish_reason == "stop"
    got = jetspec_jax.generate_as_completed(
        target, prompts, max_batch_size=2, stop_token_ids=iter([stop]), **kwargs
    )
    for i, result in got:
        assert (result.tokens, result.finish_reason) == (want[i].tokens, want[i].finish_reason), i


def test_generate_as_completed_starts_a_new_batch_for_what_does_not_fit(target, monkeypatch):
    """The longest prompt (plus budget) starts, sizing the batch; a later prompt whose budget
    exceeds that batch's output buffer (16) waits for a batch of its own. (Under a progress
    bar.)"""
    starts = []
    start = DecodeSession.start
    monkeypatch.setattr(DecodeSession, "start", lambda self: starts.append(1) or start(self))
    prompts = [list(range(1, 31)), [5, 6]]
    budgets = [2, 20]
    got = dict(
        jetspec_jax.generate_as_completed(
            target,
            prompts,
            max_new_tokens=budgets,
            stop_token_ids=[],
            max_batch_size=1,
            show_progress=True,
        )
    )
    assert len(starts) == 2
    for i, (prompt, budget) in enumerate(zip(prompts, budgets, strict=True)):
        alone = jetspec_jax.generate(target, prompt, max_new_tokens=budget, stop_token_ids=[])
        assert got[i].tokens == alone.tokens, i


def test_generate_as_completed_validates_before_decoding(target):
    with pytest.raises(ValueError, match="max_batch_size"):
        jetspec_jax.generate_as_completed(target, [[1]], max_batch_size=0)
    with pytest.raises(ValueError, match="prompts is empty"):
        jetspec_jax.generate_as_completed(target, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        jetspec_jax.generate_as_completed(target, [[1], [2]], max_new_tokens=[1, 0])
    with pytest.raises(ValueError, match="needs a draft"):
        jetspec_jax.generate_as_completed(target, [[1]], method="jetspec++")


def test_a_continuous_batch_refuses_what_it_cannot_hold(target):
    session = DecodeSession(target, [[1, 2], [3]], max_new_tokens=[1, 8], stop_token_ids=[])
    with pytest.raises(ValueError, match="3 keys for a session of 2"):
        ContinuousBatch(session, ["a", "b", "c"])
    with pytest.raises(ValueError, match="given twice"):
        ContinuousBatch(session, ["a", "a"])
    batch = ContinuousBatch(session, ["a", "b"])
    batch.start()
    batch.poll()
    assert batch.running() == ["b"] and batch.free_rows == 0  # "a" is done, not yet taken
    with pytest.raises(ValueError, match="no free row"):
        batch.admit("c", [4], max_new_tokens=1)
    assert [key for key, _ in batch.take_finished()] == ["a"] and batch.free_rows == 1
    with pytest.raises(ValueError, match="'b' holds a row already"):
        batch.admit("b", [4], max_new_tokens=1)
    with pytest.raises(ValueError, match="'a' holds no row"):
        batch.cancel("a")
    batch.admit("a", [4, 5], max_new_tokens=2)  # a taken key may come back
    batch.cancel("b")
    batch.advance(8)
    batch.poll()
    finished = dict(batch.take_finished())
    assert len(finished["a"].tokens) == 2 and finished["b"].finish_reason == "cancelled"
    assert batch.done and batch.free_rows == 2


def test_a_continuous_batch_fills_freed_rows_first_and_admitted_rows_start_afresh(target):
    """Rows that answered requests left are filled before the batch's padding rows; an admitted
    row runs at once (before any poll), and one admitted where a request was cancelled is not
    cancelled."""
    session = DecodeSession(
        target, [[1, 2], [3]], max_new_tokens=[1, 8], stop_token_ids=[], pad_batch_to=4
    )
    batch = ContinuousBatch(session, ["a", "b"])
    batch.start()
    batch.poll()
    batch.cancel("b")
    assert [key for key, _ in batch.take_finished()] == ["a", "b"] and batch.free_rows == 4
    with pytest.raises(ValueError, match="given twice"):
        batch.admit_many([("c", [4], 2, GREEDY), ("c", [5], 2, GREEDY)])
    assert session.num_rows == 2  # nothing was admitted
    batch.admit_many([("c", [4, 5], 2, GREEDY), ("d", [6], 3, GREEDY), ("e", [7], 4, GREEDY)])
    assert session.num_rows == 3  # "c" and "d" took rows 0 and 1; "e" the first padding row
    assert session.row_done == [False] * 3 and not batch.done
    assert sorted(batch.running()) == ["c", "d", "e"] and batch.take_finished() == []
    batch.advance(8)
    batch.poll()
    finished = {key: (len(r.tokens), r.finish_reason) for key, r in batch.take_finished()}
    assert finished == {"c": (2, "length"), "d": (3, "length"), "e": (4, "length")}
