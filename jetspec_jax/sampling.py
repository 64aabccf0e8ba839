"""Sampling parameters and the one token-selection rule every decoder shares.

The distribution a token is drawn from is the target's softmax after temperature, then top-k, then
top-p (transformers' order). Speculative verification must draw from exactly this distribution, so
AR decoding and every speculative method call `filter_logits` / `select_tokens` here.

Randomness is keyed by (seed, absolute position): the token at position p of a request is drawn
with `fold_in(key(seed), p)`. A request's tokens therefore do not depend on its batch-mates, on how
many tokens a round commits, or on the method: with one seed, a lossless speculative decoder
reproduces autoregressive sampling token for token.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.scalars import as_int, as_real

MAX_TOP_K = 2**31 - 1  # top_k travels as int32 (any value >= the vocabulary keeps everything)
# Far below this (T ~ 1e-36) logits / T overflow float32, or T flushes to zero as a subnormal, and
# the softmax turns NaN. 1e-5 leaves a wide margin; there, any logit gap above ~1e-3 is one-hot.
MIN_TEMPERATURE = 1e-5
_MAX_FLOAT32 = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks tokens.

    Attributes:
        temperature: 0 selects greedy (argmax) decoding; >= `MIN_TEMPERATURE` samples from
            softmax(logits / T).
        top_k: keep the k most likely tokens (ties with the k-th kept); 0 (or any value >= the
            vocabulary) disables.
        top_p: keep the smallest set of most likely tokens whose probability, renormalised over
            the top-k set, reaches top_p (tokens whose logit ties the last kept one's are kept
            too); 1.0 disables, 0 keeps only the most likely token (and its ties).
        seed: the request's random seed, in [0, 2**32); the same seed gives the same tokens.

    Raises:
        ValueError: on construction: a `temperature` or `top_p` that is not a real number, a
            `top_k` or `seed` that is not an integer (bools are neither), a `temperature`
            outside [0, float32's max] (NaN included) or in (0, `MIN_TEMPERATURE`), `top_k`
            outside [0, `MAX_TOP_K`], `top_p` outside [0, 1], or `seed` outside [0, 2**32).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        # Python, NumPy and 0-d JAX scalars are kept as Python numbers (they compare and hash
        # alike); complex numbers are refused here, as they would pass the range checks.
        for name, convert, kind in (
            ("temperature", as_real, "a real number"),
            ("top_p", as_real, "a real number"),
            ("top_k", as_int, "an integer >= 0"),
            ("seed", as_int, "an integer"),
        ):
            value = convert(getattr(self, name))
            if value is None:
                raise ValueError(f"{name} must be {kind}, got {getattr(self, name)!r}")
            object.__setattr__(self, name, value)
        if not 0 <= self.temperature <= _MAX_FLOAT32:  # NaN fails too; travels as float32
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(
                # repr, not a rounded form: float32's 1e-5 is below the bound yet prints as it.
                f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE:g}, got "
                f"{self.temperature!r}: far smaller values overflow the scaled logits"
            )
        if not 0 <= self.top_k <= MAX_TOP_K:
            raise ValueError(f"top_k must be in [0, {MAX_TOP_K}] (0 disables it), got {self.top_k}")
        if not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")


def row_seed(base_seed: int, index: int) -> int:
    """The seed of row `index` when one seed serves many rows (a batch given one
    `SamplingParams`, the records of `regenerate`): a well-mixed uint32 of (base_seed, index).

    Mixing (rather than base_seed + index) keeps runs with neighbouring base seeds unrelated.
    """
    return int(np.random.SeedSequence([base_seed, index]).generate_state(1)[0])


@flax.struct.dataclass
class RowSampling:
    """`SamplingParams` of every batch row, as device arrays (so new values never recompile).

    Attributes:
        temperature: `[B]` float32.
        top_k: `[B]` int32.
        top_p: `[B]` float32.
        keys: `[B]` typed PRNG keys, one per request seed.
    """

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    keys: jax.Array

    @classmethod
    def from_params(cls, params: list[SamplingParams]) -> RowSampling:
        """One row per entry of `params`, each row's key drawn from its seed."""
        return cls(
            temperature=jnp.asarray([p.temperature for p in params], jnp.float32),
            top_k=jnp.asarray([p.top_k for p in params], jnp.int32),
            top_p=jnp.asarray([p.top_p for p in params], jnp.float32),
            keys=jax.vmap(jax.random.key)(jnp.asarray([p.seed for p in params], jnp.uint32)),
        )


# The top-k / top-p cut-off is looked for among this many largest logits first: one `lax.top_k`
# instead of sorting the vocabulary (on a CPU, sorting 49k logits costs ~14 ms a row, as much as a
# 135M model's decode step). Only when some row's kept set may reach past them is the vocabulary
# sorted, and that path extends the same computation, so no row depends on which path ran.
CUT_CANDIDATES = 256


def filter_logits(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    candidates: int = CUT_CANDIDATES,
) -> jax.Array:
    """Scaled logits with every token outside top-k / top-p set to -inf.

    Args:
        logits: `[B, ..., V]` raw float32 logits.
        temperature, top_k, top_p: `[B]` per-row parameters; temperature must be > 0 here.
        candidates: how many of the largest logits the cut-off is first looked for among (static).

    Returns:
        `[B, ..., V]`: `logits / temperature` where kept, -inf elsewhere; its softmax is the
        sampling distribution.
    """
    expand = lambda a: a.reshape(a.shape + (1,) * (logits.ndim - 1))  # noqa: E731
    scaled = logits / expand(temperature)
    vocab = scaled.shape[-1]
    top_k = jnp.where(top_k >= vocab, 0, top_k)  # keeps everything: no reason to sort
    k, p = expand(top_k), expand(top_p)
    num_candidates = min(candidates, vocab)

    def filtered(scaled):
        full_log_norm = jax.nn.logsumexp(scaled, axis=-1, keepdims=True)
        # The barrier keeps XLA from folding `_cutoff`'s read of the last candidate into the sort
        # top_k decomposes into: folded, the TopK rewrite no longer matches and the cheap path
        # becomes a full vocabulary sort (XLA:CPU: 5x the time; benchmarks/bench_top_k_sort.py).
        top = jax.lax.optimization_barrier(jax.lax.top_k(scaled, num_candidates)[0])
        cutoff, complete = _cutoff([top], full_log_norm, k, p)

        def from_sorted(scaled):
            ordered = -jnp.sort(-scaled, axis=-1)
            rest = [ordered[..., num_candidates:]] if num_candidates < ordered.shape[-1] else []
            return _cutoff([ordered[..., :num_candidates], *rest], full_log_norm, k, p)[0]

        cutoff = jax.lax.cond(jnp.all(complete), lambda _: cutoff, from_sorted, scaled)
        # Comparing against the smallest kept logit keeps ties at the boundary, as transformers
        # does for top-k.
        return jnp.where(scaled >= cutoff, scaled, -jnp.inf)

    needs_filter = jnp.any(top_k > 0) | jnp.any(top_p < 1.0)
    return jax.lax.cond(needs_filter, filtered, lambda s: s, scaled)


def _cutoff(parts, full_log_norm, k, p):
    """The smallest logit a row keeps, from its logits sorted in descending order.

    Args:
        parts: consecutive pieces of the sorted logits, `[B, ..., n_i]` each: the largest
            `n_0` alone (all a row needs when `complete`), or all of them.
        full_log_norm: `[B, ..., 1]` log-sum-exp over the whole vocabulary.
        k, p: top-k and top-p, broadcastable to `[B, ..., 1]`.

    Returns:
        `(cutoff [B, ..., 1], complete [B, ...])`: -inf where nothing is filtered; `complete` where
        `parts` surely hold every kept token.
    """
    ranks, offset = [], 0
    for part in parts:
        # In top-k's dtype: x64's default int64 against int32 `k` is refused under strict promotion.
        ranks.append(offset + jnp.arange(part.shape[-1], dtype=k.dtype))
        offset += part.shape[-1]
    # Top-k keeps every token tied with the k-th largest logit (as transformers' warper does).
    kth = functools.reduce(
        jnp.minimum,
        [
            jnp.min(jnp.where(rank < k, part, jnp.inf), axis=-1, keepdims=True)
            for part, rank in zip(parts, ranks, strict=True)
        ],
    )
    in_top_k = [jnp.where(k > 0, part >= kth, True) for part in parts]
    # Top-p measures mass under the top-k distribution where top-k is on, else the full softmax.
    top_k_log_norm = functools.reduce(
        jnp.logaddexp,
        [
            jax.nn.logsumexp(jnp.where(kept, part, -jnp.inf), axis=-1, keepdims=True)
            for part, kept in zip(parts, in_top_k, strict=True)
        ],
    )
    log_norm = jnp.where(k > 0, top_k_log_norm, full_log_norm)
    cutoff, mass = jnp.inf, 0.0
    for part, rank, kept in zip(parts, ranks, in_top_k, strict=True):
        probs = jnp.where(kept, jnp.exp(part - log_norm), 0.0)
        cumulative = mass + jnp.cumsum(probs, axis=-1)
        # Rows without top-p keep every token whatever the float32 cumsum's rounding, so a row's
        # tokens never depend on its batch-mates turning filtering on.
        kept &= (p >= 1.0) | (cumulative - probs < p) | (rank == 0)
        cutoff = jnp.minimum(cutoff, jnp.min(jnp.where(kept, part, jnp.inf), -1, keepdims=True))
        mass = cumulative[..., -1:]
    cutoff = jnp.where((k <= 0) & (p >= 1.0), -jnp.inf, cutoff)
    # With top-k, the first part holds the kept set when the k-th logit's ties end inside it.
    first = parts[0]
    top_k_inside = (k <= first.shape[-1]) & (first[..., -1:] < kth)
    complete = jnp.where(k > 0, top_k_inside, (p >= 1.0) | (mass >= p))[..., 0]
    return cutoff, complete


def sampling_logits(logits: jax.Array, sampling: RowSampling) -> jax.Array:
    """`[B, ..., V]` the rows' filtered, temperature-scaled logits; rows at temperature 0 get
    their logits as they are (their tokens are argmax and never read these)."""
    sampled = sampling.temperature > 0
    safe_t = jnp.where(sampled, sampling.temperature, 1.0)
    # A greedy row's top-k / top-p (OpenAI clients send top_p with temperature 0) would switch
    # the batch's filter on, and often its vocabulary sort, for nothing.
    top_k = jnp.where(sampled, sampling.top_k, 0)
    top_p = jnp.where(sampled, sampling.top_p, 1.0)
    return filter_logits(logits, safe_t, top_k, top_p)


def select_tokens(logits: jax.Array, sampling: RowSampling, positions: jax.Array) -> jax.Array:
    """The token at each position: argmax at temperature 0, else a draw from the filtered softmax.

    Args:
        logits: `[B, T, V]` float32 logits predicting the tokens at `positions`.
        sampling: the rows' sampling parameters.
        positions: `[B, T]` absolute positions of the tokens being chosen (keys the randomness).

    Returns:
        `[B, T]` int32 tokens.
    """
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(logits):
        filtered = sampling_logits(logits, sampling)
        keys = jax.vmap(lambda key, pos: jax.vmap(lambda p: jax.random.fold_in(key, p))(pos))(
            sampling.keys, positions
        )
        draws = jax.vmap(jax.vmap(jax.random.categorical))(keys, filtered).astype(jnp.int32)
        return jnp.where((sampling.temperature > 0)[:, None], draws, greedy)

    return jax.lax.cond(jnp.any(sampling.temperature > 0), sampled, lambda _: greedy, logits)
