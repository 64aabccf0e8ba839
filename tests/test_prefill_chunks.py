"""Chunked prefill (`decoding/prompt_chunks.py`): a long prompt prefilled a chunk at a time leaves
the target's cache, tap states and first token, and every proposer's state, as one forward over
it does; and decoding after it gives the tokens and round outcomes of a one-shot prefill, for
every method, the hybrid target, the MPMD pipeline and requests admitted into a running batch.

Chunks of 16 positions, prompts of 5 to 45 tokens: rows end in different chunks (one within the
first); chunks of at most 10 split the padded width (48) into 5 of 10, the last padded.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.decoding import pipeline_mpmd
from jetspec_jax.decoding.compiled import CompiledCache
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.pipeline_mpmd import TwoProgramPipeline
from jetspec_jax.decoding.prefill import empty_cache, prefill, prefill_in_chunks
from jetspec_jax.decoding.prompt_chunks import even_chunk
from jetspec_jax.decoding.session import DecodeSession, resolve_proposer
from jetspec_jax.decoding.speculative import prefill_speculative
from jetspec_jax.decoding.state import Requests
from jetspec_jax.decoding.target_proxy import TargetProxy
from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.sampling import RowSampling, SamplingParams
from tests.test_foresight import MIXED, ScaledOracleDraft, foresight_options, make_accepting_draft
from tests.tiny_models import near_bigram

CHUNK = 16
LENGTHS = (45, 5, 16, 33)  # the last prompt tokens fall in chunks 2, 0, 0 and 2
SAMPLED = SamplingParams(temperature=1.0, top_p=0.9, seed=5)


def make_prompts(lengths=LENGTHS, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 97, n).tolist() for n in lengths]


def padded(prompts, width):
    out = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        out[row, : len(prompt)] = prompt
    return jnp.asarray(out), jnp.asarray([len(p) for p in prompts], jnp.int32)


def greedy_requests(batch):
    return Requests(
        max_new_tokens=jnp.full((batch,), 4, jnp.int32),
        stop_token_ids=jnp.full((batch, 4), -1, jnp.int32),
        sampling=RowSampling.from_params([SamplingParams()] * batch),
    )


def valid(values, lengths, axis):
    """`values` with every slot at or past each row's length zeroed (the batch axis is the one
    before `axis`): those slots hold padding's stale rows, which differ and are never read."""
    slots = jnp.arange(values.shape[axis])
    shape = [1] * values.ndim
    shape[axis - 1], shape[axis] = lengths.shape[0], values.shape[axis]
    keep = (slots[None, :] < lengths[:, None]).reshape(shape)
    return jnp.where(keep, values, 0)


def assert_caches_equal(chunked, whole, lengths):
    """The caches' lengths, valid key/value slots and (the hybrid's) conv and recurrent states;
    the hybrid's rollback window is left out: a prefill records none that is ever read."""
    np.testing.assert_array_equal(chunked.lengths, whole.lengths)
    for name in ("k", "v"):
        a, b = (valid(getattr(c, name), lengths, axis=2) for c in (chunked, whole))
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)
    for name in ("conv", "state"):
        if hasattr(whole, name):
            a, b = getattr(chunked, name), getattr(whole, name)
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4, err_msg=name)


def keep_taps(carry, tokens, taps, num_new):
    """A `prefill_in_chunks` reader writing each chunk's tap states after the previous one's."""
    del tokens, num_new
    buffer, start = carry
    return jax.lax.dynamic_update_slice_in_dim(buffer, taps, start, axis=2), start + taps.shape[2]


@pytest.mark.parametrize("variant", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("chunk", [CHUNK, 10])
def test_a_chunked_prefill_fills_the_cache_as_one_forward(checkpoints, variant, chunk):
    """The cache, the first tokens and (read chunk by chunk) the tap states of one forward."""
    target = jetspec_jax.load_target(checkpoints.get(variant)[0])
    prompts, lengths = padded(make_prompts(), 48)
    requests = greedy_requests(len(LENGTHS))
    sizes = dict(config=target.config, max_output=4)
    tap_layers = (0, 2)
    whole, whole_taps = prefill(
        target.params, prompts, lengths, requests, **sizes, capacity=64, tap_layers=tap_layers
    )
    chunked, _ = prefill(
        target.params, prompts, lengths, requests, **sizes, capacity=64, chunk=chunk
    )

    @jax.jit
    def read_taps(params, prompts, lengths, requests):
        width = -(-48 // chunk) * even_chunk(48, chunk)  # whole chunks
        buffer = jnp.zeros((len(tap_layers), len(LENGTHS), width, target.config.hidden_size))
        cache = empty_cache(params, target.config, len(LENGTHS), 64)
        args = (params, prompts, lengths, requests, cache)
        _, (taps, _) = prefill_in_chunks(
            *args, **sizes, chunk=chunk, tap_layers=tap_layers, read=keep_taps, carry=(buffer, 0)
        )
        return taps[:, :, :48]

    np.testing.assert_array_equal(chunked.output[:, 0], whole.output[:, 0])
    assert_caches_equal(chunked.cache, whole.cache, lengths)
    chunked_taps = read_taps(target.params, prompts, lengths, requests)
    np.testing.assert_allclose(
        valid(chunked_taps, lengths, axis=2),
        valid(whole_taps, lengths, axis=2),
        rtol=1e-4,
        atol=1e-4,
    )


def test_a_width_cut_into_many_small_chunks_is_padded_to_whole_chunks(checkpoints):
    """Width 7 in chunks of at most 3: three chunks of 3 over 2 padding positions (padding by
    the width's remainder, 1, would shift the last chunk's slice back onto real positions)."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    prompts, lengths = padded(make_prompts((7, 4)), 7)
    args = (target.params, prompts, lengths, greedy_requests(2))
    sizes = dict(config=target.config, capacity=16, max_output=4)
    whole, _ = prefill(*args, **sizes)
    chunked, _ = prefill(*args, **sizes, chunk=3)
    np.testing.assert_array_equal(chunked.output[:, 0], whole.output[:, 0])
    assert_caches_equal(chunked.cache, whole.cache, lengths)


def test_prefill_returns_tap_states_from_one_forward_only(checkpoints):
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    prompts, lengths = padded(make_prompts(), 48)
    sizes = dict(config=target.config, capacity=64, max_output=4, tap_layers=(0,))
    args = (target.params, prompts, lengths, greedy_requests(len(LENGTHS)))
    with pytest.raises(ValueError, match="prefill_in_chunks"):
        prefill(*args, **sizes, chunk=CHUNK)
    assert prefill(*args, **sizes, chunk=48)[1].shape[2] == 48  # one chunk: one forward


@pytest.mark.parametrize("chunk", [None, CHUNK])
def test_a_bfloat16_targets_cache_is_bfloat16(checkpoints, chunk):
    """The prefill's cache is in the target's weights' dtype: a float32 cache for a bfloat16
    target would hold the largest buffer of decoding at twice the memory."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0], dtype="bfloat16")
    prompts, lengths = padded(make_prompts(), 48)
    state, _ = prefill(
        target.params,
        prompts,
        lengths,
        greedy_requests(len(LENGTHS)),
        config=target.config,
        capacity=64,
        max_output=4,
        chunk=chunk,
    )
    assert (state.cache.k.dtype, state.cache.v.dtype) == (jnp.bfloat16, jnp.bfloat16)


def test_chunks_split_the_width_evenly():
    """As few chunks of at most `chunk` as cover the width, as equal as can be."""
    assert [even_chunk(w, 512) for w in (768, 1024, 1536, 3072, 1100)] == [384, 512, 512, 512, 367]
    assert [even_chunk(48, c) for c in (16, 20, 10, 47, 48)] == [16, 16, 10, 24, 48]
    for width in range(1, 300):
        for chunk in (1, 7, 16, 100):
            size = even_chunk(width, chunk)
            count = -(-width // chunk)
            assert size <= chunk and size * count >= width > size * (count - 1), (width, chunk)


def test_prompts_within_one_chunk_take_the_one_forward(checkpoints):
    """A chunk as wide as the prompts runs the one-shot program: the same lowered computation."""
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    prompts, lengths = padded(make_prompts((7, 3)), 16)
    args = (target.params, prompts, lengths, greedy_requests(2))
    sizes = dict(config=target.config, capacity=32, max_output=4)
    one_shot = prefill.lower(*args, **sizes).as_text()
    assert prefill.lower(*args, **sizes, chunk=16).as_text() == one_shot
    assert prefill.lower(*args, **sizes, chunk=8).as_text() != one_shot


def with_adapter(draft):
    return draft.with_adapter(init_adapter(draft, init_std=0.05, seed=3))


@pytest.mark.parametrize("proxy", ["learned", "target"])
@pytest.mark.parametrize(("way", "chunk"), [("one_device", CHUNK), ("mpmd", CHUNK), ("mpmd", 10)])
def test_a_proposer_extended_in_chunks_holds_the_contexts_of_one_start(
    checkpoints, proxy, way, chunk
):
    """Extended a chunk at a time as the target's chunks go, in one program
    (`prefill_speculative`) or on its own device (the MPMD pipeline's host loop), the draft's
    context cache and the proxy's caches (the adapter's context, the decoder's target layers; or
    the target proxy's whole cache) hold what one `prompt_state` over the prompts gives;
    foresight's records stay empty. Chunks of 10 pad the width (48 -> 50) and end rows in middle
    chunks. (Extending reads no pass or refresh count: J0-R0 and the sizes of the decoding test
    below, whose "foresight" and "mpmd" sessions run these prefills with the target proxy.)"""
    target = near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))
    draft = make_accepting_draft(target)
    draft = with_adapter(draft) if proxy == "learned" else ScaledOracleDraft(draft, MIXED)
    proposer, params = resolve_proposer(target, draft, foresight_options(2))
    prompts, lengths = padded(make_prompts(), 48)
    requests = greedy_requests(len(LENGTHS))
    sizes = dict(capacity=64, max_output=16)  # `decode`'s 12 new tokens' bucket

    def prefilled(chunk):
        return prefill_speculative(
            target.params,
            params,
            prompts,
            lengths,
            requests,
            proposer=proposer,
            config=target.config,
            **sizes,
            chunk=chunk,
        )

    whole = prefilled(None).proposer
    if way == "one_device":
        chunked = prefilled(chunk).proposer
    else:
        pipeline = TwoProgramPipeline(
            target.params, params, config=target.config, proposer=proposer, compiled=CompiledCache()
        )
        chunked = pipeline.prefill(prompts, lengths, requests, **sizes, chunk=chunk)[0].proposer
        assert chunked.refiner.draft.k.devices() == {jax.devices()[1]}
        chunked = jax.device_put(chunked, jax.devices()[0])

    refiner_whole, refiner_chunked = whole.refiner, chunked.refiner
    assert isinstance(refiner_whole.draft, ContextCache)
    assert_caches_equal(refiner_chunked.draft, refiner_whole.draft, lengths)
    if proxy == "learned":
        assert_caches_equal(refiner_chunked.proxy.adapter, refiner_whole.proxy.adapter, lengths)
        assert_caches_equal(refiner_chunked.proxy.decoder, refiner_whole.proxy.decoder, lengths)
    else:
        assert isinstance(proposer.refiner.proxy, TargetProxy)
        assert_caches_equal(refiner_chunked.proxy, refiner_whole.proxy, lengths)
    for name in ("last_k", "valid", "num_rounds"):
        np.testing.assert_array_equal(getattr(chunked, name), getattr(whole, name), err_msg=name)


def test_the_mpmd_prefill_lets_device_1_fall_at_most_two_chunks_behind(checkpoints, monkeypatch):
    """The host dispatches the prompt's chunks ahead, and waits for device 1's extend with chunk
    i - 2 before dispatching chunk i: no more than two chunks' tap states queue on device 1,
    however much slower it is than device 0. Five chunks of 10 positions."""
    target = near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))
    options = DecodingOptions("jetspec++", foresight=2, foresight_rule="uncalibrated")
    draft = ScaledOracleDraft(make_accepting_draft(target), MIXED)
    proposer, params = resolve_proposer(target, draft, options)
    prompts, lengths = padded(make_prompts(), 48)
    events = []

    class Extended:
        """An extend's `done`, recording when the host waits for it."""

        def __init__(self, done, index):
            self.done, self.index = done, index

        def block_until_ready(self):
            events.append(("wait", self.index))
            return self.done.block_until_ready()

    call = pipeline_mpmd._StagePrograms.__call__

    def recording(self, fn, *args, **static):
        out = call(self, fn, *args, **static)
        if fn is pipeline_mpmd.target_prefill_chunk:
            events.append(("chunk", int(args[5])))
        if fn is pipeline_mpmd.extend_proposer:
            state, done = out
            return state, Extended(done, int(args[6]))
        return out

    monkeypatch.setattr(pipeline_mpmd._StagePrograms, "__call__", recording)
    pipeline = TwoProgramPipeline(
        target.params, params, config=target.config, proposer=proposer, compiled=CompiledCache()
    )
    pipeline.prefill(
        prompts, lengths, greedy_requests(len(LENGTHS)), capacity=64, max_output=4, chunk=10
    )
    assert events == [
        ("chunk", 0), ("chunk", 1), ("wait", 0), ("chunk", 2), ("wait", 1), ("chunk", 3),
        ("wait", 2), ("chunk", 4),
    ]  # fmt: skip


def test_the_chunked_prefill_holds_no_buffer_of_the_whole_prompts_taps(target):
    """Extending the proposer as the target's chunks go, the compiled chunked prefill's temporary
    memory beyond AR's chunked prefill (the drafting side's) is the same at 1024 prompt tokens as
    at 256: a buffer of the whole prompt's tap states would add 0.4 MiB here (66 MiB at 6000
    tokens on the default model)."""
    proposer, params = resolve_proposer(
        target, make_accepting_draft(target), DecodingOptions("jetspec++", refine_passes=1)
    )

    def draft_side_bytes(width):
        prompts, lengths = jnp.zeros((2, width), jnp.int32), jnp.full((2,), width, jnp.int32)
        args = (prompts, lengths, greedy_requests(2))
        sizes = dict(config=target.config, capacity=width + 64, max_output=4, chunk=32)
        speculative = prefill_speculative.lower(
            target.params, params, *args, **sizes, proposer=proposer
        )
        autoregressive = prefill.lower(target.params, *args, **sizes)
        temp = [
            p.compile().memory_analysis().temp_size_in_bytes for p in (speculative, autoregressive)
        ]
        return temp[0] - temp[1]

    grown = draft_side_bytes(1024) - draft_side_bytes(256)
    taps_bytes = len(proposer.tap_layers) * 2 * (1024 - 256) * target.config.hidden_size * 4
    assert abs(grown) < 0.1 * taps_bytes, (grown, taps_bytes)


def decode(target, prompts, *, chunk, sampling=None, **kwargs):
    """`(tokens, outcomes, foresight hits)` per row of one session."""
    options = dataclasses.replace(kwargs.pop("options", DecodingOptions()), prefill_chunk=chunk)
    session = DecodeSession(
        target,
        prompts,
        options=options,
        max_new_tokens=12,
        sampling=sampling or [SamplingParams()] * len(prompts),
        stop_token_ids=[],
        **kwargs,
    )
    session.start()
    session.advance()
    results = session.results()
    return [(r.tokens, r.outcomes, r.foresight_hits) for r in results]


@pytest.fixture(scope="module")
def target(checkpoints):
    return near_bigram(jetspec_jax.load_target(checkpoints.get("qwen3")[0]))


@pytest.mark.parametrize("method", ["ar", "jetspec", "jetspec++", "foresight", "mpmd"])
def test_decoding_after_a_chunked_prefill_is_decoding_after_one_forward(target, method):
    """Tokens, round outcomes and foresight hits; one row sampled."""
    draft = make_accepting_draft(target)
    if method == "ar":
        kwargs = {}
    elif method == "jetspec":
        jetspec = jetspec_jax.init_draft(
            target, variant="jetspec", num_layers=1, block_size=4, init_std=0.02, seed=2
        )
        kwargs = dict(draft=jetspec, options=DecodingOptions("jetspec"))
    elif method == "jetspec++":
        options = DecodingOptions("jetspec++", refine_passes=1, refreshes=1)
        kwargs = dict(draft=with_adapter(draft), options=options)
    else:
        pipeline = "mpmd" if method == "mpmd" else None
        kwargs = dict(draft=ScaledOracleDraft(draft, MIXED), options=foresight_options(2, pipeline))
    prompts = make_prompts()
    sampling = [SamplingParams(), SAMPLED, SamplingParams(), SamplingParams()]
    whole = decode(target, prompts, chunk=None, sampling=sampling, **kwargs)
    chunked = decode(target, prompts, chunk=CHUNK, sampling=sampling, **kwargs)
    assert chunked == whole
    if method != "ar":
        assert any(k > 0 for _, outcomes, _ in whole for k, _ in outcomes)


def test_the_hybrid_target_decodes_after_a_chunked_prefill_as_after_one_forward(checkpoints):
    target = jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])
    prompts = make_prompts(seed=2)
    assert decode(target, prompts, chunk=CHUNK) == decode(target, prompts, chunk=None)


def test_a_long_admitted_prompt_is_prefilled_in_chunks(target):
    """A request joining a running batch with a prompt past the chunk: its tokens are those of
    decoding it alone with a one-shot prefill; the session's long prompts share one width.
    (Batches padded to 4 rows: the session and the lone decode run the programs of
    `test_decoding_after_a_chunked_prefill_is_decoding_after_one_forward[ar]`.)"""
    first, joining = make_prompts((40, 6)), make_prompts((37,), seed=9)[0]
    options = DecodingOptions(prefill_chunk=CHUNK)
    session = DecodeSession(
        target, first, options=options, max_new_tokens=[12, 2], stop_token_ids=[], pad_batch_to=4
    )
    assert session._prompt_width(40) == session._prompt_width(17) == 48  # the context bucket
    assert session._prompt_width(9) == CHUNK  # short prompts: their bucket, at most the chunk
    session.start()
    session.advance(2)
    session.poll()
    assert session.row_done == [False, True]
    session.admit(1, joining, max_new_tokens=8)
    session.advance()
    alone = decode(target, [joining], chunk=None, pad_batch_to=4)
    assert session.results()[1].tokens == alone[0][0][:8]


def test_the_prefill_chunk_is_checked():
    with pytest.raises(ValueError, match="prefill_chunk"):
        DecodingOptions(prefill_chunk=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        DecodingOptions(prefill_chunk=2.5)
    assert DecodingOptions(prefill_chunk=np.int64(8)).prefill_chunk == 8
    assert DecodingOptions(prefill_chunk=None).prefill_chunk is None


def test_serve_shares_the_library_default_chunk():
    import serve

    assert serve._parser().parse_args([]).prefill_chunk == DecodingOptions().prefill_chunk
