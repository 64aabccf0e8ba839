"""`DecodeSession`: one batch of requests, prefilled once and decoded in resumable chunks.

The host side of decoding, shared by `generate`, streaming and the server:

    DecodeSession(target, prompts, ...)   validate the requests, bucket the shapes, build `Requests`
    .start()                              compiled prefill (each row commits its first token)
    .advance(max_steps)                   the compiled decode loop for at most `max_steps` target
                                          forwards (a dynamic argument: no recompile per chunk)
    .poll()                               the tokens each row committed since the last poll
    .cancel(row)                          stop a row at the next chunk boundary
    .result(row) / .results()             one request's / every request's `GenerationResult`

With `pipeline="mpmd"` the prefill and the loop are `pipeline_mpmd.TwoProgramPipeline`'s (one
program per device, rounds dispatched from the host); every other method runs one compiled loop.

Everything per token stays on the device: a caller that never polls (`generate_batch`) makes no
host round trip until `results()`. Shapes are bucketed (batch, prompt length, output length:
powers of two) so that new requests reuse compiled code; the first use of a bucket compiles ahead
of time, is logged, and is timed apart from prefill and decode.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.decoding.autoregressive import decode_autoregressive
from jetspec_jax.decoding.buckets import bucket
from jetspec_jax.decoding.compiled import CompiledCache
from jetspec_jax.decoding.foresight import ForesightState, foresight_proposer
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.decoding.pipeline import (
    decode_loop,
    pipeline_devices,
    replicate,
    replicated_weights,
)
from jetspec_jax.decoding.pipeline_mpmd import TwoProgramPipeline
from jetspec_jax.decoding.prefill import prefill
from jetspec_jax.decoding.speculative import SpecState, prefill_speculative
from jetspec_jax.decoding.state import Requests
from jetspec_jax.sampling import RowSampling, SamplingParams

GREEDY = SamplingParams()
# One process-wide cache: every session (and every server batch) of a bucket reuses its executables.
COMPILED = CompiledCache()


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of one batch (shared by its rows); compilation is counted apart.

    Attributes:
        prefill_seconds: the prompts' forward and the first token.
        decode_seconds: the decode loop, first token excluded (all chunks together).
        compile_seconds: compiling executables for new shape buckets (0 when all were cached).
    """

    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """The outcome of one prompt.

    Attributes:
        tokens: the generated token ids (a final stop token included).
        acceptance_lengths: tokens committed by each target forward that produced tokens for this
            prompt, the prefill's first token included; sums to `len(tokens)`. All 1 for "ar".
        finish_reason: "stop" (a stop token was generated), "length" (max_new_tokens reached),
            "cancelled" (`DecodeSession.cancel` stopped it early), or None while the row is still
            decoding (`DecodeSession.results` read before it finished).
        prompt_length: number of prompt tokens.
        timing: wall-clock times of the batch this prompt ran in.
        outcomes: speculative methods: `(k, a)` of every verification round (k drafts accepted,
            bonus token a); empty for "ar". The last round's, when a stop token or the budget cut
            it, may name more tokens than were committed.
        foresight_hits: with foresight, whether each verification round's block came from the
            foresight cache (the first round never does); empty without foresight.
        foresight_occupancy: with foresight, the candidate blocks cached when each round began.
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    finish_reason: str | None
    prompt_length: int
    timing: Timing
    outcomes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    foresight_hits: list[bool] = dataclasses.field(default_factory=list)
    foresight_occupancy: list[int] = dataclasses.field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (the prefill's first token excluded;
        1.0 when that token is the only one, 0.0 with none)."""
        rounds = self.acceptance_lengths[1:] or self.acceptance_lengths
        return float(np.mean(rounds)) if rounds else 0.0

    @property
    def foresight_hit_rate(self) -> float:
        """The fraction of verification rounds after the first whose block was a foresight hit
        (the first round has nothing drafted ahead; 0 without foresight)."""
        return pooled_hit_rate([self])

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second of the decode loop."""
        n, seconds = len(self.tokens) - 1, self.timing.decode_seconds
        return n / seconds if n > 0 and seconds > 0 else 0.0


def pooled_hit_rate(results: Iterable[GenerationResult]) -> float:
    """Foresight hits over the rounds that could hit, pooled across results: each prompt's
    rounds after its first (0.0 when there are none, as without foresight)."""
    hits = chances = 0
    for result in results:
        hits += sum(result.foresight_hits[1:])
        chances += max(len(result.foresight_hits) - 1, 0)
    return hits / chances if chances else 0.0


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
    ):
        """Validates the requests and builds the bucketed inputs (no compilation yet).

        Args:
            target: a loaded `Target`.
            prompts: one prompt per request (row): a list of token ids or a 1-D integer array.
            draft: the draft head of speculative methods; None for "ar".
            options: the method and its settings, shared by all rows; None: `DecodingOptions()`
                ("ar").
            max_new_tokens: one budget for all rows, or one per row (each >= 1).
            sampling: one `SamplingParams` for all rows, or one per row.
            stop_token_ids: shared by all rows; None: the target's end-of-sequence ids; [] never
                stops early.
            pad_batch_to: pad the batch to at least this many rows (>= 1; then to a power of
                two), so that a server compiles one batch shape instead of one per batch size.

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
        self._two_programs = None  # the MPMD pipeline's stage placement, built at start
        prompts = check_prompts(prompts, config.vocab_size)
        budgets = _per_row(max_new_tokens, len(prompts), "max_new_tokens")
        budgets = [
            check_budget(config, len(p), n, _prompt_name(i, len(prompts)))
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
        ]
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompts)
        if not isinstance(sampling, Sequence):
            kind = type(sampling).__name__
            raise ValueError(f"sampling must be a SamplingParams or one per prompt, got {kind}")
        sampling = list(sampling)
        if len(sampling) != len(prompts):
            raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
        for params in sampling:
            if not isinstance(params, SamplingParams):
                raise ValueError(f"sampling must hold SamplingParams, got {type(params).__name__}")
        stops = target.stop_token_ids if stop_token_ids is None else stop_token_ids
        self.stop_token_ids = tuple(
            check_token_ids(stops, config.vocab_size, what="stop_token_ids", allow_empty=True)
        )
        pad_to = as_int(pad_batch_to)
        if pad_to is None or pad_to < 1:
            raise ValueError(f"pad_batch_to must be an integer >= 1, got {pad_batch_to!r}")

        # Bucketed shapes; padding rows have a zero budget and are done after prefill. A
        # verification writes a whole block past the committed length: a block of headroom.
        self.prompt_lengths = [len(p) for p in prompts]
        batch = bucket(max(len(prompts), pad_to), minimum=1)
        prompt_len = bucket(max(self.prompt_lengths))
        self._max_output = bucket(max(budgets))
        block = self._proposer.block_size if self._proposer else 0
        self._capacity = prompt_len + self._max_output + block
        padded = np.zeros((batch, prompt_len), np.int32)
        lengths = np.ones((batch,), np.int32)
        for row, p in enumerate(prompts):
            padded[row, : len(p)] = p
            lengths[row] = len(p)
        pad_rows = batch - len(prompts)
        self._requests = Requests(
            max_new_tokens=jnp.asarray(budgets + [0] * pad_rows, jnp.int32),
            stop_token_ids=jnp.asarray(np.tile(_padded_stops(self.stop_token_ids), (batch, 1))),
            sampling=RowSampling.from_params(sampling + [GREEDY] * pad_rows),
        )
        self._inputs = (jnp.asarray(padded), jnp.asarray(lengths))
        self._budgets = budgets
        self._max_budget = max(budgets)
        self._state = None
        self._polled = [0] * len(prompts)
        self._row_done = [False] * len(prompts)
        self._cancelled: set[int] = set()
        self._prefill_seconds = self._decode_seconds = self._compile_seconds = 0.0

    @property
    def num_rows(self) -> int:
        """The number of requests (batch padding excluded)."""
        return len(self.prompt_lengths)

    @property
    def max_new_tokens(self) -> list[int]:
        """Each request's token budget (batch padding excluded)."""
        return list(self._budgets)

    @property
    def started(self) -> bool:
        return self._state is not None

    @property
    def timing(self) -> Timing:
        """Times so far."""
        return Timing(self._prefill_seconds, self._decode_seconds, self._compile_seconds)

    def start(self) -> None:
        """Compiles (once per bucket) and runs the prefill: every row commits its first token."""
        if self._state is not None:
            raise RuntimeError("this session has already started")
        target, proposer = self._target, self._proposer
        if self._pipeline == "mpmd":
            self._start_two_programs()
            return
        sizes = dict(config=target.config, capacity=self._capacity, max_output=self._max_output)
        if proposer is None:
            fn, args = prefill, (target.params, *self._inputs, self._requests)
        else:
            fn, args = (
                prefill_speculative,
                (
                    target.params,
                    self._proposer_params,
                    *self._inputs,
                    self._requests,
                ),
            )
            sizes["proposer"] = proposer
        run, compile_seconds = COMPILED.get(fn, *args, **sizes)
        self._compile_seconds += compile_seconds
        start = time.perf_counter()
        state = jax.block_until_ready(run(*args))
        self._state = state[0] if proposer is None else state  # AR needs no tap states
        self._prefill_seconds = time.perf_counter() - start

    def advance(self, max_steps: int | None = None) -> None:
        """Runs the decode loop for at most `max_steps` target forwards (None: until every row is
        done; each forward commits >= 1 token per unfinished row)."""
        if self._state is None:
            raise RuntimeError("start() the session before advancing it")
        if max_steps is not None and (
            isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer))
        ):
            raise ValueError(f"max_steps must be an integer or None, got {max_steps!r}")
        steps = self._max_budget if max_steps is None else int(max_steps)
        if steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {steps}")
        # More forwards than the largest budget can never be needed, and the count must fit int32.
        steps = min(steps, self._max_budget)
        if self._max_budget == 1:
            return  # every row committed its one token at the prefill: nothing to compile or run
        target, proposer = self._target, self._proposer
        if self._pipeline == "mpmd":
            self._advance_two_programs(steps)
            return
        if proposer is None:
            fn, params, static = decode_autoregressive, (target.params,), {}
        else:
            fn = decode_loop(proposer, pipelined=self._pipeline == "spmd")
            params = (target.params, self._proposer_params)
            static = dict(proposer=proposer)
        args = (*params, self._state, self._requests, jnp.int32(steps))
        if self._pipeline == "spmd":  # the loop's arguments live on the stage mesh
            # Placed apart, so that sessions of one target with other drafts share its copy;
            # waited for, so that the first session's decode time does not include the transfer.
            weights = jax.block_until_ready(tuple(map(replicated_weights, params)))
            args = (*weights, *replicate(args[len(params) :]))
        run, compile_seconds = COMPILED.get(fn, *args, config=target.config, **static)
        self._compile_seconds += compile_seconds
        start = time.perf_counter()
        # The old state is donated (by every loop but the SPMD pipeline's): never reuse it.
        self._state = jax.block_until_ready(run(*args))
        self._decode_seconds += time.perf_counter() - start

    def _start_two_programs(self) -> None:
        """`start` for the MPMD pipeline: each side's prefill on its device."""
        self._two_programs = TwoProgramPipeline(
            self._target.params,
            self._proposer_params,
            config=self._target.config,
            proposer=self._proposer,
            compiled=COMPILED,
        )
        start = time.perf_counter()
        state, compile_seconds = self._two_programs.prefill(
            *self._inputs, self._requests, capacity=self._capacity, max_output=self._max_output
        )
        self._state = jax.block_until_ready(state)
        self._compile_seconds += compile_seconds
        self._prefill_seconds = time.perf_counter() - start - compile_seconds

    def _advance_two_programs(self, steps: int) -> None:
        """`advance` through the MPMD pipeline's host loop (compilation timed apart)."""
        start = time.perf_counter()
        state, compile_seconds = self._two_programs.advance(self._state, self._requests, steps)
        self._state = jax.block_until_ready(state)
        self._compile_seconds += compile_seconds
        self._decode_seconds += time.perf_counter() - start - compile_seconds

    def poll(self) -> list[list[int]]:
        """The tokens each row committed since the previous poll (one small device transfer)."""
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
        "cancelled" unless it had finished already)."""
        self._check_row(row)
        decode = self._decode_state()
        # The device's flag, not `_row_done`: the row may have finished since the last poll.
        if not bool(decode.done[row]):
            self._cancelled.add(row)
        decode = decode.replace(done=decode.done.at[row].set(True))
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
        be answered while the others decode (fetches only that row's outputs)."""
        self._check_row(row)
        return self._result(row, jax.device_get(_row_outputs(self._running_state(), row)))

    def results(self) -> list[GenerationResult]:
        """One `GenerationResult` per request, in order (one transfer of the outputs, not of the
        caches)."""
        outputs = jax.device_get(_row_outputs(self._running_state(), slice(None)))
        return [
            self._result(row, {name: value[row] for name, value in outputs.items()})
            for row in range(self.num_rows)
        ]

    def _result(self, row: int, outputs: dict) -> GenerationResult:
        stops, cancelled = self.stop_token_ids, row in self._cancelled
        return _result(outputs, self.prompt_lengths[row], stops, self.timing, cancelled)

    def _check_row(self, row) -> None:
        if isinstance(row, bool) or not isinstance(row, (int, np.integer)):
            raise ValueError(f"row must be an integer, got {row!r}")
        if not 0 <= row < self.num_rows:
            raise ValueError(f"row {row} is outside the batch of {self.num_rows}")

    def _running_state(self):
        if self._state is None:
            raise RuntimeError("start() the session before reading its results")
        return self._state

    def _decode_state(self):
        if self._state is None:
            raise RuntimeError("start() the session first")
        return self._state.decode if isinstance(self._state, SpecState) else self._state


def resolve_proposer(target, draft, options: DecodingOptions):
    """`(proposer, params)` of `options`' speculative method with `draft` (wrapped for foresight),
    `(None, None)` for "ar"; a pipeline is refused here with fewer than two devices."""
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
    if not hasattr(draft, "proposer"):
        raise ValueError(f"draft must be a Draft (load_draft or init_draft), got {type(draft)}")
    proposer, params = draft.proposer(
        target,
        method=options.method,
        refine_passes=options.refine_passes,
        refreshes=options.refreshes,
        replacement_confidence=options.replacement_confidence,
    )
    if not options.foresight:
        return proposer, params
    if options.pipeline is not None:
        pipeline_devices()  # refused with fewer than two
    return foresight_proposer(
        draft, proposer, params, options.foresight, rule=options.foresight_rule
    )


def check_budget(config, prompt_length: int, max_new_tokens, what: str = "prompt") -> int:
    """`max_new_tokens` as an int, after checking it is an integer >= 1 (Python, NumPy or JAX)
    and that the prompt (named `what` in the error) plus that many tokens fits the model's
    context (ValueError otherwise)."""
    budget = as_int(max_new_tokens)
    if budget is None:
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if budget < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {budget}")
    if prompt_length + budget > config.max_position_embeddings:
        raise ValueError(
            f"{what} of {prompt_length} tokens + max_new_tokens={budget} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens"
        )
    return budget


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """`prompts` (a non-empty sequence of prompts, each as `check_token_ids` takes it) as lists
    of ints, or a ValueError saying what is wrong."""
    iterable = hasattr(prompts, "__iter__") and getattr(prompts, "ndim", None) != 0
    if isinstance(prompts, (str, bytes)) or not iterable:
        raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {prompts!r}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    # One prompt's ids where a batch of prompts belongs (`generate_batch(target, ids)`).
    if any(as_int(p) is not None for p in prompts):
        raise ValueError(
            "prompts must be a list of prompts (lists of token ids), got a list of token ids: "
            "pass [prompt] for one prompt, or use generate"
        )
    return [
        check_token_ids(p, vocab_size, _prompt_name(i, len(prompts))) for i, p in enumerate(prompts)
    ]


def _prompt_name(index: int, count: int) -> str:
    """How errors name a prompt: by its index when it is one of a batch."""
    return f"prompt {index}" if count > 1 else "prompt"


def check_token_ids(
    ids, vocab_size: int, what: str = "prompt", allow_empty: bool = False
) -> list[int]:
    """`ids` (a sequence of integer ids, or a 1-D NumPy/JAX integer array) as a list of ints in
    [0, vocab_size), or a ValueError saying what is wrong."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{what} must be a list of token ids, not text; tokenize it first")
    if not hasattr(ids, "__iter__") or getattr(ids, "ndim", 1) != 1:  # 0-d arrays iterate no ids
        raise ValueError(f"{what} must be a list of token ids, got {ids!r}")
    if hasattr(ids, "dtype"):  # an array: one dtype check, then Python ints
        array = np.asarray(ids)
        if not np.issubdtype(array.dtype, np.integer):  # bool is no integer dtype
            raise ValueError(f"{what} must hold integer token ids, got an array of {array.dtype}")
        ids = array.tolist()
    ids = list(ids)
    if not ids and not allow_empty:
        raise ValueError(f"{what} is empty: at least one token id is needed")
    checked = []
    for i in ids:
        token = as_int(i)
        if token is None:
            raise ValueError(f"{what} must hold integer token ids, got {i!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"{what} holds token id {token}, outside the vocabulary [0, {vocab_size})"
            )
        checked.append(token)
    return checked


def as_int(value) -> int | None:
    """`value` as an int if it is an integer scalar (Python, NumPy, or a 0-d NumPy/JAX array of
    an integer dtype), else None; bools are not integers here."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    dtype = getattr(value, "dtype", None)
    if dtype is not None and getattr(value, "ndim", None) == 0 and np.issubdtype(dtype, np.integer):
        return int(value)
    return None


def _per_row(value, rows: int, name: str) -> list:
    """`value` per row: its items when it is a sequence (or 1-D NumPy/JAX array), else `value`
    repeated."""
    is_array = getattr(value, "ndim", None) == 1
    if is_array or (isinstance(value, Sequence) and not isinstance(value, str)):
        if len(value) != rows:
            raise ValueError(f"got {len(value)} values of {name} for {rows} prompts")
        return list(value)
    return [value] * rows


def _row_outputs(state, rows: int | slice) -> dict[str, jax.Array]:
    """The arrays a `GenerationResult` is read from, at `rows` of the batch (device arrays; the
    caches stay on the device)."""
    decode = state.decode if isinstance(state, SpecState) else state
    outputs = {
        "output": decode.output[rows],
        "num_generated": decode.num_generated[rows],
        "done": decode.done[rows],
        "round_lengths": decode.round_lengths[rows],
        "num_rounds": decode.num_rounds[rows],
    }
    if isinstance(state, SpecState):
        outputs["verify_rounds"] = state.num_verify_rounds[rows]
        outputs["accepted"] = state.accepted[rows]
        outputs["bonus"] = state.bonus[rows]
        if isinstance(state.proposer, ForesightState):
            outputs["foresight_rounds"] = state.proposer.num_rounds[rows]
            outputs["hits"] = state.proposer.hits[rows]
            outputs["occupancy"] = state.proposer.occupancy[rows]
    return outputs


def _result(row: dict, prompt_length, stops, timing, cancelled) -> GenerationResult:
    """The `GenerationResult` of one row's host outputs (`_row_outputs` at that row)."""
    tokens = row["output"][: int(row["num_generated"])].tolist()
    outcomes, hits, occupancy = [], [], []
    if "foresight_rounds" in row:
        rounds = int(row["foresight_rounds"])
        hits = row["hits"][:rounds].tolist()
        occupancy = row["occupancy"][:rounds].tolist()
    if "verify_rounds" in row:
        rounds = int(row["verify_rounds"])
        accepted, bonus = row["accepted"][:rounds].tolist(), row["bonus"][:rounds].tolist()
        outcomes = list(zip(accepted, bonus, strict=True))
    if tokens and tokens[-1] in stops:
        reason = "stop"
    elif cancelled:
        reason = "cancelled"
    else:
        reason = "length" if bool(row["done"]) else None
    return GenerationResult(
        tokens=tokens,
        acceptance_lengths=row["round_lengths"][: int(row["num_rounds"])].tolist(),
        finish_reason=reason,
        prompt_length=prompt_length,
        timing=timing,
        outcomes=outcomes,
        foresight_hits=hits,
        foresight_occupancy=occupancy,
    )


def _padded_stops(stops: tuple[int, ...]) -> np.ndarray:
    """`[S]` int32 stop ids padded with -1 (no token) to a bucketed width, so that lists of
    other lengths (1 to 4 ids: every model's case) reuse the compiled decoders."""
    padded = np.full((bucket(len(stops), minimum=4),), -1, np.int32)
    padded[: len(stops)] = stops
    return padded
