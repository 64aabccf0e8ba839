"""Jitted autoregressive generation: greedy parity with transformers, batching, seeds, stops."""

from __future__ import annotations

import io
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jetspec_jax
from jetspec_jax import SamplingParams
from jetspec_jax.decoding.request_checks import check_budget, check_prompts, check_token_ids
from jetspec_jax.decoding.session import DecodeSession
from jetspec_jax.decoding.state import DecodeState, Requests, commit
from jetspec_jax.generate import _progress_bar
from tests.text_fixtures import EOS_ID, char_tokenizer, with_tokenizer


def _hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),  # token 0 is not padding here
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("variant", ["qwen3", "llama3_rope_bias"])
def test_greedy_64_tokens_identical_to_transformers_generate(checkpoints, variant):
    path, model = checkpoints.get(variant)
    target = jetspec_jax.load_target(path)
    prompt = np.random.default_rng(0).integers(0, 97, 30).tolist()
    result = jetspec_jax.generate(target, prompt, max_new_tokens=64, stop_token_ids=[])
    assert result.tokens == _hf_greedy(model, prompt, 64)
    assert result.acceptance_lengths == [1] * 64
    assert result.finish_reason == "length"


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [rng.integers(0, 97, n).tolist() for n in (3, 17, 9)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_prompts_of_different_lengths_equal_one_by_one(target, prompts, temperature):
    sampling = [SamplingParams(temperature=temperature, top_p=0.9, seed=s) for s in (5, 6, 7)]
    batched = jetspec_jax.generate_batch(
        target, prompts, max_new_tokens=20, sampling=sampling, stop_token_ids=[]
    )
    for prompt, params, together in zip(prompts, sampling, batched, strict=True):
        alone = jetspec_jax.generate(
            target,
            prompt,
            max_new_tokens=20,
            temperature=temperature,
            top_p=0.9,
            seed=params.seed,
            stop_token_ids=[],
        )
        assert together.tokens == alone.tokens
        assert len(alone.tokens) == 20


def test_same_seed_same_tokens_other_seed_other_tokens(target, prompts):
    def run(seed):
        return jetspec_jax.generate(
            target, prompts[1], max_new_tokens=32, temperature=1.5, seed=seed, stop_token_ids=[]
        ).tokens

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_one_sampling_params_for_a_batch_gives_each_row_its_own_draws(target, prompts):
    """The way to draw n samples of one prompt: rows are not copies of one draw; one
    `SamplingParams` per row keeps each seed as given (`generate`'s)."""
    params = SamplingParams(temperature=1.5, seed=7)
    kwargs = dict(max_new_tokens=16, stop_token_ids=[])
    rows = jetspec_jax.generate_batch(target, [prompts[1]] * 3, sampling=params, **kwargs)
    assert len({tuple(r.tokens) for r in rows}) == 3
    alone = jetspec_jax.generate(target, prompts[1], temperature=1.5, seed=7, **kwargs)
    (given,) = jetspec_jax.generate_batch(target, [prompts[1]], sampling=[params], **kwargs)
    assert given.tokens == alone.tokens


def test_a_prompt_may_be_any_iterable_of_ids(target, prompts):
    want = jetspec_jax.generate(target, prompts[0], max_new_tokens=4).tokens
    assert jetspec_jax.generate(target, iter(prompts[0]), max_new_tokens=4).tokens == want
    streamed = jetspec_jax.stream(target, iter(prompts[0]), max_new_tokens=4)
    assert [t for chunk in streamed for t in chunk] == want


def test_stop_token_ends_generation_and_is_included(target, prompts):
    free = jetspec_jax.generate(target, prompts[0], max_new_tokens=32, stop_token_ids=[]).tokens
    stop = free[5]
    first = free.index(stop)
    result = jetspec_jax.generate(target, prompts[0], max_new_tokens=32, stop_token_ids=[stop])
    assert result.tokens == free[: first + 1]
    assert result.finish_reason == "stop"
    assert sum(result.acceptance_lengths) == len(result.tokens)


def test_commit_cuts_at_stops_and_budgets_under_strict_dtype_promotion():
    """A user's process may set `jax_numpy_dtype_promotion="strict"`, which refuses bool + int:
    `commit` counts its stop tokens and rounds with explicit casts (a TypePromotionError before)."""
    cache = types.SimpleNamespace(lengths=jnp.zeros(3, jnp.int32))  # commit reads only its batch
    requests = Requests(
        max_new_tokens=jnp.asarray([5, 1, 5], jnp.int32),
        stop_token_ids=jnp.asarray([[7, -1]] * 3, jnp.int32),
        sampling=None,
    )
    tokens = jnp.asarray([[1, 7, 3], [4, 5, 6], [8, 9, 7]], jnp.int32)
    with jax.numpy_dtype_promotion("strict"):
        state = commit(DecodeState.start(cache, 4), tokens, jnp.asarray([3, 2, 2]), requests)
    # Row 0 stops at its stop token (included), row 1 at its budget, row 2 at its count.
    np.testing.assert_array_equal(state.output, [[1, 7, 0, 0], [4, 0, 0, 0], [8, 9, 0, 0]])
    np.testing.assert_array_equal(state.num_rounds, [1, 1, 1])
    np.testing.assert_array_equal(state.done, [True, True, False])


def test_stop_lists_of_other_lengths_reuse_the_compiled_decoders(target, prompts):
    from jetspec_jax.decoding.session import COMPILED

    free = jetspec_jax.generate(target, prompts[0], max_new_tokens=32, stop_token_ids=[]).tokens
    compiled = len(COMPILED._executables)
    for stops in ([free[5]], [free[5], free[6], free[7]], [free[7], 96, 95, 94]):
        result = jetspec_jax.generate(target, prompts[0], max_new_tokens=32, stop_token_ids=stops)
        assert result.tokens == free[: min(free.index(s) for s in stops if s in free) + 1]
    assert len(COMPILED._executables) == compiled


def test_default_stop_tokens_come_from_the_checkpoint(target, checkpoints, tmp_path):
    assert target.stop_token_ids == ()  # the tiny checkpoint sets no eos
    with_eos = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny")  # eos <|im_end|>
    assert jetspec_jax.load_target(with_eos).stop_token_ids == (EOS_ID,)


def test_max_new_tokens_is_respected(target, prompts):
    for n in (1, 2, 7):
        result = jetspec_jax.generate(target, prompts[2], max_new_tokens=n, stop_token_ids=[])
        assert len(result.tokens) == n
        assert result.acceptance_lengths == [1] * n


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e-39), "0 \\(greedy\\) or >= 1e-05"),
        (dict(temperature=1e39), "temperature must be a finite number"),  # inf as float32
        (dict(temperature=True), "temperature must be a real number"),
        (dict(temperature="1"), "temperature must be a real number"),
        (dict(top_p=True), "top_p must be a real number"),
        (dict(temperature=np.complex64(1 + 5j)), "temperature must be a real number"),
        (dict(top_p=np.complex64(0.5)), "top_p must be a real number"),
        (dict(top_p=-0.1), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_k=2**31), "top_k"),  # top_k travels as int32
        (dict(seed=-1), "seed"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(method="medusa"), "unknown method"),
        (dict(draft=object()), "^draft must be a Draft \\(load_draft\\(path, target\\)"),
        # A path is named as no Draft, not told to pass the (jetspec++) method it would not fit.
        (dict(draft="runs/draft"), "^draft must be a Draft .*got str: 'runs/draft'"),
        (dict(stop_token_ids=[1000]), "outside the vocabulary"),
        (dict(stop_token_ids=2), "stop_token_ids must be a list of token ids, got 2"),
    ],
)
def test_invalid_arguments_are_refused(target, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jetspec_jax.generate(target, [1, 2, 3], **kwargs)


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([], "empty"),
        ([1, 97], "outside the vocabulary"),
        ([3, -1], "outside the vocabulary"),
        ("hello", "not text"),
        ([1.5], "integer"),
    ],
)
def test_invalid_prompts_are_refused(target, prompt, message):
    with pytest.raises(ValueError, match=message):
        jetspec_jax.generate(target, prompt)


def test_invalid_batches_are_refused(target):
    flat = "prompts must be a list of prompts \\(lists of token ids\\).* pass \\[prompt\\]"
    for one_prompt in ([1, 2, 3], np.array([1, 2, 3]), jnp.array([1, 2, 3])):
        with pytest.raises(ValueError, match=flat):  # one prompt, not a batch of prompts
            jetspec_jax.generate_batch(target, one_prompt)
    with pytest.raises(ValueError, match="prompts must be a list of prompts"):
        jetspec_jax.generate_batch(target, 5)
    with pytest.raises(ValueError, match="sampling must hold SamplingParams, got dict"):
        jetspec_jax.generate_batch(target, [[1, 2]], sampling=[dict(temperature=1.0)])
    with pytest.raises(ValueError, match="sampling must be a SamplingParams or one per prompt"):
        jetspec_jax.generate_batch(target, [[1, 2], [3, 4]], sampling="greedy")  # not 6 of them
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        jetspec_jax.generate_batch(target, [[1, 2], [3, 4]], sampling=[SamplingParams()])
    for pad in (-3, 0, True, 2.0):
        with pytest.raises(ValueError, match="pad_batch_to must be an integer >= 1"):
            DecodeSession(target, [[1, 2]], pad_batch_to=pad)
    assert DecodeSession(target, [[1, 2]], pad_batch_to=np.int64(4))._inputs[0].shape[0] == 4


@pytest.mark.parametrize(
    "ids, message",
    [
        (np.array(5), "must be a list of token ids, got array\\(5\\)"),
        (jnp.array(5), "must be a list of token ids"),
        (np.array([[1, 2]]), "must be a list of token ids"),
        (np.array([1.0, 2.0]), "must hold integer token ids, got an array of float64"),
        (jnp.array([True, False]), "must hold integer token ids, got an array of bool"),
        ([1, True], "must hold integer token ids, got True"),
        ([1, np.float32(2)], "must hold integer token ids, got np.float32\\(2.0\\)"),
    ],
)
def test_token_ids_that_are_not_integers_are_refused(ids, message):
    with pytest.raises(ValueError, match=message):
        check_token_ids(ids, 97)


def test_a_mapping_or_set_where_ids_belong_is_refused_not_read_as_its_keys(target):
    """A tokenizer's output (a mapping) is named as one, not read as its keys ('input_ids' as
    text); a set of ids would decode in hash order. Stop ids, unordered, may be a set."""
    encoding = char_tokenizer()(["hi", "yo"])  # BatchEncoding: input_ids, attention_mask
    with pytest.raises(ValueError, match="^prompt must be a list, got a mapping .*'input_ids'"):
        check_token_ids({5: 0, 100: 0}, 200)  # was [5, 100], its keys
    with pytest.raises(ValueError, match="^prompts must be a list, got a mapping"):
        jetspec_jax.generate_batch(target, encoding)  # was "not text; tokenize it first"
    with pytest.raises(ValueError, match="^prompt must be a list, got an unordered set"):
        check_token_ids({5, 100}, 200)  # was [100, 5]
    with pytest.raises(ValueError, match="^prompt 1 must be a list, got an unordered frozenset"):
        check_prompts([[1], frozenset({5, 100})], 200)
    assert check_token_ids({2}, 97, "stop_token_ids", allow_empty=True, ordered=False) == [2]


def test_errors_name_a_prompt_by_its_index_only_in_a_batch():
    """One prompt is "prompt"; a batch's are "prompt i", so the bad one can be found."""
    with pytest.raises(ValueError, match="^prompt holds token id 99,"):
        check_prompts([[1, 99]], 97)
    with pytest.raises(ValueError, match="^prompt 1 holds token id 99,"):
        check_prompts([[1], [1, 99]], 97)


def test_numpy_and_jax_integers_are_accepted(target, prompts):
    """Token ids and budgets as NumPy or JAX integer arrays and scalars decode as Python ints."""
    ids = [1, 2, 3]
    assert check_token_ids(jnp.array(ids), 97) == ids
    assert check_token_ids(np.array(ids, np.int16), 97) == ids
    assert check_token_ids([np.int64(1), jnp.int32(2), 3], 97) == ids
    want = jetspec_jax.generate(target, prompts[0], max_new_tokens=4).tokens
    for budget in (jnp.int32(4), np.int64(4), np.array(4)):
        result = jetspec_jax.generate(target, jnp.array(prompts[0]), max_new_tokens=budget)
        assert result.tokens == want
    batch = jetspec_jax.generate_batch(
        target, np.array([prompts[0]]), max_new_tokens=jnp.array([4])
    )
    assert batch[0].tokens == want
    for budget in (jnp.array(True), np.float32(4), jnp.array([4.0])):
        with pytest.raises(ValueError, match="max_new_tokens must be an integer"):
            DecodeSession(target, [prompts[0]], max_new_tokens=budget)


@pytest.mark.parametrize(
    "call",
    [
        lambda path: jetspec_jax.generate(path, [1, 2]),
        lambda path: jetspec_jax.generate_batch(path, [[1, 2]]),
        lambda path: jetspec_jax.stream(path, [1, 2]),
        lambda path: jetspec_jax.init_draft(path),
        lambda path: jetspec_jax.load_draft(path, path),
    ],
)
def test_a_path_where_a_target_belongs_is_refused_by_name(call):
    """The usual slip, a checkpoint path for the loaded target, is named as such, not an
    AttributeError from inside."""
    with pytest.raises(TypeError, match="target must be a Target .*got str: 'ckpt/qwen3'"):
        call("ckpt/qwen3")


ENTRY_POINTS = {
    "generate": lambda target, **kw: jetspec_jax.generate(target, [1, 2], **kw),
    "generate_batch": lambda target, **kw: jetspec_jax.generate_batch(target, [[1, 2]], **kw),
    "generate_as_completed": lambda target, **kw: jetspec_jax.generate_as_completed(
        target, [[1, 2]], **kw
    ),
    "stream": lambda target, **kw: jetspec_jax.stream(target, [1, 2], **kw),
}


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_entry_points_pass_decoding_keywords_to_the_options(target, entry_point):
    """Every entry point builds its `DecodingOptions` from the keywords it does not take itself:
    a bad value is the options' error, and a misspelled keyword a TypeError listing the fields
    (not swallowed, not a later argument's)."""
    call = ENTRY_POINTS[entry_point]
    with pytest.raises(ValueError, match="unknown method 'medusa'"):
        call(target, method="medusa")
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1"):
        call(target, prefill_chunk=0)
    with pytest.raises(TypeError, match="'refine_pases'.*DecodingOptions \\(method, refine_passes"):
        call(target, method="jetspec++", refine_pases=1)


def test_generate_takes_no_batch_arguments(target):
    """`generate` decodes one prompt in one call: `generate_batch`'s progress bar is not its."""
    with pytest.raises(TypeError, match="'show_progress'"):
        jetspec_jax.generate(target, [1, 2], show_progress=True)


def test_show_progress_none_shows_the_bar_on_a_terminal_only(monkeypatch):
    """`show_progress=None` leaves the choice to tqdm's check of stderr: shown on a terminal,
    hidden in a pipe; False hides it even on a terminal."""

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for stderr, show, hidden in (
        (Terminal(), None, False),
        (Terminal(), False, True),
        (io.StringIO(), None, True),
        (io.StringIO(), True, False),
    ):
        monkeypatch.setattr(sys, "stderr", stderr)
        with _progress_bar(2, "prompt", show) as bar:
            assert bool(bar.disable) is hidden, (stderr, show)


def test_prompt_longer_than_the_context_is_refused(target):
    context = target.config.max_position_embeddings
    with pytest.raises(ValueError, match="exceeds the model's context"):
        jetspec_jax.generate(target, [1] * (context - 4), max_new_tokens=5)


def test_a_bad_prompt_is_named_as_one_prompt_or_by_its_index_in_a_batch(target):
    context = target.config.max_position_embeddings
    for call in (jetspec_jax.generate, jetspec_jax.stream):
        with pytest.raises(ValueError, match="^prompt must be a list of token ids, got 5$"):
            call(target, 5)
    with pytest.raises(ValueError, match="^prompt 1 is empty"):
        jetspec_jax.generate_batch(target, [[1, 2], []])
    with pytest.raises(
        ValueError, match=f"^prompt 1 of {context - 2} tokens \\+ max_new_tokens=5 exceeds"
    ):
        jetspec_jax.generate_batch(target, [[1, 2], [1] * (context - 2)], max_new_tokens=5)


def test_a_draft_without_its_method_is_refused_naming_the_method(target, prompts):
    draft = jetspec_jax.init_draft(target, variant="jetspec", block_size=4)
    message = "method 'ar' \\(the default\\) takes no draft model; pass method='jetspec'"
    with pytest.raises(ValueError, match=message):
        jetspec_jax.generate(target, prompts[0], draft=draft, max_new_tokens=4)


def test_a_prompt_and_budget_that_exactly_fill_the_context_fit():
    config = types.SimpleNamespace(max_position_embeddings=64)
    assert check_budget(config, 60, 4) == 4
    with pytest.raises(ValueError, match="exceeds the model's context of 64"):
        check_budget(config, 60, 5)
