"""`DecodeSession`: one batch of requests, prefilled once and decoded in resumable chunks.

The host side of decoding, shared by `generate`, streaming and the server:

    DecodeSession(target, prompts, ...)   validate the requests, bucket the shapes, build `Requests`
    .start()                              compiled prefill (each row commits its first token)
    .advance(max_steps)                   the compiled decode loop for at most `max_steps` target
                                          forwards (a dynamic argument: no recompile per chunk)
    .poll()                               the tokens each row committed since the last poll
    .cancel(row)                          stop a row at the next chunk boundary
    .admit(row, prompt, ...)              continuous batching: a new request takes a finished row
                                          (or an unused padding row) of the running batch
    .admit_many(rows, prompts, ...)       several, prefilled together
    .result(row) / .results()             one request's / every request's `GenerationResult`

With `pipeline="mpmd"` the prefill and the loop are `pipeline_mpmd.TwoProgramPipeline`'s (one
program per device, rounds dispatched from the host); otherwise each is one compiled program.

Everything per token stays on the device: a caller that never polls (`generate_batch`) makes no
host round trip until `results()`. Shapes are bucketed (decoding/buckets.py: batch and output
length to powers of two, prompt and context length also to three quarters of them; prompts past
`DecodingOptions.prefill_chunk`, prefilled a chunk at a time, to the context bucket) so that new
requests reuse compiled code; the first use of a bucket compiles ahead of time, is logged, and is
timed apart from prefill and decode.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.decoding.admission import write_rows
from jetspec_jax.decoding.autoregressive import decode_autoregressive
from jetspec_jax.decoding.buckets import bucket, length_bucket, prefill_width
from jetspec_jax.decoding.compiled import CompiledCache, signature
from jetspec_jax.decoding.foresight import foresight_proposer
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.pipeline import (
    decode_loop,
    pipeline_devices,
    replicate,
    replicated_weights,
)
from jetspec_jax.decoding.pipeline_mpmd import TwoProgramPipeline
from jetspec_jax.decoding.prefill import prefill
from jetspec_jax.decoding.request_checks import (
    check_budget,
    check_budgets,
    check_int,
    check_prompts,
    check_reserve,
    check_token_ids,
    per_row,
    row_sampling,
)
from jetspec_jax.decoding.results import GenerationResult, Timing, row_outputs, row_result
from jetspec_jax.decoding.speculative import SpecState, prefill_speculative
from jetspec_jax.decoding.state import Requests
from jetspec_jax.sampling import RowSampling, SamplingParams
from jetspec_jax.scalars import is_integer

GREEDY = SamplingParams()
# One process-wide cache: every session (and every server batch) of a bucket reuses its executables.
COMPILED = CompiledCache()


class DecodeSession:
    """A batch of prompts of any lengths decoded together, in chunks.

    Each row's tokens equal those of decoding it alone (greedy, and sampled with its seed), for
    every method, however the decode is split into chunks: the loop state is resumable and
    randomness is keyed by (seed, position). Equal up to floating-point differences: the batch and
    prompt-length buckets and block vs single-token forwards (`DecodingOptions.method`) change
    the shapes XLA computes with, which may round differently and flip a near-tie.

    Not thread-safe: one thread drives a session.
    """

    def __init__(
        self,
        target,
        prompts: Sequence[Sequence[int]],
        *,
        draft=None,
        options: DecodingOptions | None = None,
        max_new_tokens: int | Sequence[int] = 128,
        sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
        stop_token_ids: Sequence[int] | None = None,
        pad_batch_to: int = 1,
        reserve_prompt_tokens: int = 0,
        reserve_new_tokens: int = 0,
    ):
        """Validates the requests and builds the bucketed inputs (no compilation yet).

        Args:
            target: a loaded `Target`.
            prompts: one prompt per request (row): a list of token ids or a 1-D integer array.
            draft: the draft head of speculative methods; None for "ar".
            options: the method and its settings, shared by all rows; None: `DecodingOptions()`
                ("ar").
            max_new_tokens: one budget for all rows, or one per row (each >= 1).
            sampling: one `SamplingParams` for all rows (row i draws with the seed
                `sampling.row_seed(seed, i)`, so rows are independent samples), or one per row
                (each with its own seed, as given).
            stop_token_ids: shared by all rows; None: the target's end-of-sequence ids; [] never
                stops early.
            pad_batch_to: pad the batch to at least this many rows (>= 1; then to a power of
                two), so that a server compiles one batch shape instead of one per batch size.
            reserve_prompt_tokens, reserve_new_tokens: size the cache and the output buffer for
                at least a prompt of this many tokens with this budget (>= 0, together within
                the model's context), so that such requests can be `admit`ted later however
                small the first batch's are (continuous batching). Memory grows with them; the
                first batch's prefill keeps its own prompt bucket.

        Raises:
            ValueError: naming what is wrong with the request.
        """
        config = target.config
        self._target = target
        options = DecodingOptions() if options is None else options
        if not isinstance(options, DecodingOptions):
            raise ValueError(f"options must be a DecodingOptions, got {type(options).__name__}")
        self._proposer, self._proposer_params = resolve_proposer(target, draft, options)
        self._pipeline = options.pipeline
        self._prefill_chunk = options.prefill_chunk
        self._two_programs = None  # the MPMD pipeline's stage placement, built at start
        prompts = check_prompts(prompts, config.vocab_size)
        budgets = check_budgets(config, prompts, max_new_tokens)
        sampling = row_sampling(sampling, len(prompts))
        stops = target.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stop_token_ids = tuple(
            check_token_ids(
                stops, config.vocab_size, what="stop_token_ids", allow_empty=True, ordered=False
            )
        )
        pad_to = check_int("pad_batch_to", pad_batch_to, 1)
        reserved = check_reserve(config, reserve_prompt_tokens, reserve_new_tokens)

        # Bucketed shapes; padding rows have a zero budget and are done after prefill. The
        # cache holds the context bucket (the reserve's, if longer) plus the output buffer: a
        # slot for every token a row can commit. A final round's block may reach past it (its
        # drafts past the budget, a finished row's frozen forwards): those writes are dropped
        # (`kv_cache.write_layer`), and their logits never commit a token. The first batch
        # prefills its own prompt bucket.
        self.prompt_lengths = [len(p) for p in prompts]
        self._batch = bucket(max(len(prompts), pad_to), minimum=1)
        self._context_bucket = length_bucket(max(*self.prompt_lengths, reserved[0]))
        self._max_output = bucket(max(*budgets, reserved[1]))
        self._capacity = self._context_bucket + self._max_output
        pad_rows = self._batch - len(prompts)
        self._inputs, self._requests = self._batch_inputs(
            prompts + [[0]] * pad_rows,
            budgets + [0] * pad_rows,
            sampling + [GREEDY] * pad_rows,
            self._prompt_width(max(self.prompt_lengths)),
        )
        self._budgets = budgets
        self._max_budget = max(budgets)
        self._state = None
        self._polled = [0] * len(prompts)
        self._row_done = [False] * len(prompts)
        self._cancelled: set[int] = set()
        # Per row: (prefill seconds, decode and compile seconds of the session when it joined);
        # None for the rows of the first batch, whose timing is the session's.
        self._joined: list[tuple[float, float, float] | None] = [None] * len(prompts)
        self._prefill_seconds = self._decode_seconds = self._compile_seconds = 0.0
        self._admission_prefill_seconds = 0.0
        self._steps_arrays: dict[int, jax.Array] = {}  # `_steps_array`'s
        self._signed: dict[bool, tuple[tuple, tuple]] = {}  # `_signed_weights`, by `placed`

    def _prompt_width(self, longest: int) -> int:
        """The padded width of a prefill whose longest prompt has `longest` tokens."""
        return prefill_width(longest, self._prefill_chunk, self._context_bucket, self._capacity)

    def _batch_inputs(self, prompts, budgets, sampling, width: int) -> tuple[tuple, Requests]:
        """`((prompts [R, width], lengths [R]), requests)` of R rows."""
        padded = np.zeros((len(prompts), width), np.int32)
        for row, p in enumerate(prompts):
            padded[row, : len(p)] = p
        requests = Requests(
            max_new_tokens=jnp.asarray(budgets, jnp.int32),
            stop_token_ids=jnp.asarray(
                np.tile(_padded_stops(self.stop_token_ids), (len(prompts), 1))
            ),
            sampling=RowSampling.from_params(sampling),
        )
        lengths = np.asarray([len(p) for p in prompts], np.int32)
        return (jnp.asarray(padded), jnp.asarray(lengths)), requests

    @property
    def num_rows(self) -> int:
        """The rows holding requests (batch padding excluded; `admit` may add rows)."""
        return len(self.prompt_lengths)

    @property
    def batch_size(self) -> int:
        """The rows of the compiled batch, padding included: `admit` may use them all."""
        return self._batch

    @property
    def max_new_tokens(self) -> list[int]:
        """Each request's token budget (batch padding excluded)."""
        return list(self._budgets)

    @property
    def started(self) -> bool:
        """`start` has run (the prompts are prefilled)."""
        return self._state is not None

    @property
    def timing(self) -> Timing:
        """Times so far, of the whole session (admitted requests' prefills included)."""
        prefill_seconds = self._prefill_seconds + self._admission_prefill_seconds
        return Timing(prefill_seconds, self._decode_seconds, self._compile_seconds)

    def start(self) -> None:
        """Compiles (once per bucket) and runs the prefill: every row commits its first token.

        Raises:
            RuntimeError: the session has already started.
        """
        if self._state is not None:
            raise RuntimeError("this session has already started")
        state, seconds = self._prefill(*self._inputs, self._requests)
        if self._pipeline == "spmd":
            # Where the pipelined loop keeps its carry, once: no chunk copies the requests again,
            # and rows admitted before the first chunk are written by the programs of those
            # admitted after it (the ones `warm_up` compiles).
            start = time.perf_counter()
            state, self._requests = jax.block_until_ready(replicate((state, self._requests)))
            seconds += time.perf_counter() - start
        else:
            state = _committed(state)
        self._state, self._prefill_seconds = state, seconds

    def _prefill(self, prompts, prompt_lengths, requests) -> tuple[object, float]:
        """`(loop state, prefill seconds)` of `prompts` `[R, T]` (`prompt_lengths` `[R]`)
        prefilled with this session's static sizes (cache capacity, output buffer); compilation
        is added to the session's."""
        if self._pipeline == "mpmd":
            return self._prefill_two_programs(prompts, prompt_lengths, requests)
        sizes = dict(
            config=self._target.config,
            capacity=self._capacity,
            max_output=self._max_output,
            chunk=self._prefill_chunk,
        )
        fn = prefill
        if self._proposer is not None:
            fn, sizes["proposer"] = prefill_speculative, self._proposer
        weights, signatures = self._signed_weights(placed=False)
        inputs = (prompts, prompt_lengths, requests)
        args = (*weights, *inputs)
        signatures = (*signatures, *map(signature, inputs))
        run, compile_seconds = COMPILED.get(fn, *args, signatures=signatures, **sizes)
        self._compile_seconds += compile_seconds
        start = time.perf_counter()
        state = jax.block_until_ready(run(*args))
        state = state[0] if self._proposer is None else state  # AR needs no tap states
        return state, time.perf_counter() - start

    def fits(self, prompt_length: int, max_new_tokens: int) -> bool:
        """Whether a request of this prompt length and budget (each >= 1) can be `admit`ted. The
        session's shapes were sized by its first batch (and the reserve): the output buffer holds
        `max_output` tokens, and the cache a prompt of the context bucket plus that many: a longer
        prompt fits with a budget as much shorter. Both buckets rounded up, the cache may hold
        more than the model's context, which bounds a request all the same (`check_budget`)."""
        room = min(self._capacity, self._target.config.max_position_embeddings)
        return (
            min(prompt_length, max_new_tokens) >= 1
            and max_new_tokens <= self._max_output
            and prompt_length + max_new_tokens <= room
        )

    def admit(
        self,
        row: int,
        prompt: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: SamplingParams = GREEDY,
    ) -> None:
        """Starts a new request in `row` of the running batch (continuous batching): `admit_many`
        of one request.

        Args:
            row: a row whose request had finished at the last `poll` (read its `result` first:
                it is replaced), or `num_rows` while that is below `batch_size` (a padding row
                joins; rows are used in order).
            prompt: the new request's token ids.
            max_new_tokens: its budget, >= 1.
            sampling: its sampling parameters (the seed is used as given).

        Raises:
            as `admit_many`.
        """
        self.admit_many([row], [prompt], max_new_tokens=[max_new_tokens], sampling=[sampling])

    def admit_many(
        self,
        rows: Sequence[int],
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int | Sequence[int],
        sampling: Sequence[SamplingParams] | None = None,
    ) -> None:
        """Starts new requests in rows of the running batch (continuous batching).

        The requests are prefilled together, with the session's static sizes, up to
        `admission_group_size` at a time (each group padded to a power of two of rows, at its
        longest prompt's bucket), and their states are written into their rows
        (`admission.write_rows`): the other rows are untouched, and they decode with them from
        the next `advance` on. Each request's tokens are those of decoding it alone, as for
        every row of a session (see the class docstring); its first token is ready at the next
        `poll`, and `result(row)` is its result from then on. A group's prefill time is each of
        its requests' prefill time.

        Args:
            rows: one per request, distinct: rows whose requests had finished at the last `poll`
                (read their `result` first: they are replaced), or unused padding rows, in
                order from `num_rows` (below `batch_size`).
            prompts: the new requests' token ids, one per row.
            max_new_tokens: one budget for all, or one per row, each >= 1.
            sampling: their sampling parameters, one per row (seeds used as given); None:
                greedy.

        Raises:
            RuntimeError: the session has not started, or its state was lost (`_live_state`).
            ValueError: a bad row, prompt, budget or sampling, or a request the session does not
                `fit`; then nothing is admitted.
        """
        self._live_state("before admitting requests")
        if isinstance(sampling, SamplingParams):  # one seed for all would draw copies
            raise ValueError("sampling: give one SamplingParams per request (seeds used as given)")
        rows, prompts = list(rows), list(prompts)
        budgets = per_row(max_new_tokens, len(rows), "max_new_tokens")
        sampling = [GREEDY] * len(rows) if sampling is None else list(sampling)
        if not rows or not len(rows) == len(prompts) == len(sampling):
            raise ValueError(
                f"give one row, prompt and sampling per request, got {len(rows)} rows, "
                f"{len(prompts)} prompts and {len(sampling)} samplings"
            )
        self._check_admission_rows(rows)
        requests = [
            self._check_admission(*request)
            for request in zip(prompts, budgets, sampling, strict=True)
        ]
        group = self.admission_group_size
        for start in range(0, len(rows), group):
            self._admit_group(rows[start : start + group], requests[start : start + group])

    @property
    def admission_group_size(self) -> int:
        """The most requests `admit_many` prefills together: half the batch (so that each state
        leaf's batch axis is the one where its size differs), and 1 in a batch of 1."""
        return max(1, self._batch // 2)

    def _check_admission(
        self, prompt, max_new_tokens, sampling
    ) -> tuple[list[int], int, SamplingParams]:
        """`(prompt, budget, sampling)` of one admission, checked."""
        config = self._target.config
        prompt = check_token_ids(prompt, config.vocab_size)
        budget = check_budget(config, len(prompt), max_new_tokens)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if not self.fits(len(prompt), budget):
            raise ValueError(
                f"a prompt of {len(prompt)} tokens with max_new_tokens={budget} does not fit this "
                f"session, sized for at most {self._max_output} new tokens and "
                f"{self._capacity} tokens of prompt and new tokens "
                "together; decode it in a new session (or reserve room for it)"
            )
        return prompt, budget, sampling

    def _admit_group(self, rows: list[int], requests: list[tuple]) -> None:
        """Prefills checked requests together and writes them into `rows`."""
        prompts, budgets, sampling = (list(x) for x in zip(*requests, strict=True))
        pad = bucket(len(rows), minimum=1) - len(rows)  # padding rows: budget 0, not written
        width = self._prompt_width(max(map(len, prompts)))  # compiled once per width
        inputs, new_requests = self._batch_inputs(
            prompts + [[0]] * pad, budgets + [0] * pad, sampling + [GREEDY] * pad, width
        )
        compiled_before, decoded_before = self._compile_seconds, self._decode_seconds
        state, seconds = self._prefill(*inputs, new_requests)
        # Both written before either is kept: an interrupt between them leaves the state donated
        # (`_live_state` then says so), never new rows with their old requests.
        state = write_rows(self._state, state, rows, self._batch)
        requests = write_rows(self._requests, new_requests, rows, self._batch)
        self._state, self._requests = state, requests
        self._admission_prefill_seconds += seconds
        for row, prompt, budget in zip(rows, prompts, budgets, strict=True):
            if row == self.num_rows:  # a padding row joins: every per-row list grows by one
                for values in (self.prompt_lengths, self._budgets, self._polled, self._row_done):
                    values.append(None)
                self._joined.append(None)
            self.prompt_lengths[row], self._budgets[row] = len(prompt), budget
            self._polled[row], self._row_done[row] = 0, False
            self._joined[row] = (seconds, decoded_before, compiled_before)
            self._cancelled.discard(row)
            self._max_budget = max(self._max_budget, budget)

    def _check_admission_rows(self, rows: list) -> None:
        """Each row is a finished one, or the next unused padding row, and none comes twice."""
        unused = self.num_rows  # the next padding row to join
        for row in rows:
            _check_row_type(row)
            if row == unused < self._batch:
                unused += 1
                continue
            if not 0 <= row < self.num_rows:
                raise ValueError(
                    f"row {row} is neither a row of the batch's {self.num_rows} requests nor its "
                    f"next unused row (batch of {self._batch} rows; rows are used in order)"
                )
            if not self._row_done[row]:
                raise ValueError(f"row {row} is still decoding its request (poll until it is done)")
        if len(set(map(int, rows))) != len(rows):
            raise ValueError(f"rows {list(rows)}: a row is given twice")

    def advance(self, max_steps: int | None = None) -> None:
        """Runs the decode loop for at most `max_steps` target forwards (None: until every row is
        done; each forward commits >= 1 token per unfinished row).

        Raises:
            RuntimeError: the session has not started, or its state was lost (`_live_state`).
            ValueError: `max_steps` is neither None nor an integer >= 1.
        """
        self._live_state("before advancing it")
        if max_steps is not None and not is_integer(max_steps):
            raise ValueError(f"max_steps must be an integer or None, got {max_steps!r}")
        steps = self._max_budget if max_steps is None else int(max_steps)
        if steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {steps}")
        # More forwards than the largest budget can never be needed, and the count must fit int32.
        steps = min(steps, self._max_budget)
        if self._max_budget == 1:
            return  # every row committed its one token at the prefill: nothing to compile or run
        if self._pipeline == "mpmd":
            self._advance_two_programs(steps)
            return
        proposer, spmd = self._proposer, self._pipeline == "spmd"
        if proposer is None:
            fn, static = decode_autoregressive, {}
        else:
            fn, static = decode_loop(proposer, pipelined=spmd), dict(proposer=proposer)
        weights, signatures = self._signed_weights(placed=spmd)
        carry = (self._state, self._requests, self._steps_array(steps))
        if spmd:
            # The loop's arguments live on the stage mesh (the state and the requests since
            # `start`: placing them again copies nothing).
            carry = replicate(carry)
        args = (*weights, *carry)
        signatures = (*signatures, *map(signature, carry))
        run, compile_seconds = COMPILED.get(
            fn, *args, signatures=signatures, config=self._target.config, **static
        )
        self._compile_seconds += compile_seconds
        start = time.perf_counter()
        # The old state is donated: never reuse it. The new one is kept before it is waited for,
        # so that an interrupt (Ctrl-C) during the wait leaves the session the state it computes.
        self._state = run(*args)
        jax.block_until_ready(self._state)
        self._decode_seconds += time.perf_counter() - start

    def _signed_weights(self, placed: bool) -> tuple[tuple, tuple]:
        """`(weights, their signatures)`: the target's weights, then the proposer's (speculative
        methods), as the prefill and the decode loop take them; `placed`: the SPMD pipeline's
        loop's, replicated on the stage mesh. Made once per session: they are the same at every
        chunk, and over a model's hundreds of arrays their signatures would be most of the
        compiled-program lookup's host time (`CompiledCache.get`)."""
        signed = self._signed.get(placed)
        if signed is None:
            weights = (self._target.params,)
            if self._proposer is not None:
                weights += (self._proposer_params,)
            if placed:
                # Placed apart from the carry, so that sessions of one target with other drafts
                # share its copy (`PLACED`); waited for, so that the first chunk's decode time
                # does not include the transfer.
                weights = jax.block_until_ready(tuple(map(replicated_weights, weights)))
            signed = self._signed[placed] = weights, tuple(map(signature, weights))
        return signed

    def _steps_array(self, steps: int) -> jax.Array:
        """`jnp.int32(steps)`, made once per value: a chunked decode passes the same count at
        every chunk, and each new scalar is a device transfer and an eager dispatch."""
        array = self._steps_arrays.get(steps)
        if array is None:
            array = self._steps_arrays[steps] = jnp.int32(steps)
        return array

    def _prefill_two_programs(self, prompts, prompt_lengths, requests) -> tuple[object, float]:
        """`_prefill` for the MPMD pipeline: each side's prefill on its device."""
        if self._two_programs is None:
            self._two_programs = TwoProgramPipeline(
                self._target.params,
                self._proposer_params,
                config=self._target.config,
                proposer=self._proposer,
                compiled=COMPILED,
            )
        start = time.perf_counter()
        state, compile_seconds = self._two_programs.prefill(
            prompts,
            prompt_lengths,
            requests,
            capacity=self._capacity,
            max_output=self._max_output,
            chunk=self._prefill_chunk,
        )
        state = jax.block_until_ready(state)
        self._compile_seconds += compile_seconds
        return state, time.perf_counter() - start - compile_seconds

    def _advance_two_programs(self, steps: int) -> None:
        """`advance` through the MPMD pipeline's host loop (compilation timed apart)."""
        start = time.perf_counter()
        state, compile_seconds = self._two_programs.advance(self._state, self._requests, steps)
        # Kept before it is waited for, as `advance` keeps the loop's: the rounds still in flight
        # took the old state (donated), so an interrupt during the wait must not leave it.
        self._state = state
        self._compile_seconds += compile_seconds
        jax.block_until_ready(state)
        self._decode_seconds += time.perf_counter() - start - compile_seconds

    def poll(self) -> list[list[int]]:
        """The tokens each row committed since the previous poll (one small device transfer).

        Raises:
            RuntimeError: the session has not started, or its state was lost (`_live_state`).
        """
        decode = self._decode_state()
        output, counts, done = jax.device_get((decode.output, decode.num_generated, decode.done))
        new = []
        for row in range(self.num_rows):
            n = int(counts[row])
            new.append(output[row, self._polled[row] : n].tolist())
            self._polled[row] = n
            self._row_done[row] = bool(done[row])
        return new

    @property
    def row_done(self) -> list[bool]:
        """Which rows had finished at the last `poll`."""
        return list(self._row_done)

    @property
    def done(self) -> bool:
        """Every row had finished at the last `poll`."""
        return all(self._row_done)

    def cancel(self, row: int) -> None:
        """Stops `row` from decoding further; its tokens so far stay (finish_reason
        "cancelled" unless it had finished already).

        Raises:
            ValueError: `row` is not an integer in [0, `num_rows`).
            RuntimeError: the session has not started, or its state was lost (`_live_state`).
        """
        self._check_row(row)
        decode = self._decode_state()
        # The device's flag, not `_row_done`: the row may have finished since the last poll.
        if not jax.device_get(decode.done)[row]:
            self._cancelled.add(row)
        decode = decode.replace(done=_stop_row(decode.done, np.int32(row)))
        if isinstance(self._state, SpecState):
            self._state = self._state.replace(decode=decode)
        else:
            self._state = decode
        self._row_done[row] = True

    def chunks(self, chunk_steps: int) -> Iterator[list[list[int]]]:
        """Starts (if needed) and decodes to the end, yielding every row's new tokens after the
        prefill and after every `chunk_steps` target forwards."""
        if self._state is None:
            self.start()
        yield self.poll()
        while not self.done:
            self.advance(chunk_steps)
            yield self.poll()

    def result(self, row: int) -> GenerationResult:
        """Request `row`'s `GenerationResult` so far: a row that `row_done` reports finished can
        be answered while the others decode (fetches only that row's outputs).

        Raises:
            ValueError: `row` is not an integer in [0, `num_rows`).
            RuntimeError: the session has not started, or its state was lost (`_live_state`).
        """
        self._check_row(row)
        return self._result(row, jax.device_get(row_outputs(self._running_state(), row)))

    def results(self) -> list[GenerationResult]:
        """One `GenerationResult` per request, in order (one transfer of the outputs, not of the
        caches)."""
        outputs = jax.device_get(row_outputs(self._running_state(), slice(None)))
        return [
            self._result(row, {name: value[row] for name, value in outputs.items()})
            for row in range(self.num_rows)
        ]

    def _result(self, row: int, outputs: dict) -> GenerationResult:
        """Request `row`'s result from its `outputs` fetched to the host (`row_outputs`)."""
        stops, cancelled = self.stop_token_ids, row in self._cancelled
        return row_result(outputs, self.prompt_lengths[row], stops, self._timing(row), cancelled)

    def _timing(self, row: int) -> Timing:
        """The first batch's rows: the session's times; an admitted row: its own prefill, and
        the decoding and compiling since it joined."""
        if self._joined[row] is None:
            return Timing(self._prefill_seconds, self._decode_seconds, self._compile_seconds)
        prefill_seconds, decoded_before, compiled_before = self._joined[row]
        return Timing(
            prefill_seconds,
            self._decode_seconds - decoded_before,
            self._compile_seconds - compiled_before,
        )

    def _check_row(self, row) -> None:
        """ValueError unless `row` is the row of one of the session's requests."""
        _check_row_type(row)
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside the batch of {self.num_rows}")

    def _running_state(self):
        return self._live_state("before reading its results")

    def _decode_state(self):
        state = self._live_state("first")
        return state.decode if isinstance(state, SpecState) else state

    def _live_state(self, before: str):
        """The loop state, after checking that the session has started (else a RuntimeError
        saying to start it `before` ...) and that its state is whole: `advance` and `admit`
        donate it to their programs, so an exception that interrupts them after that (Ctrl-C
        within a multi-round host loop or between rows' writes, a device failure) leaves deleted
        buffers, which JAX would report as a deleted array (a ValueError from the next step)."""
        if self._state is None:
            raise RuntimeError(f"start() the session {before}")
        leaves = jax.tree.leaves((self._state, self._requests))
        if any(isinstance(x, jax.Array) and x.is_deleted() for x in leaves):
            raise RuntimeError(
                "this session's state was lost: an exception interrupted a step (advance or "
                "admit) after its state was handed to the device program, which consumes it; "
                "decode its unfinished requests in a new session"
            )
        return self._state


def resolve_proposer(target, draft, options: DecodingOptions):
    """`(proposer, params)` of `options`' speculative method with `draft` (wrapped for foresight),
    `(None, None)` for "ar"; a pipeline is refused here with fewer than two devices."""
    # Checked first: a checkpoint path passed where the loaded draft belongs (the usual slip)
    # must not be answered with advice about the method.
    if draft is not None and not hasattr(draft, "proposer"):
        raise ValueError(
            f"draft must be a Draft (load_draft(path, target) or init_draft), got "
            f"{type(draft).__name__}: {draft!r:.80}"
        )
    if options.method == "ar":
        if draft is not None:
            variant = getattr(getattr(draft, "config", None), "variant", "jetspec++")
            raise ValueError(
                f"method 'ar' (the default) takes no draft model; pass method={variant!r} to "
                "decode with this draft"
            )
        return None, None
    if draft is None:
        raise ValueError(
            f"method {options.method!r} needs a draft model (load_draft or init_draft)"
        )
    proposer, params = draft.proposer(
        target,
        method=options.method,
        refine_passes=options.refine_passes,
        refreshes=options.refreshes,
        replacement_confidence=options.replacement_confidence,
        block_size=options.block_size,
    )
    if not options.foresight:
        return proposer, params
    if options.pipeline is not None:
        pipeline_devices()  # refused with fewer than two
    return foresight_proposer(
        draft, proposer, params, options.foresight, rule=options.foresight_rule
    )


def _check_row_type(row) -> None:
    if not is_integer(row):
        raise ValueError(f"row must be an integer, got {row!r}")


def _committed(tree):
    """`tree` committed to the devices it lies on (the same buffers: no copy). jit compiles an
    eager program (a row's reads in `result`, its write in `cancel`) apart for committed and
    uncommitted arguments, and a prefill's outputs are uncommitted, but an admission's writes
    commit the state: committed from the start, a session runs one set, the one `warm_up`
    compiles."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding), tree)


@jax.jit
def _stop_row(done: jax.Array, row: jax.Array) -> jax.Array:
    """`done` `[B]` with `row` set: one program per batch shape and placement, which `warm_up`
    compiles ahead (eager indexing would compile four small ones at the first cancel)."""
    return done.at[row].set(True)


def _padded_stops(stops: tuple[int, ...]) -> np.ndarray:
    """`[S]` int32 stop ids padded with -1 (no token) to a bucketed width, so that lists of
    other lengths (1 to 4 ids: every model's case) reuse the compiled decoders."""
    padded = np.full((bucket(len(stops), minimum=4),), -1, np.int32)
    padded[: len(stops)] = stops
    return padded
