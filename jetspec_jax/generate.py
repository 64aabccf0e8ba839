"""`generate` / `generate_batch`: validate a request, bucket its shapes, run a jitted decoder.

This is the host side of decoding; everything per token happens on the device. Shapes are bucketed
(batch, prompt length, output length: powers of two) so that a new request reuses compiled code;
the first use of a bucket compiles ahead of time, is logged, and is reported apart from run time.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.decoding.autoregressive import decode_autoregressive
from jetspec_jax.decoding.buckets import bucket
from jetspec_jax.decoding.compiled import CompiledCache
from jetspec_jax.decoding.prefill import prefill
from jetspec_jax.decoding.speculative import SpecState, decode_speculative, prefill_speculative
from jetspec_jax.decoding.state import Requests
from jetspec_jax.sampling import RowSampling, SamplingParams
from jetspec_jax.target import Target

logger = logging.getLogger(__name__)

METHODS = ("ar", "dflash", "jetspec", "jetspec++")
GREEDY = SamplingParams()
_COMPILED = CompiledCache()


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of one batch (shared by its rows); compilation is counted apart.

    Attributes:
        prefill_seconds: the prompts' forward and the first token.
        decode_seconds: the decode loop, first token excluded.
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
        finish_reason: "stop" (a stop token was generated) or "length" (max_new_tokens reached).
        prompt_length: number of prompt tokens.
        timing: wall-clock times of the batch this prompt ran in.
        outcomes: speculative methods: `(k, a)` of every verification round (k drafts accepted,
            bonus token a); empty for "ar".
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    finish_reason: str
    prompt_length: int
    timing: Timing
    outcomes: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (the prefill's first token excluded)."""
        rounds = self.acceptance_lengths[1:] or self.acceptance_lengths
        return float(np.mean(rounds)) if rounds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second of the decode loop."""
        n, seconds = len(self.tokens) - 1, self.timing.decode_seconds
        return n / seconds if n > 0 and seconds > 0 else 0.0


def generate(
    target: Target,
    prompt_ids: Sequence[int],
    *,
    draft=None,
    method: str = "ar",
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    refine_passes: int = 0,
) -> GenerationResult:
    """Generates a continuation of one prompt.

    Args:
        target: a loaded target (`load_target`).
        prompt_ids: the prompt's token ids (a non-empty list of ints).
        draft: the draft head of speculative methods (`load_draft`, `init_draft`); None for "ar".
        method: "ar" (autoregressive), or a speculative method matching the draft's variant:
            "dflash", "jetspec" or "jetspec++". Every method gives the same tokens as "ar" (greedy,
            and sampled with the same seed, up to floating-point differences between block and
            single-token forwards); they differ in how many target forwards they need.
        max_new_tokens: at most this many new tokens (>= 1).
        temperature: 0 for greedy decoding, > 0 to sample.
        top_p: nucleus sampling mass in (0, 1]; 1 disables.
        top_k: keep the k most likely tokens; 0 disables.
        seed: random seed of the request; the same seed gives the same tokens.
        stop_token_ids: stop after generating any of these; None uses the target's end-of-sequence
            ids, [] disables stopping.
        refine_passes: "jetspec++" only: J extra Jacobi refinement passes of the draft per round
            (J0 = one pass).

    Returns:
        A `GenerationResult`.
    """
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    return generate_batch(
        target,
        [prompt_ids],
        draft=draft,
        method=method,
        max_new_tokens=max_new_tokens,
        sampling=[sampling],
        stop_token_ids=stop_token_ids,
        refine_passes=refine_passes,
    )[0]


def generate_batch(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    draft=None,
    method: str = "ar",
    max_new_tokens: int = 128,
    sampling: SamplingParams | Sequence[SamplingParams] = GREEDY,
    stop_token_ids: Sequence[int] | None = None,
    refine_passes: int = 0,
) -> list[GenerationResult]:
    """Generates continuations of several prompts of any lengths in one batched decode loop.

    Each row's tokens equal those of generating it alone (greedy, and sampled with its seed), and
    for every method equal those of "ar".

    Args:
        target: a loaded target.
        prompts: token-id lists, one per request.
        draft, method, max_new_tokens, stop_token_ids, refine_passes: as in `generate`, shared by
            all rows.
        sampling: one `SamplingParams` for all rows, or one per row.

    Returns:
        One `GenerationResult` per prompt, in order.
    """
    config = target.config
    proposer, proposer_params = _proposer(target, draft, method, refine_passes)
    prompts = [_check_prompt(p, config.vocab_size) for p in prompts]
    if not prompts:
        raise ValueError("prompts is empty")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)):
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for p in prompts:
        if len(p) + max_new_tokens > config.max_position_embeddings:
            raise ValueError(
                f"prompt of {len(p)} tokens + max_new_tokens={max_new_tokens} exceeds the model's "
                f"context of {config.max_position_embeddings} tokens"
            )
    if isinstance(sampling, SamplingParams):
        sampling = [sampling] * len(prompts)
    if len(sampling) != len(prompts):
        raise ValueError(f"got {len(sampling)} SamplingParams for {len(prompts)} prompts")
    stops = target.stop_token_ids if stop_token_ids is None else tuple(stop_token_ids)
    _check_prompt(stops, config.vocab_size, what="stop_token_ids", allow_empty=True)

    # Bucketed shapes; padding rows have a zero budget and are done after prefill. A verification
    # writes a whole block past the committed length, so the cache has a block of headroom.
    batch = bucket(len(prompts), minimum=1)
    prompt_len = bucket(max(len(p) for p in prompts))
    max_output = bucket(max_new_tokens)
    capacity = prompt_len + max_output + (proposer.block_size if proposer else 0)
    padded = np.zeros((batch, prompt_len), np.int32)
    lengths = np.ones((batch,), np.int32)
    for row, p in enumerate(prompts):
        padded[row, : len(p)] = p
        lengths[row] = len(p)
    pad_rows = batch - len(prompts)
    requests = Requests(
        max_new_tokens=jnp.asarray([max_new_tokens] * len(prompts) + [0] * pad_rows, jnp.int32),
        stop_token_ids=jnp.asarray(np.tile(np.asarray(stops or (-1,), np.int32), (batch, 1))),
        sampling=RowSampling.from_params(list(sampling) + [SamplingParams()] * pad_rows),
    )
    inputs = (jnp.asarray(padded), jnp.asarray(lengths), requests)
    sizes = dict(config=config, capacity=capacity, max_output=max_output)
    max_steps = jnp.int32(max_new_tokens)  # every forward commits >= 1 token
    if proposer is None:
        prefill_fn, prefill_args = prefill, (target.params, *inputs)
        decode_fn, decode_static = decode_autoregressive, dict(config=config)
    else:
        prefill_fn, prefill_args = prefill_speculative, (target.params, proposer_params, *inputs)
        sizes["proposer"] = proposer
        decode_fn, decode_static = decode_speculative, dict(config=config, proposer=proposer)

    run_prefill, prefill_compile = _COMPILED.get(prefill_fn, *prefill_args, **sizes)
    start = time.perf_counter()
    state = jax.block_until_ready(run_prefill(*prefill_args))
    if proposer is None:
        state = state[0]  # AR needs no tap states
    prefilled = time.perf_counter()

    params = (target.params,) if proposer is None else (target.params, proposer_params)
    decode_args = (*params, state, requests, max_steps)
    run_decode, decode_compile = _COMPILED.get(decode_fn, *decode_args, **decode_static)
    decode_start = time.perf_counter()
    state = jax.device_get(run_decode(*decode_args))
    finished = time.perf_counter()
    timing = Timing(
        prefill_seconds=prefilled - start,
        decode_seconds=finished - decode_start,
        compile_seconds=prefill_compile + decode_compile,
    )
    return [_result(state, row, len(p), stops, timing) for row, p in enumerate(prompts)]


def _proposer(target: Target, draft, method: str, refine_passes: int):
    """`(proposer, params)` for a speculative method, `(None, None)` for "ar"."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; available: {', '.join(METHODS)}")
    if method == "ar":
        if draft is not None:
            raise ValueError("method 'ar' takes no draft model")
        if refine_passes:
            raise ValueError("refine_passes applies to method 'jetspec++' only")
        return None, None
    if draft is None:
        raise ValueError(f"method {method!r} needs a draft model (load_draft or init_draft)")
    if not hasattr(draft, "proposer"):
        raise ValueError(f"draft must be a Draft (load_draft or init_draft), got {type(draft)}")
    return draft.proposer(target, method=method, refine_passes=refine_passes)


def _result(state, row: int, prompt_length: int, stops: tuple[int, ...], timing: Timing):
    decode = state.decode if isinstance(state, SpecState) else state
    tokens = decode.output[row, : int(decode.num_generated[row])].tolist()
    outcomes = []
    if isinstance(state, SpecState):
        rounds = int(state.num_verify_rounds[row])
        outcomes = list(
            zip(
                state.accepted[row, :rounds].tolist(),
                state.bonus[row, :rounds].tolist(),
                strict=True,
            )
        )
    return GenerationResult(
        tokens=tokens,
        acceptance_lengths=decode.round_lengths[row, : int(decode.num_rounds[row])].tolist(),
        finish_reason="stop" if tokens and tokens[-1] in stops else "length",
        prompt_length=prompt_length,
        timing=timing,
        outcomes=outcomes,
    )


def _check_prompt(
    ids, vocab_size: int, what: str = "prompt", allow_empty: bool = False
) -> list[int]:
    """A list of ints in [0, vocab_size), or a ValueError saying what is wrong."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{what} must be a list of token ids, not text; tokenize it first")
    ids = list(ids)
    if not ids and not allow_empty:
        raise ValueError(f"{what} is empty: at least one token id is needed")
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"{what} must hold integer token ids, got {i!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"{what} holds token id {i}, outside the vocabulary [0, {vocab_size})")
    return [int(i) for i in ids]
