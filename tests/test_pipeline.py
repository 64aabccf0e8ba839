"""The pipelined round over two CPU devices, both forms (one SPMD `shard_map` program; one program
per device): the single-device round's results.

Pipelined, single-device foresight and autoregressive decoding give the same tokens, greedy and
sampled, and greedy foresight rounds the same outcomes and hit statistics, with forced hits, forced
misses and both interleaved (the scaled oracle proxy of test_foresight.py). As there, the target is
near-bigram and the draft's blocks are accepted now and then, so the outcomes exchanged between the
devices vary from round to round. The MPMD form is also run with the learned proxy (adapter +
decoder), whose placement leaves the target's lower layers off the draft device. On CPU the two
virtual devices share the cores: correctness, not overlap.

The sessions of the two prompts all forecast B = 2 candidates, and the J3-R3 in-place tests run
the three rows of the per-row sampling test: tests with the same sizes share their compiled
programs. B = 1 pipelines are run by the hybrid test (and by test_admission.py and
test_continuous_batching.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.decoding import pipeline, pipeline_mpmd
from jetspec_jax.decoding import session as session_module
from jetspec_jax.decoding.compiled import CompiledCache, signature
from jetspec_jax.decoding.options import PIPELINES
from jetspec_jax.decoding.pipeline_mpmd import draft_stage_target_params
from jetspec_jax.decoding.placement import PLACED
from jetspec_jax.decoding.session import COMPILED, DecodeSession
from tests.compiled_hlo import compiled_program, compiled_programs, copies_shaped_like
from tests.test_foresight import (
    BLOCK,
    HITS,
    MISSES,
    MIXED,
    N_NEW,
    ScaledOracleDraft,
    _ar,
    cache_shapes_after_compiling,
    foresight_options,
    make_accepting_draft,
    make_draft,
    make_prompts,
    run,
)
from tests.tiny_models import near_bigram


@pytest.fixture(scope="module")
def target(checkpoints):
    return near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))


@pytest.fixture(scope="module")
def draft(target):
    return make_accepting_draft(target)


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


def rows_apart_prompts(target):
    """Three prompts (`test_rows_that_end_apart_each_with_its_own_sampling`'s): a batch of 4
    rows, whose J3-R3 programs the in-place tests read."""
    rng = np.random.default_rng(1)
    return [rng.integers(0, target.config.vocab_size, n).tolist() for n in (11, 6, 3)]


def refining_options(pipeline, passes):
    """Foresight B = 2 with `passes` refinement passes and as many refreshes (J<p>-R<p>)."""
    options = foresight_options(2, pipeline)
    return dataclasses.replace(options, refine_passes=passes, refreshes=passes)


def run_with_candidates(target, prompts, draft, pipeline=None):
    """`run`'s results and the candidate blocks cached at the end: these depend on every input
    of the drafting side, including the token sequence and committed counts the draft device
    holds."""
    session = DecodeSession(
        target,
        prompts,
        draft=draft,
        options=foresight_options(2, pipeline),
        max_new_tokens=N_NEW,
        stop_token_ids=[],
    )
    session.start()
    session.advance()
    results = session.results()
    proposer = session._state.proposer  # the foresight state (private: test-only inspection)
    candidates = jax.device_get((proposer.blocks, proposer.keys_k, proposer.keys_a))
    return (
        [r.tokens for r in results],
        [r.outcomes for r in results],
        [(r.foresight_hits, r.foresight_occupancy) for r in results],
        [x.tolist() for x in candidates],
    )


@pytest.mark.parametrize("form", PIPELINES)
@pytest.mark.parametrize("scale", [HITS, MISSES, MIXED], ids=["hits", "misses", "mixed"])
def test_pipelined_equals_single_device_and_ar(target, draft, prompts, scale, form):
    oracle = ScaledOracleDraft(draft, scale)
    COMPILED.clear()
    piped = run_with_candidates(target, prompts, oracle, pipeline=form)
    if form == "spmd":  # the two-stage program ran, exchanging values across the devices
        programs = compiled_programs("decode_pipelined")
        assert programs and all("collective-permute" in hlo for hlo in programs)
    single = run_with_candidates(target, prompts, oracle)
    assert piped == single  # tokens, outcomes, hit and occupancy logs, candidate blocks
    assert piped[0] == _ar(target, prompts)
    assert any(k > 0 for row in piped[1] for k, _ in row)  # some drafts were accepted
    hits = [h for row_hits, _ in piped[2] for h in row_hits[1:]]
    if scale == HITS:
        assert all(hits)
    if scale == MISSES:
        assert not any(hits)
    if scale == MIXED:
        for row_hits, _ in piped[2]:
            assert any(row_hits[1:]) and not all(row_hits[1:]), row_hits


@pytest.mark.parametrize("form", PIPELINES)
@pytest.mark.parametrize("scale", [HITS, MISSES], ids=["hits", "misses"])
def test_pipelined_sampled_tokens_equal_ar_with_the_same_seed(target, draft, prompts, scale, form):
    for seed in (1, 2):
        sampling = dict(temperature=1.0, top_p=0.9, seed=seed)
        oracle = ScaledOracleDraft(draft, scale)
        tokens, _, _ = run(target, prompts, oracle, foresight=2, pipeline=form, **sampling)
        assert tokens == _ar(target, prompts, **sampling)


@pytest.mark.parametrize("form", PIPELINES)
def test_pipelined_chunks_give_the_same_tokens(target, draft, prompts, form):
    """The loop resumes across chunks (SPMD: the carry is gathered, replicated, each call;
    MPMD: the draft device's mirror is rebuilt from the decode side), and a chunk of n target
    forwards is n rounds (a loop one round short would still join up to AR's tokens)."""

    def session():
        return DecodeSession(
            target,
            prompts,
            draft=ScaledOracleDraft(draft, MIXED),
            options=foresight_options(2, form),
            max_new_tokens=N_NEW,
            stop_token_ids=[],
        )

    chunks = list(session().chunks(2))
    assert len(chunks) > 2
    joined = [sum((chunk[row] for chunk in chunks), []) for row in range(len(prompts))]
    assert joined == _ar(target, prompts)
    two = session()
    two.start()
    two.advance(2)
    rounds = two._state.num_verify_rounds  # test-only inspection
    assert jax.device_get(rounds).tolist() == [2] * len(prompts)


@pytest.mark.parametrize("form", PIPELINES)
def test_rows_that_end_apart_each_with_its_own_sampling(target, draft, form):
    """Rows with their own budgets (one shorter than the block), a stop token met mid-output and
    per-row sampling (greedy, top-p, top-k), drafted with the learned proxy refining and
    refreshing (J3-R3, the in-place tests' programs): AR's tokens, and the single-device round's
    outcomes and foresight hits."""
    prompts = rows_apart_prompts(target)
    sampling = [
        jetspec_jax.SamplingParams(),
        jetspec_jax.SamplingParams(temperature=1.0, top_p=0.9, seed=5),
        jetspec_jax.SamplingParams(temperature=0.7, top_k=5, seed=9),
    ]
    budgets = [3, 17, 11]
    assert min(budgets) < BLOCK
    common = dict(max_new_tokens=budgets, sampling=sampling)

    def ar(stop):
        out = jetspec_jax.generate_batch(target, prompts, stop_token_ids=stop, **common)
        return [r.tokens for r in out]

    stop = ar([])[1][6]
    expected = ar([stop])
    assert expected[1][-1] == stop and len(expected[1]) < budgets[1]
    learned = draft.with_adapter(init_adapter(draft, init_std=0.05))

    def speculative(pipeline):
        options = refining_options(pipeline, 3)
        session = DecodeSession(
            target, prompts, draft=learned, options=options, stop_token_ids=[stop], **common
        )
        session.start()
        session.advance()
        results = session.results()
        return [(r.tokens, r.outcomes, r.foresight_hits) for r in results]

    piped = speculative(form)
    assert piped == speculative(None)
    assert [tokens for tokens, _, _ in piped] == expected


@pytest.mark.parametrize("form", PIPELINES)
def test_pipeline_is_refused_on_one_device(target, draft, monkeypatch, form):
    learned = draft.with_adapter(init_adapter(draft))
    one = jax.devices()[:1]
    monkeypatch.setattr(pipeline.jax, "devices", lambda *args: one)
    with pytest.raises(ValueError, match="a pipeline needs >= 2 devices"):
        DecodeSession(
            target,
            [[1, 2]],
            draft=learned,
            options=foresight_options(2, form),
        )


def test_mpmd_places_each_stage_on_its_own_device(target, draft, prompts):
    """With the learned proxy the draft device holds the target's embedding, norm, LM head and
    the decoder's layers only; the tokens are AR's; after a call the decode state is on device 0
    and the proposer state on device 1; a second session reuses the placed weights."""
    learned = draft.with_adapter(init_adapter(draft))
    deepest_tap = draft.config.target_layer_ids[-1]
    assert 0 < deepest_tap < target.config.num_layers - 1  # lower layers exist to leave out

    def session():
        return DecodeSession(
            target,
            prompts,
            draft=learned,
            options=foresight_options(2, "mpmd"),
            max_new_tokens=N_NEW,
            stop_token_ids=[],
        )

    first = session()
    first.start()
    first.advance()
    assert [r.tokens for r in first.results()] == _ar(target, prompts)

    device0, device1 = jax.devices()[:2]
    stages = first._two_programs
    layers = stages.draft_target_params["layers"]
    assert all(layer is None for layer in layers[: deepest_tap + 1])
    assert all(layer is not None for layer in layers[deepest_tap + 1 :])
    placed = {
        device0: (stages.target_params, first._state.decode),
        device1: (stages.draft_target_params, stages.draft_params, first._state.proposer),
    }
    for device, trees in placed.items():
        assert {d for x in jax.tree.leaves(trees) for d in x.devices()} == {device}

    second = session()
    second.start()
    second.advance(1)
    assert second._two_programs.draft_target_params is stages.draft_target_params


def test_mpmd_verification_writes_the_target_cache_in_place(target, draft, prompts):
    """Device 0's round program copies no target cache (a `lax.cond` that skipped the round once
    every row was done made XLA copy its keys and values, twice each, every round)."""
    COMPILED.clear()
    session = DecodeSession(
        target,
        prompts,
        draft=ScaledOracleDraft(draft, MIXED),
        options=foresight_options(2, "mpmd"),
        max_new_tokens=N_NEW,
    )
    session.start()
    session.advance(1)
    verify = compiled_program("verify_and_commit")
    assert copies_shaped_like(verify, [session._state.decode.cache.k.shape]) == []


@pytest.mark.parametrize("passes", [0, 3], ids=["J0", "J3-R3"])
def test_mpmd_draft_programs_write_their_caches_in_place(target, draft, prompts, passes):
    """Device 1's programs (propose, draft ahead, observe) copy none of the draft's, the
    adapter's or the decoder's caches: each is its own program over donated buffers, so the
    predicted rows drafting ahead writes and the true rows observing writes land in place; so do
    the rows the fallback's refreshes write (in a `lax.cond`, J3-R3's fallback copied the draft's
    and the decoder's keys and values twice each: 8 copies). J3-R3 runs the three rows of
    `test_rows_that_end_apart_each_with_its_own_sampling`, whose programs it reads."""
    rows = rows_apart_prompts(target) if passes else prompts
    shapes = cache_shapes_after_compiling(target, draft, rows, refining_options("mpmd", passes))
    for program in ("propose_block", "draft_ahead", "observe_outcome"):
        assert copies_shaped_like(compiled_program(program), shapes) == [], program


def test_mpmd_prefill_programs_write_their_caches_in_place(target, draft, prompts):
    """The prefill's chunk programs on each device (the target's forward over a chunk, the
    proposer's extend with its taps) and the first token's copy no cache: each takes its caches
    donated, chunk after chunk."""
    shapes = cache_shapes_after_compiling(target, draft, prompts, foresight_options(2, "mpmd"))
    for program in ("target_prefill_chunk", "extend_proposer", "finish_target_prefill"):
        assert copies_shaped_like(compiled_program(program), shapes) == [], program


@pytest.mark.parametrize("passes", [0, 3], ids=["J0", "J3-R3"])
def test_the_spmd_loop_writes_every_cache_in_place(target, draft, prompts, passes):
    """Each stage's steps run in loops of zero or one trip (`conditional.apply_if`), which write
    the target's cache (verifying) and the draft side's (drafting ahead, observing, the
    fallback's refreshes) in place: the loop copies no cache (under `lax.cond`s on the stage it
    copied the target's keys and values three times each per round). Nor does the program copy
    them once per call, at its entry: the carry is donated (undonated, it copied its eight caches
    there). J3-R3 runs the three rows of `test_rows_that_end_apart_each_with_its_own_sampling`,
    whose programs it reads."""
    rows = rows_apart_prompts(target) if passes else prompts
    shapes = cache_shapes_after_compiling(target, draft, rows, refining_options("spmd", passes))
    hlo = compiled_program("decode_pipelined")
    assert copies_shaped_like(hlo, shapes) == []


def test_spmd_chunks_place_only_their_step_count(target, draft, prompts, monkeypatch):
    """The state and the requests are placed on the stage mesh once, after the prefill, and the
    loop gives the carry back there: a chunk places nothing anew but its step count (before,
    each copied the requests from device 0 to the mesh). The weights are placed at the first
    chunk, for every chunk."""
    moved = []

    def buffers(leaf):  # a key array's data: `device_put` wraps it anew without copying it
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        return [shard.data.unsafe_buffer_pointer() for shard in leaf.addressable_shards]

    def recording(tree):
        placed = pipeline.replicate(tree)
        pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(placed), strict=True)
        moved.extend(new.shape for old, new in pairs if buffers(new) != buffers(old))
        return placed

    def placing_weights(tree):
        placed_weights.append(tree)
        return pipeline.replicated_weights(tree)

    session, placed_weights = mixed_session(target, draft, prompts, pipeline="spmd"), []
    monkeypatch.setattr(session_module, "replicate", recording)
    monkeypatch.setattr(session_module, "replicated_weights", placing_weights)
    session.start()
    assert moved  # the prefilled state and the requests
    moved.clear()
    session.advance(2)
    session.advance(2)
    assert moved == [(), ()]  # the step count of each
    # The target's and the proposer's weights, looked up once for every chunk (`PLACED`).
    assert len(placed_weights) == 2 and placed_weights[0] is target.params
    assert all(session.poll())  # every row decoded


def test_mpmd_stage_programs_sign_the_placed_weights_once(target, draft, prompts, monkeypatch):
    """The stage programs' cache lookups take the placed weights' signatures from the pipeline,
    made when it placed them: an advance signs only its carry (each of its first stage calls
    walked every weight before)."""
    signed = []

    def recording(tree):
        signed.append(tree)
        return signature(tree)

    monkeypatch.setattr(pipeline_mpmd, "signature", recording)
    session = mixed_session(target, draft, prompts)
    session.start()
    session.advance(2)
    session.advance(2)
    two = session._two_programs
    weights = (two.target_params, two.draft_target_params, two.draft_params)
    assert [sum(tree is w for tree in signed) for w in weights] == [1, 1, 1]
    assert all(session.poll())  # every row decoded


@pytest.mark.parametrize("form", PIPELINES)
def test_sessions_with_other_drafts_share_the_placed_target(target, draft, prompts, form):
    """One placed copy of the target, whatever the drafts: a copy per (target, draft) pair
    would pin a target's worth of device memory per draft. A draft's second session reuses its
    copy too (a new replacement-confidence scalar per session placed the draft again)."""
    PLACED.clear()
    learned = draft.with_adapter(init_adapter(draft))
    for proposing in (learned, learned, learned.with_adapter(init_adapter(draft, seed=1))):
        session = DecodeSession(
            target,
            prompts,
            draft=proposing,
            options=foresight_options(2, form),  # the in-place tests' programs
            max_new_tokens=N_NEW,
        )
        session.start()
        session.advance(1)
    # spmd: the target, then each draft's params; mpmd: the target on each device, each draft's.
    assert len(PLACED) == {"spmd": 3, "mpmd": 4}[form]
    PLACED.clear()
    assert len(PLACED) == 0


def mixed_session(target, draft, prompts, pipeline="mpmd"):
    """A foresight session of interleaved hits and misses, to its full budget (B = 2, as
    `run_with_candidates`: the programs its test compiled)."""
    return DecodeSession(
        target,
        prompts,
        draft=ScaledOracleDraft(draft, MIXED),
        options=foresight_options(2, pipeline),
        max_new_tokens=N_NEW,
        stop_token_ids=[],
    )


def test_mpmd_cancel_between_chunks(target, draft, prompts):
    """A row cancelled between calls is inactive on both devices: the results and the cached
    candidate blocks are the single-device session's (the draft device's mirror takes the
    cancelled row's done flag from the decode side), and the other row is AR's."""

    def cancelled_after_one_round(pipeline):
        session = mixed_session(target, draft, prompts, pipeline)
        session.start()
        session.advance(1)
        session.cancel(0)
        while not all(session.row_done[1:]):
            session.advance(2)
            session.poll()
        proposer = session._state.proposer  # the foresight state (private: test-only inspection)
        candidates = jax.device_get((proposer.blocks, proposer.keys_k, proposer.keys_a))
        results = [
            (r.tokens, r.finish_reason, r.outcomes, r.foresight_hits, r.foresight_occupancy)
            for r in session.results()
        ]
        return results, [x.tolist() for x in candidates]

    piped, single = cancelled_after_one_round("mpmd"), cancelled_after_one_round(None)
    assert piped == single
    (first, reason, *_), (second, *_) = piped[0]
    assert reason == "cancelled" and 1 < len(first) < N_NEW
    assert second == _ar(target, prompts)[1]


def test_advancing_a_finished_mpmd_session_dispatches_nothing(target, draft, prompts):
    """Once every row is done (the host knows it from the state it is given), `advance`
    returns at once: no round is dispatched for rows that cannot change."""
    session = mixed_session(target, draft, prompts)
    session.start()
    session.advance()
    session.poll()
    assert session.done

    def logs():
        return [(r.tokens, r.outcomes, r.foresight_hits) for r in session.results()]

    before = logs()
    with dispatch_log() as dispatched:
        session.advance()
    assert dispatched == []
    assert logs() == before


def test_an_mpmd_advance_interrupted_while_it_waits_leaves_the_session_usable(
    target, draft, prompts, monkeypatch
):
    """Ctrl-C during the wait for the rounds the MPMD host loop dispatched (their input state
    already donated): the session keeps the state they compute, as the one-program loop does,
    and decodes on to AR's tokens (it said the state was lost)."""
    session = mixed_session(target, draft, prompts)
    session.start()
    session.poll()
    wait = jax.block_until_ready

    def interrupted(tree):  # once: the host loop itself waits on no `block_until_ready`
        monkeypatch.setattr(jax, "block_until_ready", wait)
        raise KeyboardInterrupt

    monkeypatch.setattr(jax, "block_until_ready", interrupted)
    with pytest.raises(KeyboardInterrupt):
        session.advance(2)
    session.poll()
    while not session.done:
        session.advance(2)
        session.poll()
    assert [r.tokens for r in session.results()] == _ar(target, prompts)


@contextlib.contextmanager
def dispatch_log():
    """The names of the stage programs the MPMD host dispatches inside the block, in order."""
    dispatched = []
    call = pipeline_mpmd._StagePrograms.__call__

    def counting(self, fn, *args, **static):
        dispatched.append(fn.__name__)
        return call(self, fn, *args, **static)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_mpmd._StagePrograms, "__call__", counting)
        yield dispatched


def test_the_mpmd_host_keeps_one_round_in_flight(target, draft, prompts):
    """The host checks a round's done flags only after dispatching the next round, so the
    devices never wait on it: when the last row finishes in round R, exactly R + 1 rounds were
    dispatched (checking the round just dispatched would block on it every round, and lose the
    overlap that only two real devices show)."""
    session = mixed_session(target, draft, prompts)
    session.start()
    with dispatch_log() as dispatched:
        session.advance()
    rounds = max(len(r.outcomes) for r in session.results())
    assert 1 < rounds < N_NEW  # some blocks accepted drafts; the loop ran several rounds
    assert dispatched.count("verify_and_commit") == rounds + 1


def test_mpmd_timing_keeps_compilation_apart(target, draft, prompts, monkeypatch):
    """The host loops compile each stage program at its first call, between dispatches: the
    session's compile time sums every program's, and its prefill and decode times leave it out.
    Every compilation here is made 1 s slower, more than the tiny model's whole prefill or
    decode."""
    slower = 1.0
    get = CompiledCache.get

    def slow_get(self, fn, *args, **static):
        executable, seconds = get(self, fn, *args, **static)
        if seconds:  # compiled in this call
            time.sleep(slower)
            seconds += slower
        return executable, seconds

    monkeypatch.setattr(CompiledCache, "get", slow_get)
    COMPILED.clear()
    session = mixed_session(target, draft, prompts)
    wall = time.perf_counter()
    session.start()
    wall = time.perf_counter() - wall
    # Five prefill programs: the empty cache and proposer, a chunk on each device, the first
    # token. The prefill time leaves out their sleeps, however long the machine's load makes
    # the rest.
    prefill = session.timing.compile_seconds
    assert prefill > 5 * slower
    assert 0 < session.timing.prefill_seconds <= wall - 5 * slower
    wall = time.perf_counter()
    session.advance()
    wall = time.perf_counter() - wall
    # Four round programs: propose, verify, draft ahead, observe.
    assert session.timing.compile_seconds - prefill > 4 * slower
    assert 0 < session.timing.decode_seconds <= wall - 4 * slower


def test_draft_stage_target_params_leave_out_the_lower_layers():
    params = {"embed_tokens": 1, "layers": [10, 11, 12, 13], "norm": 2}
    assert draft_stage_target_params(params, 3) == {
        "embed_tokens": 1,
        "layers": [None, None, None, 13],
        "norm": 2,
    }
    assert draft_stage_target_params(params, 0) == params


@pytest.mark.parametrize("form", PIPELINES)
def test_pipelined_round_on_a_hybrid_target(checkpoints, form):
    """Qwen3.5 hybrid: the verify stage's Gated DeltaNet states roll back across the pipeline
    (recompute of the committed prefix) and the tokens stay exactly AR's, greedy and sampled.
    The single-device loop, called a round at a time (each call's first round observes
    nothing, its last round's block is observed after its loop), gives the same outcomes and
    hits."""
    hybrid = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    prompts = make_prompts()
    oracle = ScaledOracleDraft(make_draft(hybrid), MIXED)
    for sampling in ({}, dict(temperature=1.0, top_p=0.9, seed=3)):
        piped = run(hybrid, prompts, oracle, pipeline=form, **sampling)
        tokens, outcomes, _ = piped
        assert tokens == _ar(hybrid, prompts, **sampling)
        assert any(k < BLOCK - 1 for row in outcomes for k, _ in row)  # rejections happened
        assert run(hybrid, prompts, oracle, rounds_per_call=1, **sampling) == piped
