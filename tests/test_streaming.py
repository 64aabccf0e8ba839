"""Decoding sessions in chunks: streamed tokens equal `generate`, ragged speculative batches, and
incremental detokenization across chunk boundaries."""

from __future__ import annotations

import gc
import types

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import jetspec_jax
from jetspec_jax import DecodingOptions
from jetspec_jax.decoding import session as session_module
from jetspec_jax.decoding.compiled import CompiledCache, signature
from jetspec_jax.decoding.session import COMPILED, DecodeSession
from jetspec_jax.serving.detokenize import IncrementalDetokenizer, StopStrings
from tests.oracles import OracleDraft
from tests.text_fixtures import metaspace_tokenizer

# All sessions here share the smallest buckets (prompt 16, output 16) to compile few executables.
N_NEW = 16


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 97, n).tolist() for n in (11, 4, 15)]


def _ar(target, prompt, n=N_NEW, **kwargs):
    return jetspec_jax.generate(target, prompt, max_new_tokens=n, stop_token_ids=[], **kwargs)


# 2**40: past every budget and int32; a 0-d array: taken as its int, as `check_int` takes it.
@pytest.mark.parametrize("chunk_steps", [1, 5, 2**40, np.array(5)], ids=["1", "5", "2**40", "0-d"])
def test_stream_chunks_concatenate_to_generate(target, prompts, chunk_steps):
    for prompt, kwargs in ((prompts[0], {}), (prompts[1], dict(temperature=1.0, seed=4))):
        expected = _ar(target, prompt, **kwargs)
        stream = jetspec_jax.stream(
            target,
            prompt,
            chunk_steps=chunk_steps,
            max_new_tokens=N_NEW,
            stop_token_ids=[],
            **kwargs,
        )
        chunks = list(stream)
        assert all(chunks)  # no empty chunk is yielded
        assert chunks[0] == expected.tokens[:1]  # the prefill's token comes alone
        assert all(len(c) <= chunk_steps for c in chunks[1:])  # AR: one token per forward
        assert sum(chunks, []) == expected.tokens
        assert stream.result.tokens == expected.tokens
        assert stream.result.finish_reason == "length"


def test_generate_batch_with_a_progress_bar_gives_the_same_tokens(target, prompts, capsys):
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=5)
    kwargs = dict(draft=draft, method="jetspec++", max_new_tokens=N_NEW, stop_token_ids=[])
    plain = jetspec_jax.generate_batch(target, prompts, **kwargs)
    shown = jetspec_jax.generate_batch(target, prompts, show_progress=True, **kwargs)
    assert [r.tokens for r in shown] == [r.tokens for r in plain]
    total = len(prompts) * N_NEW
    assert f"{total}/{total}" in capsys.readouterr().err  # every generated token counted


def test_speculative_stream_equals_autoregressive(target, prompts):
    """The streamed tokens are AR's, and the stream's rounds are `generate`'s with the same
    settings: its acceptance lengths, outcomes and tau."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=5)
    settings = dict(
        draft=draft, method="jetspec++", refine_passes=1, max_new_tokens=N_NEW, stop_token_ids=[]
    )
    stream = jetspec_jax.stream(target, prompts[2], chunk_steps=2, **settings)
    chunks = list(stream)
    assert all(len(c) <= 2 * 4 for c in chunks[1:])  # <= K tokens per round
    assert sum(chunks, []) == _ar(target, prompts[2]).tokens
    whole = jetspec_jax.generate(target, prompts[2], **settings)
    assert max(whole.acceptance_lengths) > 1  # a draft is accepted: a tau of 1 would differ
    assert stream.result.acceptance_lengths == whole.acceptance_lengths
    assert stream.result.outcomes == whole.outcomes
    assert stream.result.tau == whole.tau


def test_closing_a_stream_cancels_it(target, prompts):
    stream = jetspec_jax.stream(
        target, prompts[0], chunk_steps=2, max_new_tokens=N_NEW, stop_token_ids=[]
    )
    got = next(stream) + next(stream)
    stream.close()
    assert stream.result.finish_reason == "cancelled"
    assert stream.result.tokens == got == _ar(target, prompts[0]).tokens[: len(got)]
    assert list(stream) == []
    unstarted = jetspec_jax.stream(target, prompts[0], max_new_tokens=N_NEW)
    unstarted.close()  # before any chunk: nothing decoded, nothing to iterate
    assert list(unstarted) == [] and unstarted.result is None


def test_a_stream_kept_for_its_result_holds_no_device_state(target, prompts):
    """Exhausted or closed, a stream kept (for its `result`) holds none of its session's device
    arrays: its cache, sized by the prompt and the budget, would stay on the device per stream."""

    def live() -> int:
        gc.collect()
        return len(jax.live_arrays())

    kwargs = dict(chunk_steps=4, max_new_tokens=N_NEW, stop_token_ids=[])
    list(jetspec_jax.stream(target, prompts[0], **kwargs))  # compiled: its constants stay
    before = live()
    exhausted = jetspec_jax.stream(target, prompts[0], **kwargs)
    list(exhausted)
    closed = jetspec_jax.stream(target, prompts[1], **kwargs)
    next(closed)
    closed.close()
    assert live() == before
    assert exhausted.result.finish_reason == "length" and list(exhausted) == []
    assert closed.result.finish_reason == "cancelled" and list(closed) == []
    closed.close()  # again: a no-op


def test_stream_validates_before_the_first_token(target):
    with pytest.raises(ValueError, match="exceeds the model's context"):
        jetspec_jax.stream(target, [1] * 2040, max_new_tokens=16)
    with pytest.raises(ValueError, match="chunk_steps"):
        jetspec_jax.stream(target, [1], chunk_steps=0)


def _oracle_session(target, prompts, continuation, max_new_tokens):
    """A JetSpec session whose draft proposes `continuation` (`[4, 64]` tokens by position)."""
    draft = OracleDraft(continuation, block_size=4, vocab_size=97)
    options = DecodingOptions("jetspec")
    return DecodeSession(
        target,
        prompts,
        draft=draft,
        options=options,
        max_new_tokens=max_new_tokens,
        stop_token_ids=[],
    )


def test_ragged_speculative_batch_in_chunks_equals_each_row_alone(target, prompts):
    """Rows accept different numbers of drafts per round (an oracle right for row 0, right for a
    while for row 1, wrong for row 2) and have different budgets, so they finish at different
    rounds; decoded in chunks of one round, each row still equals AR decoding alone."""
    budgets = [16, 12, 7]
    alone = [_ar(target, p, n).tokens for p, n in zip(prompts, budgets, strict=True)]
    continuation = np.zeros((4, 64), np.int32)  # one row per batch row (bucket 4)
    for row, (prompt, tokens) in enumerate(zip(prompts, alone, strict=True)):
        sequence = prompt + tokens
        if row == 1:
            sequence = sequence[: len(prompt) + 6]  # right for 6 tokens, then zeros
        if row < 2:
            continuation[row, : len(sequence)] = sequence
    session = _oracle_session(target, prompts, continuation, budgets)
    streamed = [[] for _ in prompts]
    finished_after = [None] * 3
    for step, chunk in enumerate(session.chunks(chunk_steps=1)):
        for row, tokens in enumerate(chunk):
            streamed[row] += tokens
            if session.row_done[row] and finished_after[row] is None:
                finished_after[row] = step
    results = session.results()
    for row in range(3):
        assert streamed[row] == results[row].tokens == alone[row]
        assert sum(results[row].acceptance_lengths) == budgets[row]
    accepted = [[k for k, _ in r.outcomes] for r in results]
    assert all(k == 3 for k in accepted[0][:-1])  # the oracle row accepts every draft
    assert max(accepted[2]) < 3 and accepted[1][0] == 3  # ragged: rows accept differently
    assert len(set(finished_after)) == 3  # and finish in different rounds


def test_cancelled_row_stops_while_the_others_go_on(target, prompts):
    session = DecodeSession(target, prompts, max_new_tokens=N_NEW, stop_token_ids=[])
    session.start()
    session.poll()
    session.advance(2)
    session.poll()
    session.cancel(1)
    assert session.row_done == [False, True, False] and not session.done  # before any poll
    session.advance()
    session.poll()
    results = session.results()
    assert [r.finish_reason for r in results] == ["length", "cancelled", "length"]
    assert len(results[1].tokens) == 3
    assert results[1].tokens == _ar(target, prompts[1]).tokens[:3]
    assert results[0].tokens == _ar(target, prompts[0]).tokens


def test_a_cancelled_row_of_a_speculative_session_stops(target, prompts):
    """The done flag is written into the speculative state's decode state: an oracle's rounds
    would otherwise commit 4 tokens a round to the cancelled row too."""
    expected = [_ar(target, prompt).tokens for prompt in prompts]
    continuation = np.zeros((4, 64), np.int32)
    for row, (prompt, tokens) in enumerate(zip(prompts, expected, strict=True)):
        continuation[row, : len(prompt) + N_NEW] = prompt + tokens
    session = _oracle_session(target, prompts, continuation, N_NEW)
    session.start()
    session.poll()
    session.cancel(1)
    session.advance()
    session.poll()
    results = session.results()
    assert [r.finish_reason for r in results] == ["length", "cancelled", "length"]
    assert results[1].tokens == expected[1][:1]  # the prefill's token only
    assert [results[0].tokens, results[2].tokens] == [expected[0], expected[2]]


def test_cancelling_a_row_that_finished_since_the_last_poll_keeps_its_reason(target, prompts):
    session = DecodeSession(target, prompts, max_new_tokens=[N_NEW, 2, N_NEW], stop_token_ids=[])
    session.start()
    session.poll()
    session.advance(4)  # row 1 reaches its budget of 2 here, unseen by `poll`
    session.cancel(1)
    session.advance()
    session.poll()
    assert [r.finish_reason for r in session.results()] == ["length", "length", "length"]


def test_results_read_mid_decode_name_unfinished_rows_and_bad_calls_are_refused(target, prompts):
    session = DecodeSession(
        target, prompts, max_new_tokens=np.asarray([N_NEW, 2, N_NEW]), stop_token_ids=[]
    )
    session.start()
    for bad in (2.7, True, "3"):
        with pytest.raises(ValueError, match="max_steps must be an integer"):
            session.advance(bad)
    session.advance(np.int64(2))
    session.poll()
    assert [r.finish_reason for r in session.results()] == [None, "length", None]
    for bad in (True, 1.0):
        with pytest.raises(ValueError, match="row must be an integer"):
            session.cancel(bad)
    session.cancel(np.int64(0))
    assert session.results()[0].finish_reason == "cancelled"
    # One row's result alone is that row of `results()`.
    assert [session.result(row) for row in range(3)] == session.results()
    for bad in (3, -1, True):
        with pytest.raises(ValueError, match="row"):
            session.result(bad)
    with pytest.raises(ValueError, match="sampling must be a SamplingParams or one per prompt"):
        DecodeSession(target, prompts, sampling=None)


def test_one_rows_result_is_read_by_one_program_not_an_eager_slice_per_array(
    target, prompts, monkeypatch
):
    """`ContinuousBatch.take_finished` reads each finished row with `result(row)`: the row of
    its outputs (eight arrays of a speculative state) is picked by one compiled program, not by
    an eager slice of each array (a dispatch each: 4-12x the time of the one program)."""
    session = _oracle_session(target, prompts, np.zeros((4, 64), np.int32), N_NEW)
    session.start()
    session.advance()
    session.poll()
    session.result(0)  # compiles the pick
    sliced = []
    array_type = type(session._state.decode.output)
    getitem = array_type.__getitem__
    monkeypatch.setattr(array_type, "__getitem__", lambda x, i: sliced.append(i) or getitem(x, i))
    rows = [session.result(row) for row in range(3)]
    assert sliced == []
    monkeypatch.undo()
    assert rows == session.results()


def test_per_row_budgets_with_a_progress_bar_and_a_generator_of_prompts(target, prompts, capsys):
    budgets = [3, N_NEW, 1]
    results = jetspec_jax.generate_batch(
        target,
        (p for p in prompts),
        max_new_tokens=budgets,
        stop_token_ids=[],
        show_progress=True,
    )
    assert [len(r.tokens) for r in results] == budgets
    assert f"{sum(budgets)}/{sum(budgets)}" in capsys.readouterr().err
    chunks = jetspec_jax.stream(
        target, prompts[0], chunk_steps=np.int64(4), max_new_tokens=N_NEW, stop_token_ids=[]
    )
    assert sum(chunks, []) == _ar(target, prompts[0]).tokens


def test_a_budget_of_one_token_decodes_nothing_after_the_prefill(target, prompts):
    session = DecodeSession(target, prompts, max_new_tokens=1, stop_token_ids=[])
    session.start()
    compiled = session.timing.compile_seconds
    session.advance()
    assert session.timing == session.timing.__class__(session.timing.prefill_seconds, 0.0, compiled)
    assert [r.tokens for r in session.results()] == [_ar(target, p, n=1).tokens for p in prompts]


def _interrupt_the_next_wait(monkeypatch) -> None:
    """Ctrl-C once, in the next wait for the device (after the step's program has started)."""
    wait = jax.block_until_ready

    def interrupted(tree):
        monkeypatch.setattr(jax, "block_until_ready", wait)
        raise KeyboardInterrupt

    monkeypatch.setattr(jax, "block_until_ready", interrupted)


def test_an_advance_interrupted_while_it_waits_leaves_the_session_usable(
    target, prompts, monkeypatch
):
    """Ctrl-C during `advance`'s wait for the device (the loop's input state already donated):
    the session keeps the state the loop computes, and decodes on to AR's tokens."""
    session = DecodeSession(target, prompts, max_new_tokens=N_NEW, stop_token_ids=[])
    session.start()
    session.poll()
    _interrupt_the_next_wait(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        session.advance(2)
    session.poll()
    session.advance()
    session.poll()
    assert [r.tokens for r in session.results()] == [_ar(target, p).tokens for p in prompts]


def test_a_stream_interrupted_inside_a_chunk_goes_on_when_iterated_again(
    target, prompts, monkeypatch
):
    """Ctrl-C inside a chunk's step ends no stream: iterated again, it yields the tokens the
    device went on to commit, and then the rest, to `generate`'s tokens and result."""
    stream = jetspec_jax.stream(
        target, prompts[0], chunk_steps=2, max_new_tokens=N_NEW, stop_token_ids=[]
    )
    got = next(stream)
    _interrupt_the_next_wait(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        next(stream)
    got += sum(stream, [])
    assert got == stream.result.tokens == _ar(target, prompts[0]).tokens
    assert stream.result.finish_reason == "length"


def test_a_session_whose_state_a_failed_step_consumed_says_so(target, prompts, monkeypatch):
    """A step that fails after its program took the (donated) state, as a device error does:
    every later call says the state was lost, not that some array was deleted."""
    session = DecodeSession(target, prompts, max_new_tokens=N_NEW, stop_token_ids=[])
    session.start()
    session.advance(2)  # compiled: the failing call below runs the loop
    session.poll()
    get = COMPILED.get

    def failing(fn, *args, **static):
        run, seconds = get(fn, *args, **static)

        def run_and_fail(*inputs):
            run(*inputs)
            raise RuntimeError("device failure")

        return run_and_fail, seconds

    monkeypatch.setattr(COMPILED, "get", failing)
    with pytest.raises(RuntimeError, match="device failure"):
        session.advance(2)
    monkeypatch.setattr(COMPILED, "get", get)
    calls = [session.poll, session.results, lambda: session.result(0), lambda: session.cancel(0)]
    calls += [lambda: session.advance(2), lambda: session.admit(1, [1], max_new_tokens=1)]
    for call in calls:
        with pytest.raises(RuntimeError, match="state was lost.*in a new session"):
            call()


def test_a_chunked_decode_passes_one_step_count_array(target, prompts, monkeypatch):
    """Every chunk of a count passes the same device scalar for it (made once per session and
    count): a new `jnp.int32` per chunk is a transfer and an eager dispatch at each boundary."""
    session = DecodeSession(target, prompts, max_new_tokens=N_NEW, stop_token_ids=[])
    session.start()
    get, counts = COMPILED.get, []

    def recording(fn, *args, **static):
        counts.append(args[-1])  # the loop's `max_steps`
        return get(fn, *args, **static)

    monkeypatch.setattr(COMPILED, "get", recording)
    for steps in (2, 2, 3, 2):
        session.advance(steps)
    assert [int(c) for c in counts] == [2, 2, 3, 2]
    assert counts[0] is counts[1] is counts[3] and counts[2] is not counts[0]
    monkeypatch.setattr(COMPILED, "get", get)
    session.advance()  # to the end: the tokens are those of one uninterrupted decode
    expected = DecodeSession(target, prompts, max_new_tokens=N_NEW, stop_token_ids=[])
    expected.start()
    expected.advance()
    assert [r.tokens for r in session.results()] == [r.tokens for r in expected.results()]


def test_a_compiled_cache_hit_hashes_its_key_once():
    """A hit looks the key up once: hashing it walks every argument's shape, dtype and sharding
    (dozens of leaves, at every chunk boundary)."""

    class Sharding:
        hashes = 0

        def __hash__(self):
            Sharding.hashes += 1
            return 0

    class Leaf:
        shape, dtype, sharding = (2,), np.dtype(np.int32), Sharding()

    class Fn:
        __name__ = "fn"

        def lower(self, *args, **static):
            return types.SimpleNamespace(compile=lambda: "executable")

    cache, fn, leaf = CompiledCache(), Fn(), Leaf()
    assert cache.get(fn, leaf, size=1)[0] == "executable"  # compiled: a miss
    Sharding.hashes = 0
    assert cache.get(fn, leaf, size=1) == ("executable", 0.0)
    assert Sharding.hashes == 1


def test_a_compiled_cache_keys_on_the_static_arguments_and_the_arguments_tree():
    """One executable per static-argument value and per argument structure: leaves of the same
    shapes under another tree (a dict for a tuple) or another static value are another program,
    not a hit on the first one's."""
    lowered = []

    class Fn:
        __name__ = "fn"

        def lower(self, *args, **static):
            lowered.append((jax.tree.structure(args), static))
            return types.SimpleNamespace(compile=lambda: len(lowered))

    cache, fn, x = CompiledCache(), Fn(), np.zeros(2, np.int32)
    assert cache.get(fn, (x, x), size=1)[0] == 1
    assert cache.get(fn, (x, x), size=2)[0] == 2
    assert cache.get(fn, {"a": x, "b": x}, size=1)[0] == 3
    assert cache.get(fn, (x, x), size=2) == (2, 0.0)  # a hit


def test_a_compiled_cache_keys_on_the_signatures_a_caller_gives():
    """Signatures a caller keeps are the key as given: nothing is read from the arguments (the
    weights' hundreds of leaves, at every chunk), and the same key computed here is a hit."""

    class Leaf:
        reads = 0
        dtype, sharding = np.dtype(np.int32), None

        @property
        def shape(self):
            Leaf.reads += 1
            return (2,)

    class Fn:
        __name__ = "fn"
        compiled = 0

        def lower(self, *args, **static):
            Fn.compiled += 1
            return types.SimpleNamespace(compile=lambda: Fn.compiled)

    cache, fn, leaf = CompiledCache(), Fn(), Leaf()
    signed = signature(leaf)
    Leaf.reads = 0
    assert cache.get(fn, leaf, signatures=[signed], size=1)[0] == 1
    assert Leaf.reads == 0
    assert cache.get(fn, leaf, size=1) == (1, 0.0)  # computed here: the same key
    assert cache.get(fn, leaf, signatures=[signature(np.zeros(3))], size=1)[0] == 2


@pytest.mark.parametrize("method", ["ar", "jetspec++"])
def test_a_session_signs_its_weights_once(target, prompts, method, monkeypatch):
    """The weights' signatures are computed at the session's first program and kept: every later
    chunk and admission computes only its own inputs' (for a real model, the weights' hundreds of
    leaves were most of the compiled-program lookup's host time at each chunk boundary)."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=5)
    settings = dict(options=DecodingOptions(method), max_new_tokens=N_NEW, stop_token_ids=[])
    if method != "ar":
        settings["draft"] = draft
    signed = []

    def recording(tree):
        signed.append(tree)
        return signature(tree)

    monkeypatch.setattr(session_module, "signature", recording)
    session = DecodeSession(target, prompts, **settings)
    session.start()
    for _ in range(3):
        session.advance(2)
    session.admit(3, prompts[0], max_new_tokens=2)  # the padding row
    session.advance()
    assert sum(tree is target.params for tree in signed) == 1
    weights = 1 if method == "ar" else 2  # the target's, the proposer's
    assert len(signed) == weights + 3 + 4 * 3 + 3  # then the inputs of 2 prefills, 4 chunks
    monkeypatch.undo()
    expected = DecodeSession(target, prompts, **settings)
    expected.start()
    expected.advance(6)
    expected.admit(3, prompts[0], max_new_tokens=2)
    expected.advance()
    assert [r.tokens for r in session.results()] == [r.tokens for r in expected.results()]


def _byte_level_tokenizer():
    """Byte-level BPE over the 256 byte symbols, no merges: a non-ASCII character spans tokens."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(
        models.BPE(vocab={c: i for i, c in enumerate(sorted(alphabet))}, merges=[])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


@pytest.mark.parametrize("make", [_byte_level_tokenizer, metaspace_tokenizer])
def test_incremental_detokenizer_is_correct_across_chunk_boundaries(make):
    tokenizer = make()
    text = "héllo wörld, naïve café ☕ über" if make is _byte_level_tokenizer else "hello big world"
    ids = tokenizer.encode(text)
    expected = tokenizer.decode(ids)
    assert len(ids) > len(expected.split())  # characters and words span several tokens
    for size in (1, 2, 3):
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.push(ids[i : i + size]) for i in range(0, len(ids), size)]
        deltas.append(detok.flush())
        assert "".join(deltas) == expected
        assert not any("\ufffd" in d for d in deltas)  # no half character is ever emitted


def test_a_continuation_keeps_the_leading_space_its_context_gives_it():
    """Decoded alone, a SentencePiece word drops its leading space: with the prompt as context
    the deltas are what the tokens add to the prompt's text. A context that ends in an incomplete
    character (a token-id prompt cut mid-character) has no text to extend: it is not used."""
    tokenizer = metaspace_tokenizer()
    prompt, completion = tokenizer.encode("The sky is"), tokenizer.encode(" blue")
    assert tokenizer.decode(prompt + completion) == "The sky is blue"
    for size in (1, 2):
        detok = IncrementalDetokenizer(tokenizer, context=prompt)
        deltas = [detok.push(completion[i : i + size]) for i in range(0, len(completion), size)]
        assert "".join(deltas) + detok.flush() == " blue"
    # A long prompt is read from its end only (once per completion, on the server's loop).
    looked_up = []
    counting = _WindowRecorder(tokenizer)
    counting.convert_ids_to_tokens = lambda i: (
        looked_up.append(i) or tokenizer.convert_ids_to_tokens(i)
    )
    detok = IncrementalDetokenizer(counting, context=prompt * 500)
    assert detok.push(completion) + detok.flush() == " blue"
    assert len(looked_up) <= 4 + len(completion)  # its last 4 kept ids, then the pushed ones
    byte_level = _byte_level_tokenizer()
    coffee = byte_level.encode("☕")
    detok = IncrementalDetokenizer(byte_level, context=coffee[:1])
    assert detok.push(coffee[1:] + byte_level.encode("!")) + detok.flush() == "\ufffd\ufffd!"


def _byte_fallback_tokenizer():
    """SentencePiece with byte fallback (Llama's): a character outside the pieces is its UTF-8
    bytes, one `<0xNN>` token each, and the text's leading space is stripped."""
    pieces = (
        ["<unk>", "▁"] + [f"<0x{b:02X}>" for b in range(256)] + [chr(c) for c in range(33, 127)]
    )
    vocab = {p: i for i, p in enumerate(pieces)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>")


def test_a_context_ending_in_a_four_byte_character_still_gives_the_leading_space():
    """The context read from the prompt's end is long enough to hold its last character whole
    (4 byte tokens at most): shorter, it would end mid-character, be dropped, and the
    continuation's first word would lose its leading space."""
    tokenizer = _byte_fallback_tokenizer()
    prompt, completion = tokenizer.encode("Hi 😀"), tokenizer.encode(" there")
    assert tokenizer.convert_ids_to_tokens(prompt)[-4:] == ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>"]
    assert tokenizer.decode(prompt + completion) == "Hi 😀 there"
    detok = IncrementalDetokenizer(tokenizer, context=prompt)
    assert detok.push(completion) + detok.flush() == " there"


def test_a_run_of_invalid_bytes_streams_on_and_characters_stay_whole():
    """A lone continuation byte decodes as U+FFFD for good: only the last 3 tokens (an incomplete
    character's most) are held, so a degenerate loop of them streams instead of waiting for the
    end; a character split over tokens is still never emitted in halves."""
    tokenizer = _byte_level_tokenizer()
    coffee = tokenizer.encode("☕")  # 3 byte tokens
    ids = [coffee[1]] * 40 + tokenizer.encode("a ☕ b") + [coffee[1]] * 5 + coffee + [coffee[1]]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids]
    assert "".join(deltas[:40]).count("\ufffd") >= 40 - 3
    deltas.append(detok.flush())
    assert "".join(deltas) == tokenizer.decode(ids)
    assert "".join(deltas).count("☕") == 2


def test_a_four_byte_character_fed_a_byte_at_a_time_is_emitted_whole():
    """An incomplete character holds up to 3 bytes (the first 3 of an emoji's 4): all 3 byte
    tokens are held back, so no U+FFFD is emitted for a character the next token completes."""
    tokenizer = _byte_level_tokenizer()
    ids = tokenizer.encode("hi 😀 there")
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == "hi 😀 there"
    assert "😀" in deltas


class _WindowRecorder:
    """A tokenizer that records the longest id list it was asked to decode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)

    def decode(self, ids, **kwargs):
        self.longest = max(self.longest, len(ids))
        return self.tokenizer.decode(ids, **kwargs)


@pytest.mark.parametrize("make", [_byte_level_tokenizer, metaspace_tokenizer])
def test_a_run_of_skipped_special_tokens_keeps_the_window_short(make):
    """A sampling loop on a special token that is no stop token (each decodes to nothing when
    skipped) must not grow the decoded window, making each push slower than the last; the text
    is still exactly the whole decode's, spaces around the specials included, and with
    `skip_special_tokens=False` they are text like any other token."""
    tokenizer = make()
    tokenizer.add_tokens(["<|special|>"], special_tokens=True)
    special = tokenizer.convert_tokens_to_ids("<|special|>")
    ids = tokenizer.encode("hello big") + [special] * 300 + tokenizer.encode(" world")
    for skip in (True, False):
        recorder = _WindowRecorder(tokenizer)
        detok = IncrementalDetokenizer(recorder, skip_special_tokens=skip)
        deltas = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert recorder.longest <= 8


@pytest.mark.parametrize("make", [_byte_level_tokenizer, metaspace_tokenizer])
def test_a_run_of_ids_past_the_tokenizers_vocabulary_keeps_the_window_short(make):
    """A model vocabulary padded past the tokenizer's (Qwen3: 151936 ids, 151669 tokens) has ids
    that decode drops, special or not: a sampling loop on one (a random target's padded rows are
    live) must not grow the decoded window either, and the text stays the whole decode's."""
    tokenizer = make()
    padded = len(tokenizer) + 5
    ids = tokenizer.encode("hello big") + [padded] * 300 + tokenizer.encode(" world")
    for skip in (True, False):
        recorder = _WindowRecorder(tokenizer)
        detok = IncrementalDetokenizer(recorder, skip_special_tokens=skip)
        deltas = [detok.push([i]) for i in ids] + [detok.flush()]
        assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
        assert recorder.longest <= 8


def test_stop_strings_cut_the_text_and_hold_back_possible_starts():
    stops = StopStrings(["END", "##"])
    out = [stops.feed(d) for d in ("ab", "cE", "N", "xy#", "z", "E", "ND tail")]
    assert "".join(out) == "abcENxy#z" and stops.hit
    assert out[1] == "c" and out[2] == ""  # "E", then "EN": maybe the start of "END"
    assert stops.feed("more") == "" and stops.flush() == ""
    plain = StopStrings(["END"])
    assert plain.feed("xE") == "x" and plain.flush() == "E" and not plain.hit
    # Two stop strings completed by one delta: the text ends at the one that starts first,
    # whichever is listed first.
    assert StopStrings(["xb", "b"]).feed("axb") == "a"
    assert StopStrings(["b", "xb"]).feed("axb") == "a"


def _cut(stops, deltas):
    cutter = StopStrings(stops)
    return "".join(cutter.feed(d) for d in deltas) + cutter.flush()


def test_the_cut_does_not_depend_on_how_the_text_is_chunked():
    """A stop inside a longer one that started earlier: the shorter, completed first, cuts,
    whether the longer one's end comes in the same delta or a later one."""
    assert _cut(["abcd", "c"], ["xxabcdyy"]) == _cut(["abcd", "c"], ["xxabc", "dyy"]) == "xxab"
    rng = np.random.default_rng(0)
    for _ in range(300):
        text = "".join(rng.choice(list("abc"), rng.integers(0, 12)))
        stops = ["".join(rng.choice(list("abc"), rng.integers(1, 4))) for _ in range(3)]
        whole = _cut(stops, [text])
        cuts = sorted(rng.choice(len(text) + 1, rng.integers(0, 4)))
        deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert _cut(stops, deltas) == whole, (text, stops, deltas)
        assert _cut(stops, list(text)) == whole, (text, stops)
