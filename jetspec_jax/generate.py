"""`generate`, `generate_batch`, `generate_as_completed` and `stream`: the public entry points of
decoding.

Thin uses of `DecodeSession` (decoding/session.py), which validates requests, buckets shapes and
runs the compiled prefill and decode loop. `generate_batch` runs the loop to the end in one call
(no host round trip until the results); `generate_as_completed` decodes any number of prompts a
batch of rows at a time, each finished row taking the next prompt (continuous batching), and
yields each result as it completes; `stream` runs the loop in chunks of `chunk_steps` target
forwards and yields each chunk's new tokens as soon as it is on the host.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Iterator, Sequence

import tqdm

from jetspec_jax.console import bar_disabled
from jetspec_jax.decoding.buckets import bucket
from jetspec_jax.decoding.continuous import ContinuousBatch
from jetspec_jax.decoding.options import METHODS, DecodingOptions
from jetspec_jax.decoding.request_checks import (
    check_budgets,
    check_int,
    check_prompts,
    check_token_ids,
    row_sampling,
)
from jetspec_jax.decoding.results import GenerationResult, Timing
from jetspec_jax.decoding.session import GREEDY, DecodeSession
from jetspec_jax.sampling import SamplingParams
from jetspec_jax.target import Target, check_is_target

__all__ = [
    "METHODS",
    "DecodingOptions",
    "GenerationResult",
    "TokenStream",
    "Timing",
    "generate",
    "generate_as_completed",
    "generate_batch",
    "stream",
]

# Target forwards between progress-bar updates (one host round trip each).
PROGRESS_CHUNK_STEPS = 8
_OPTION_FIELDS = tuple(field.name for field in dataclasses.fields(DecodingOptions))


def decoding_options(decoding: dict) -> DecodingOptions:
    """The `DecodingOptions` of an entry point's `**decoding` keyword arguments.

    Raises:
        TypeError: a keyword that is no `DecodingOptions` field (a misspelled argument), listing
            the fields.
    """
    unknown = sorted(set(decoding) - set(_OPTION_FIELDS))
    if unknown:
        raise TypeError(
            f"unexpected keyword arguments {', '.join(map(repr, unknown))}: besides its own "
            "arguments, an entry point takes those of DecodingOptions "
            f"({', '.join(_OPTION_FIELDS)})"
        )
    return DecodingOptions(**decoding)


def generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    draft=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    **decoding,
) -> GenerationResult:
    """Generates a continuation of one prompt.

    Args:
        target: a loaded target (`load_target`).
        prompt_ids: the prompt's token ids (a non-empty list of ints, or a 1-D integer array).
        draft: the draft head of speculative methods (`load_draft`, `init_draft`); None for "ar".
        max_new_tokens: at most this many new tokens (>= 1).
        temperature: 0 for greedy decoding, >= `sampling.MIN_TEMPERATURE` (1e-5) to sample.
        top_p: nucleus sampling mass in [0, 1]; 1 disables, 0 keeps only the most likely token.
        top_k: keep the k most likely tokens; 0 disables.
        seed: random seed of the request, in [0, 2**32); the same seed gives the same tokens.
        stop_token_ids: stop after generating any of these; None uses the target's end-of-sequence
            ids, [] disables stopping.
        **decoding: how to decode, the fields of `jetspec_jax.DecodingOptions`: `method` ("ar",
            autoregressive, by default; the speculative methods "dflash", "jetspec",
            "jetspec++" give the same tokens with fewer target forwards), `block_size` (shorter
            blocks than trained), `prefill_chunk` (longer prompts are prefilled that many tokens
            at a time), and JetSpec++'s `Jj-Rr` refinement and foresight (`refine_passes`,
            `refreshes`, `replacement_confidence`, `foresight`, `foresight_rule`, `pipeline`).

    Returns:
        A `GenerationResult`.

    Raises:
        TypeError: `target` is not a `Target`, or a keyword is neither an argument here nor a
            `DecodingOptions` field.
        ValueError: a bad value, naming it.
    """
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    session = _one_prompt_session(
        target, prompt_ids, draft, max_new_tokens, sampling, stop_token_ids, decoding
    )
    (result,) = run_to_the_end(session, show_progress=False)
    return result


def _one_prompt_session(
    target, prompt_ids, draft, max_new_tokens, sampling: dict, stop_token_ids, decoding: dict
) -> DecodeSession:
    """The checked session of `generate` and `stream` (their arguments): one prompt, sampled
    with the `SamplingParams` fields `sampling`, its seed as given."""
    check_is_target(target)
    # Checked as one prompt here: wrapped first, an int would read as a batch of one id.
    prompt_ids = check_token_ids(prompt_ids, target.config.vocab_size)  # an iterator is read
    return DecodeSession(
        target,
        [prompt_ids],
        draft=draft,
        options=decoding_options(decoding),
        max_new_tokens=max_new_tokens,
        # One per row: the seed as given (one for all rows would be mixed with the row index).
        sampling=[SamplingParams(**sampling)],
        stop_token_ids=stop_token_ids,
    )


def generate_batch(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    draft=None,
    max_new_tokens: int | Sequence[int] = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    stop_token_ids: Sequence[int] | None = None,
    show_progress: bool | None = False,
    **decoding,
) -> list[GenerationResult]:
    """Generates continuations of several prompts of any lengths in one batched decode loop.

    Each row's tokens equal those of generating it alone (greedy, and sampled with its seed), and
    for every method equal those of "ar", up to floating-point differences: another batch size,
    bucketed prompt length or forward shape (block vs single-token, see `DecodingOptions.method`)
    means other shapes for XLA, which may round differently and flip a near-tie.

    Args:
        target: a loaded target.
        prompts: one prompt per request, each a list of token ids (or a 1-D integer array);
            a single prompt is `[prompt_ids]` (or use `generate`).
        draft, stop_token_ids, **decoding: as in `generate`, shared by all rows.
        max_new_tokens: one budget for all rows, or one per row (each >= 1).
        sampling: one `SamplingParams` for all rows (row i draws with the seed
            `sampling.row_seed(seed, i)`, so rows are independent samples), or one per row
            (each with its own seed, as given).
        show_progress: a tqdm bar over the generated tokens (None: only on a terminal). With a
            bar, the loop returns to the host every `PROGRESS_CHUNK_STEPS` target forwards to
            update it; without one it runs to the end in one call.

    Returns:
        One `GenerationResult` per prompt, in order.

    Raises:
        TypeError: `target` is not a `Target`, or a keyword is neither an argument here nor a
            `DecodingOptions` field.
        ValueError: a bad value, naming it (a prompt by its index), or a per-row
            `max_new_tokens` or `sampling` whose length is not the number of prompts.
    """
    check_is_target(target)
    session = DecodeSession(
        target,
        prompts,
        draft=draft,
        options=decoding_options(decoding),
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_token_ids=stop_token_ids,
    )
    return run_to_the_end(session, show_progress)


def run_to_the_end(session: DecodeSession, show_progress: bool | None) -> list[GenerationResult]:
    """Decodes every row of a new session to its end; see `generate_batch`'s `show_progress`."""
    bar = _progress_bar(sum(session.max_new_tokens), "tok", show_progress)
    if bar.disable:
        session.start()
        session.advance()  # to the end: every forward commits >= 1 token per unfinished row
        return session.results()
    with bar:
        for rows in session.chunks(PROGRESS_CHUNK_STEPS):
            bar.update(sum(map(len, rows)))
        bar.total = bar.n  # rows that stopped early leave their budget unused
    return session.results()


def _progress_bar(total: int, unit: str, show_progress: bool | None) -> tqdm.tqdm:
    """A tqdm bar, disabled unless `show_progress` (None: shown only on a terminal)."""
    return tqdm.tqdm(total=total, unit=unit, desc="generating", disable=bar_disabled(show_progress))


def generate_as_completed(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    draft=None,
    max_new_tokens: int | Sequence[int] = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    stop_token_ids: Sequence[int] | None = None,
    max_batch_size: int = 8,
    chunk_steps: int = 16,
    show_progress: bool | None = False,
    **decoding,
) -> Iterator[tuple[int, GenerationResult]]:
    """Generates any number of prompts, `max_batch_size` rows at a time (rounded up to a power
    of two), with continuous batching: every `chunk_steps` target forwards, each row whose
    prompt finished takes the next prompt (prefilled alone, `DecodeSession.admit`), so that no
    row idles while a batch's longest response finishes. Prompts start longest first (prompt
    plus budget), so that every later one fits the shapes of the batch it joins; one that does
    not (a longer budget) starts a new batch once the running one ends.

    Joiners are prefilled one by one, not together as the server does (`admit_many`): a group
    prefill compiles once per group size and prompt bucket, and a long offline run with large
    batches (many joiners per boundary, so many group sizes) would pay those compilations with
    no warm-up to take them; one-row prefills compile once per prompt bucket.

    Each result is what `generate_batch` gives its prompt (the same per-prompt seeds), up to the
    floating-point caveat there.

    Args:
        target, prompts, draft, max_new_tokens, sampling, stop_token_ids, **decoding: as in
            `generate_batch`.
        max_batch_size: rows decoded at once (>= 1).
        chunk_steps: target forwards between two looks at the rows (>= 1): finished rows wait up
            to this many forwards for their next prompt.
        show_progress: a tqdm bar over the prompts, advanced as each finishes (None: only on a
            terminal).

    Returns:
        An iterator of `(index into prompts, GenerationResult)`, in the order the prompts
        finish. The requests are validated before it is returned; decoding runs as it is
        consumed.

    Raises:
        TypeError: `target` is not a `Target`, or a keyword is neither an argument here nor a
            `DecodingOptions` field.
        ValueError: a bad value, naming it (a prompt by its index), or a per-row
            `max_new_tokens` or `sampling` whose length is not the number of prompts; raised by
            the call, before any decoding.
    """
    check_is_target(target)
    options = decoding_options(decoding)
    rows = bucket(check_int("max_batch_size", max_batch_size, 1), minimum=1)
    chunk_steps = check_int("chunk_steps", chunk_steps, 1)
    config = target.config
    prompts = check_prompts(prompts, config.vocab_size)
    budgets = check_budgets(config, prompts, max_new_tokens)
    sampling = row_sampling(sampling, len(prompts))
    session_args = dict(draft=draft, options=options, stop_token_ids=stop_token_ids)
    # One row alone validates the pairing of draft and options and the stop ids now; its stop
    # ids, read once, serve every batch (an iterator given would be spent by this session).
    checked = DecodeSession(target, prompts[:1], max_new_tokens=1, **session_args)
    session_args["stop_token_ids"] = checked.stop_token_ids
    sizes = [(len(p), n) for p, n in zip(prompts, budgets, strict=True)]
    longest_first = sorted(range(len(prompts)), key=lambda i: -sum(sizes[i]))

    def decode() -> Iterator[tuple[int, GenerationResult]]:
        with _progress_bar(len(prompts), "prompt", show_progress) as bar:
            for finished in decode_all():
                bar.update(1)
                yield finished

    def decode_all() -> Iterator[tuple[int, GenerationResult]]:
        waiting = deque(longest_first)
        while waiting:
            first = [waiting.popleft() for _ in range(min(rows, len(waiting)))]
            session = DecodeSession(
                target,
                [prompts[i] for i in first],
                max_new_tokens=[budgets[i] for i in first],
                sampling=[sampling[i] for i in first],
                **session_args,
            )
            batch = ContinuousBatch(session, first)
            batch.start()
            while True:
                batch.poll()
                yield from batch.take_finished()
                joined = False
                while batch.free_rows and waiting and batch.fits(*sizes[waiting[0]]):
                    i = waiting.popleft()
                    batch.admit(i, prompts[i], max_new_tokens=budgets[i], sampling=sampling[i])
                    joined = True
                if joined:
                    continue  # polled before decoding on: a budget of 1 is done at its prefill
                if batch.done:
                    break
                batch.advance(chunk_steps)

    return decode()


class TokenStream:
    """An iterator over the new tokens of one prompt, chunk by chunk (see `stream`).

    Iterating yields non-empty lists of token ids; their concatenation is
    `generate(...).tokens`. Once exhausted, `result` holds the `GenerationResult` (tau, timing).
    """

    def __init__(self, session: DecodeSession, chunk_steps: int):
        self._session: DecodeSession | None = session  # None once exhausted or closed
        self._chunk_steps = chunk_steps
        self.result: GenerationResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> list[int]:
        # Each step reads the session's state afresh (no generator, which an exception would
        # end): after an exception inside a step (Ctrl-C during a chunk), iterating again goes
        # on from where the device got to, its tokens still to come.
        while (session := self._session) is not None:
            if not session.started:
                session.start()
            elif session.done:
                self.result = session.results()[0]
                self.close()
                break
            else:
                session.advance(self._chunk_steps)
            (chunk,) = session.poll()
            if chunk:
                return chunk
        raise StopIteration

    def close(self) -> None:
        """Stops decoding early; `result` then holds the tokens so far ("cancelled"), or stays
        None if no chunk was requested (decoding never started)."""
        session = self._session
        if session is None:
            return
        if self.result is None and session.started:
            session.cancel(0)
            self.result = session.results()[0]
        # The session holds the row's device state (its cache, sized by the prompt and the
        # budget): a stream kept for its `result` must not keep that on the device.
        self._session = None


def stream(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    chunk_steps: int = 8,
    draft=None,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    **decoding,
) -> TokenStream:
    """Generates like `generate`, yielding the new tokens as they are produced.

    The prefill's first token comes first, then the tokens of every `chunk_steps` target forwards
    (AR: `chunk_steps` tokens; speculative: `chunk_steps` verification rounds, 1..K tokens each).
    Each chunk is one host round trip; within a chunk the loop stays on the device. The tokens are
    exactly `generate(...)`'s.

    Args:
        chunk_steps: target forwards per chunk (>= 1); larger chunks mean fewer round trips and
            coarser streaming.
        the rest: as in `generate`. Requests are validated here, before the first token.

    Returns:
        A `TokenStream`; after it is exhausted, `.result` is the `GenerationResult`.

    Raises:
        TypeError: `target` is not a `Target`, or a keyword is neither an argument here nor a
            `DecodingOptions` field.
        ValueError: a bad value (`chunk_steps` included), naming it; raised by the call, before
            the first token.
    """
    chunk_steps = check_int("chunk_steps", chunk_steps, 1)  # a 0-d array as a plain int
    sampling = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    session = _one_prompt_session(
        target, prompt_ids, draft, max_new_tokens, sampling, stop_token_ids, decoding
    )
    return TokenStream(session, chunk_steps)
