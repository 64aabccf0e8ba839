"""The building blocks of a decoder layer, as pure functions of parameter dicts.

Parameter leaves follow flax's naming: linear layers hold `kernel` `[in, out]` (and `bias` `[out]`
when the checkpoint has one), norms hold `scale`, embeddings hold `embedding`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jetspec_jax.kernels.online_softmax import fold_cache_span
from jetspec_jax.kernels.precision import matmul_precision
from jetspec_jax.models.kv_cache import write_layer
from jetspec_jax.models.rope import apply_rope

Params = dict


def embed_inputs(params: Params, tokens: jax.Array | None, inputs: jax.Array | None) -> jax.Array:
    """A decoder's layer-0 input `[B, T, H]`: the embedding of `tokens` `[B, T]`, or `inputs` as
    given (the decoder runs a model's upper layers on predicted states)."""
    if (tokens is None) == (inputs is None):
        raise ValueError("pass exactly one of tokens and inputs")
    if inputs is not None:
        return inputs
    return jnp.take(params["embed_tokens"]["embedding"], tokens, axis=0)


def appended_positions(lengths: jax.Array, length: int) -> jax.Array:
    """`[B, T]` int32 absolute positions of `length` tokens appended to rows of `lengths` `[B]`
    (slot = position in every cache): `lengths[b] + arange(T)`."""
    return lengths[:, None] + jnp.arange(length, dtype=jnp.int32)[None, :]


def stacked_taps(
    taps: dict[int, jax.Array], tap_layers: tuple[int, ...], hidden: jax.Array, num_layers: int
) -> jax.Array | None:
    """`[n_taps, B, T, H]` the outputs `taps[i]` `[B, T, H]` of the tap layers, in `tap_layers`
    order (None for none); the last layer's is the final-normed `hidden`, as HF's
    `hidden_states[L]`."""
    if not tap_layers:
        return None
    return jnp.stack([hidden if i == num_layers - 1 else taps[i] for i in tap_layers])


def wider_float(a, b) -> jnp.dtype:
    """The wider of two float dtypes (float32 for float32 and bfloat16), as standard promotion
    picks it; `jnp.promote_types` refuses the pair under `jax_numpy_dtype_promotion="strict"`."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    return a if a == b or a.itemsize > b.itemsize else b


def linear(params: Params, x: jax.Array) -> jax.Array:
    """`x @ kernel (+ bias)`; `x` is `[..., in]`."""
    kernel = params["kernel"]
    precision = matmul_precision(x, kernel)
    # Operands of two dtypes (a float32 adapter on a bfloat16 target's taps) meet in the wider,
    # as standard promotion has them, cast here: strict promotion has no implicit path.
    dtype = wider_float(x.dtype, kernel.dtype)
    y = jnp.matmul(x.astype(dtype), kernel.astype(dtype), precision=precision)
    if "bias" in params:
        y = y + params["bias"].astype(dtype)
    return y


def rms_normalized(x: jax.Array, eps: float) -> jax.Array:
    """`x / sqrt(mean(x^2) + eps)` over the last axis, in float32: the core of every RMSNorm
    variant (each casts and scales it the way its HF counterpart does)."""
    x32 = x.astype(jnp.float32)
    return x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)


def rms_norm(params: Params, x: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, output in the input dtype (as HF)."""
    scale = params["scale"]
    dtype = wider_float(scale.dtype, x.dtype)  # as `linear`: explicit for strict promotion
    return scale.astype(dtype) * rms_normalized(x, eps).astype(x.dtype).astype(dtype)


def swiglu_mlp(params: Params, x: jax.Array) -> jax.Array:
    """`down(silu(gate(x)) * up(x))`: `[..., H]` -> `[..., H]`."""
    return linear(
        params["down_proj"],
        jax.nn.silu(linear(params["gate_proj"], x)) * linear(params["up_proj"], x),
    )


def rotary_heads(
    proj: Params,
    norm: Params | None,
    x: jax.Array,
    num_heads: int,
    head_dim: int,
    positions: jax.Array,
    inv_freq,
    eps: float,
) -> jax.Array:
    """Queries or keys: `[B, T, H]` -> projected, per-head RMS-normed (when `norm`), rotated.

    Returns `[B, T, num_heads, head_dim]`.
    """
    batch, length, _ = x.shape
    y = linear(proj, x).reshape(batch, length, num_heads, head_dim)
    if norm is not None:
        y = rms_norm(norm, y, eps)
    return apply_rope(y, positions, inv_freq)


def value_heads(proj: Params, x: jax.Array, num_heads: int, head_dim: int) -> jax.Array:
    """Values: `[B, T, H]` -> `[B, T, num_heads, head_dim]`."""
    batch, length, _ = x.shape
    return linear(proj, x).reshape(batch, length, num_heads, head_dim)


def causal_mask(q_positions: jax.Array, k_positions: jax.Array) -> jax.Array:
    """`[B, T, S]` from `q_positions` `[B, T]` and `k_positions` `[B, S]`: key j is visible to
    query i iff `k_positions[j] <= q_positions[i]`.

    Masking by absolute position covers the target's cases: plain causal attention over the input
    (both position sets are `arange(T)`) and attention over a cache whose slots past a row's length
    are stale (those slots sit at positions later than any current query).
    """
    return k_positions[:, None, :] <= q_positions[:, :, None]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query softmax attention.

    Args:
        q: `[B, T, N, D]` queries.
        k, v: `[B, S, N_kv, D]` keys and values, `N % N_kv == 0`.
        mask: `[B, T, S]` bool, True where a query may attend to a key.

    Returns:
        `[B, T, N * D]` in the dtype of `v`; scores and softmax are float32.
    """
    batch, length, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    q = q.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
    precision = matmul_precision(q, k, v)
    scores = jnp.einsum(
        "btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32
    )
    scores = scores * (head_dim**-0.5)
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, precision=precision)
    return out.reshape(batch, length, num_heads * head_dim)


def causal_self_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    kv: tuple[jax.Array, jax.Array] | None,
    index: int,
    *,
    chunk: int,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
    """Causal GQA attention of T new tokens, over themselves or over a KV cache they join.

    Args:
        q: `[B, T, N, D]`; k, v: `[B, T, N_kv, D]` (RoPE applied) at `positions` `[B, T]`.
        kv: None (a full forward over the T tokens), or the stacked `[L, B, S, N_kv, D]` cache
            keys and values: layer `index` gets k, v written at their positions (slot =
            position) and is attended to, slots past a row's length masked out by position.
        chunk: `cached_attention`'s chunk (`TransformerConfig.cache_chunk`).

    Returns:
        `(out [B, T, N * D], kv)`, kv updated (None without a cache).
    """
    if kv is None:
        return attention(q, k, v, causal_mask(positions, positions)), None
    k_cache, v_cache = (
        write_layer(c, index, new, positions) for c, new in zip(kv, (k, v), strict=True)
    )
    out = cached_attention(q, k_cache, v_cache, index, positions, chunk=chunk)
    return out, (k_cache, v_cache)


def cached_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    layer: int,
    positions: jax.Array,
    *,
    chunk: int,
) -> jax.Array:
    """Queries at `positions` attend to the slots of cache layer `layer` at or before them.

    A cache of at most `chunk` slots is one `attention` over the whole layer, masked by position.
    A longer one runs an online softmax over chunks of `chunk` slots, only as many as the latest
    query position needs (a dynamic trip count): the slots past them are not read. A
    preallocated cache is mostly empty early in a long generation; reading all of it every round
    made AR several times slower at long budgets (`benchmarks/bench_cache_span.py`).

    Args:
        q: `[B, T, N, D]` queries.
        k_cache, v_cache: `[L, B, S, N_kv, D]` the stacked cache (slot = position).
        layer: the layer to attend to.
        positions: `[B, T]` the queries' positions.
        chunk: slots per chunk (`TransformerConfig.cache_chunk`).

    Returns:
        `[B, T, N * D]` in the dtype of `v_cache`; scores and softmax statistics are float32.
    """
    batch, length, num_heads, head_dim = q.shape
    _, _, capacity, num_kv_heads, _ = k_cache.shape
    if capacity <= chunk:
        slots = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
        return attention(q, k_cache[layer], v_cache[layer], causal_mask(positions, slots))
    group = num_heads // num_kv_heads
    q = q.reshape(batch, length, num_kv_heads, group, head_dim)
    precision = matmul_precision(q, k_cache, v_cache)
    f32, lowest = jnp.float32, jnp.finfo(jnp.float32).min

    def chunk_scores(k, slots):
        scores = jnp.einsum(
            "btkgd,bskd->bkgts", q, k, precision=precision, preferred_element_type=f32
        )
        visible = slots <= positions[:, :, None]  # [B, T, C]
        return scores * head_dim**-0.5, visible[:, None, None]  # [B, 1, 1, T, C]

    stats = (batch, num_kv_heads, group, length)
    state = (
        jnp.full(stats, lowest, f32),
        jnp.zeros(stats, f32),
        jnp.zeros((*stats, head_dim), f32),
    )
    # Slots up to the latest query's position; every query sees slot 0, so no total stays 0.
    span = jnp.max(positions) + 1
    _, total, acc = fold_cache_span(
        state, k_cache, v_cache, layer, span, chunk, chunk_scores, "bkgts,bskd->bkgtd", precision
    )
    out = (acc / total[..., None]).astype(v_cache.dtype)  # [B, N_kv, G, T, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads * head_dim)
