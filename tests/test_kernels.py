"""The refinement-attention kernel (Pallas, interpreted on CPU) against its jnp reference, the
reference against `layers.attention` with the explicit mask, gradients, and the draft end to end.

Shapes are small (the interpreter compiles every shape anew) but cover the layout's branches:
context sizes that are not tile multiples (and smaller than one tile), GQA ratios 1/2/4, 1..4
candidates (padded to whole tiles), candidates split over several programs, context splits, and
per-candidate lengths 0 and S. On a GPU the compiled Triton kernel runs the same grid (and
"auto" sends the bfloat16 draft operands through it; float32 stays on the reference).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.kernels import Tiling, pallas_refinement, refinement, refinement_attention, select
from jetspec_jax.kernels.layout import make_layout
from jetspec_jax.models import layers
from jetspec_jax.models.block_stack import ContextCache
from jetspec_jax.models.config import TransformerConfig
from jetspec_jax.models.draft import DraftConfig
from tests.jaxprs import dot_precisions
from tests.lowering import abstract_mesh


def _block_mask(config: DraftConfig, cache: ContextCache, k_len: int) -> jax.Array:
    """`[B, K, S + K]`: every query sees the valid context slots, and the block causally or not.

    Context slots at or past a row's length are stale (or padding) and are always hidden; this is
    why the draft cannot use the target's position-only mask.

    The explicit-mask spelling of `draft_hidden`'s refinement attention: `layers.attention` over
    `[cache; block]` under this mask.
    """
    batch, capacity = cache.lengths.shape[0], cache.k.shape[2]
    context = jnp.arange(capacity)[None, None, :] < cache.lengths[:, None, None]
    context = jnp.broadcast_to(context, (batch, k_len, capacity))
    block = (
        jnp.tril(jnp.ones((k_len, k_len), bool))
        if config.causal
        else jnp.ones((k_len, k_len), bool)
    )
    block = jnp.broadcast_to(block, (batch, k_len, k_len))
    return jnp.concatenate([context, block], axis=-1)


# (B, C, K, N, N_kv, D, S, tiling): what each case exercises is in its id.
CASES = {
    "gqa1-c1-context-below-a-tile": ((2, 1, 4, 2, 2, 16, 5), None),
    "gqa2-c3-padded-cands-2splits": ((1, 3, 5, 4, 2, 16, 37), Tiling(32, 16, kv_splits=2)),
    "gqa4-c4-default-tiling": ((2, 4, 3, 8, 2, 16, 50), None),
    # Asks for 4 context splits; its context has 3 tiles, so it gets 3.
    "gqa4-cand-over-4-programs": ((1, 2, 16, 8, 2, 16, 70), Tiling(16, 32, kv_splits=4)),
    # The shipped SmolLM2 draft's heads (9 query over 3 KV, head_dim 64) with its block of 16.
    "gqa3-smollm2-draft": ((1, 1, 16, 9, 3, 64, 90), None),
}
# The interpreter everywhere; on a GPU also the compiled Triton kernel (the TPU kernel needs
# head_dim % 128 == 0, beyond these small shapes).
KERNEL_IMPLS = ["pallas_interpret"] + (["pallas"] if select.pallas_backend() == "triton" else [])
# Jitted: op-by-op dispatch would compile every op of the packing and the reference per shape.
_attention = jax.jit(refinement_attention, static_argnames=("causal", "impl", "tiling"))


def _operands(shape, dtype=jnp.float32, seed=0):
    """Random operands; lengths include 0 and S, the rest uniform in [0, S]."""
    batch, cands, k_len, heads, kv_heads, head_dim, s_len = shape
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims), dtype)

    lengths = rng.integers(0, s_len + 1, (batch, cands))
    lengths.flat[0] = 0
    lengths.flat[-1] = s_len
    return (
        normal(batch, cands, k_len, heads, head_dim),
        normal(batch, s_len, kv_heads, head_dim),
        normal(batch, s_len, kv_heads, head_dim),
        jnp.asarray(lengths, jnp.int32),
        normal(batch, cands, k_len, kv_heads, head_dim),
        normal(batch, cands, k_len, kv_heads, head_dim),
    )


def _q_shape(shape) -> tuple[int, ...]:
    batch, cands, k_len, heads, _, head_dim, _ = shape
    return (batch, cands, k_len, heads, head_dim)


def _max_abs(a, b) -> float:
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def test_cases_cover_the_layout_branches():
    """Guards the grid above: if a layout change made a case trivial, this says which."""
    lays = {
        name: make_layout(
            _q_shape(shape), (shape[0], shape[6], shape[4], shape[5]), tiling or Tiling()
        )
        for name, (shape, tiling) in CASES.items()
    }
    assert any(lay.context % lay.kv_tile for lay in lays.values())  # shifted last tile
    assert any(lay.padded_cands > lay.cands for lay in lays.values())
    assert any(lay.cands_per_tile > 1 for lay in lays.values())
    assert any(lay.subtiles > 1 for lay in lays.values())
    assert any(lay.kv_splits > 1 for lay in lays.values())
    assert lays["gqa4-cand-over-4-programs"].kv_splits == 3  # capped at the context's tiles
    assert lays["gqa1-c1-context-below-a-tile"].context > 5  # padded context


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_fp32(case, impl):
    shape, tiling = CASES[case]
    args = _operands(shape)
    for causal in (True, False):
        want = _attention(*args, causal=causal, impl="reference")
        got = _attention(*args, causal=causal, impl=impl, tiling=tiling)
        assert got.shape == want.shape == _q_shape(shape) and got.dtype == jnp.float32
        assert _max_abs(got, want) <= 1e-5, causal


def test_the_kernel_and_the_span_form_run_alike_under_x64_and_strict_promotion():
    """docs/DECODING.md: a process may set `jax_enable_x64` and strict dtype promotion. Python
    ints became int64 there: the kernel's tile counts (`pl.cdiv` over the int32 tile lengths) and
    the span form's slice indices (beside the int32 chunk start) were refused."""
    from jetspec_jax.kernels.reference import refinement_attention_over_span

    shape, tiling = CASES["gqa4-cand-over-4-programs"]
    q, ck, cv, lengths, bk, bv = _operands(shape)
    stacked = (jnp.stack([cv, ck]), jnp.stack([ck, cv]))

    def both_forms():
        kernel = refinement_attention(
            q, ck, cv, lengths, bk, bv, causal=True, impl="pallas_interpret", tiling=tiling
        )
        span = refinement_attention_over_span(
            q, *stacked, 1, lengths, bk, bv, causal=True, chunk=16
        )
        return np.asarray(kernel), np.asarray(span)

    want = both_forms()
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        got = both_forms()
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_context_lengths_outside_0_to_s_read_as_the_nearest_bound(impl):
    """A length past S sees the S slots, not the padding the kernel adds up to its tile; a
    negative one sees none: as the reference, which compares slots with the length."""
    shape, tiling = CASES["gqa1-c1-context-below-a-tile"]
    q, ck, cv, lengths, bk, bv = _operands(shape)
    s_len = ck.shape[1]
    outside = jnp.where(lengths == s_len, s_len + 7, jnp.where(lengths == 0, -3, lengths))
    assert bool(jnp.any(outside > s_len)) and bool(jnp.any(outside < 0))
    want = _attention(q, ck, cv, lengths, bk, bv, causal=True, impl="reference")
    got = _attention(q, ck, cv, outside, bk, bv, causal=True, impl=impl, tiling=tiling)
    assert _max_abs(got, want) <= 1e-5


def test_tpu_launch_matches_reference_in_the_tpu_interpreter():
    """The Mosaic launch (scalar-prefetched tile lengths, SMEM) under the TPU interpreter, which
    also raises on any out-of-bounds read."""
    shape, tiling = CASES["gqa2-c3-padded-cands-2splits"]
    args = _operands(shape)
    options = refinement.KernelOptions(True, shape[5] ** -0.5, tiling, "tpu", True)
    want = _attention(*args, causal=True, impl="reference")
    assert _max_abs(refinement.kernel_forward(*args, options), want) <= 1e-5


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_kernel_lowers_for_gpu_and_tpu_at_qwen3_draft_shapes(platform):
    """Pallas' Triton (GPU) and Mosaic (TPU) lowerings accept the kernel, from CPU. This runs the
    Pallas-level lowering only: Triton's PTX compile and Mosaic's layout passes run in the
    accelerator's XLA and are not exercised here."""
    backend = "tpu" if platform == "tpu" else "triton"
    tiling = refinement.TPU_TILING if backend == "tpu" else refinement.GPU_TILING
    options = refinement.KernelOptions(True, 128**-0.5, tiling, backend, False)
    mesh = abstract_mesh(platform)
    for dtype in (jnp.bfloat16, jnp.float32):
        for cands, context in ((1, 1000), (16, 8192)):  # 1000: not a tile multiple
            q = jax.ShapeDtypeStruct((1, cands, 16, 32, 128), dtype)
            ctx = jax.ShapeDtypeStruct((1, context, 8, 128), dtype)
            blk = jax.ShapeDtypeStruct((1, cands, 16, 8, 128), dtype)
            lengths = jax.ShapeDtypeStruct((1, cands), jnp.int32)
            with jax.sharding.use_abstract_mesh(mesh):
                traced = jax.jit(refinement.kernel_forward, static_argnums=6).trace(
                    q, ctx, ctx, lengths, blk, blk, options
                )
                text = traced.lower(lowering_platforms=(platform,)).as_text()
            assert ("triton" if platform == "cuda" else "tpu_custom_call") in text


@pytest.mark.parametrize("impl", KERNEL_IMPLS)
def test_kernel_bfloat16_is_as_accurate_as_the_reference(impl):
    shape, tiling = CASES["gqa4-c4-default-tiling"]
    args = _operands(shape, jnp.bfloat16, seed=1)
    exact = _attention(
        *[a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a for a in args],
        causal=True,
        impl="reference",
    )
    want = _attention(*args, causal=True, impl="reference")
    got = _attention(*args, causal=True, impl=impl, tiling=tiling)
    assert got.dtype == jnp.bfloat16
    assert _max_abs(got, want) <= 2e-2  # a few bf16 ulps of O(1) outputs
    assert _max_abs(got, exact) <= 2 * _max_abs(want, exact) + 1e-3


def test_the_reference_asks_for_float32_precision_when_any_operand_is_float32():
    """Mixed dtypes fall back to the reference (the kernel refuses them); a float32 context or
    block must not be multiplied at XLA's default (TF32 on GPUs) because the queries are
    bfloat16. CPUs ignore the request: the jaxpr is what a CPU test can check."""
    from jetspec_jax.kernels.reference import refinement_attention_over_span

    q, ck, cv, lengths, bk, bv = _operands((1, 1, 2, 2, 2, 16, 4))
    q = q.astype(jnp.bfloat16)
    stacked = (jnp.stack([ck, ck]), jnp.stack([cv, cv]))

    def dense(q):
        return refinement_attention(q, ck, cv, lengths, bk, bv, causal=True, impl="reference")

    def span(q):
        return refinement_attention_over_span(q, *stacked, 1, lengths, bk, bv, causal=True, chunk=2)

    for form in (dense, span):
        with jax.default_matmul_precision("default"):  # the library's request, not conftest's
            jaxpr = jax.make_jaxpr(form)(q).jaxpr
        precisions = set(dot_precisions(jaxpr))
        assert precisions == {(jax.lax.Precision.HIGHEST,) * 2}, (form.__name__, precisions)


@functools.partial(jax.jit, static_argnums=6)
def _explicit(q, context_k, context_v, lengths, block_k, block_v, causal):
    """Each candidate through `layers.attention` over `[context; own block]` with an explicit
    `[B, K, S + K]` mask."""
    batch, cands, k_len, heads, head_dim = q.shape
    s_len = context_k.shape[1]
    block = jnp.tril(jnp.ones((k_len, k_len), bool)) if causal else jnp.ones((k_len, k_len), bool)
    outs = []
    for c in range(cands):
        context = jnp.arange(s_len)[None, None, :] < lengths[:, c, None, None]
        mask = jnp.concatenate(
            [
                jnp.broadcast_to(context, (batch, k_len, s_len)),
                jnp.broadcast_to(block, (batch, k_len, k_len)),
            ],
            axis=-1,
        )
        keys = jnp.concatenate([context_k, block_k[:, c]], axis=1)
        values = jnp.concatenate([context_v, block_v[:, c]], axis=1)
        outs.append(layers.attention(q[:, c], keys, values, mask))
    return jnp.stack(outs, axis=1).reshape(q.shape)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_reference_equals_layers_attention_with_the_explicit_mask(causal):
    args = _operands((2, 3, 5, 4, 2, 16, 23), seed=2)
    got = _attention(*args, causal=causal, impl="reference")
    assert _max_abs(got, _explicit(*args, causal)) <= 1e-6
    # The mask matters: the other block mask is far off.
    assert _max_abs(got, _explicit(*args, not causal)) > 1e-2


@pytest.mark.parametrize("causal", [True, False])
def test_kernel_gradients_match_the_reference_and_layers_attention(causal):
    """The kernel's backward is the reference's VJP (`refinement.py`) with the call's own mask
    (causal JetSpec blocks, bidirectional DFlash ones), so equal gradients check the custom-VJP
    wiring; the loss values check that the kernel's forward is the one used."""
    shape, tiling = CASES["gqa2-c3-padded-cands-2splits"]
    q, ck, cv, _, bk, bv = _operands(shape, seed=3)
    lengths = jnp.asarray([[0, 20, 9]], jnp.int32)  # slots 20.. of 37 are stale for everyone
    cotangent = jnp.asarray(np.random.default_rng(4).standard_normal(_q_shape(shape)), jnp.float32)

    def loss(fn):
        return lambda q, ck, cv, bk, bv: jnp.sum(fn(q, ck, cv, lengths, bk, bv) * cotangent)

    def impl(name):
        return lambda *a: refinement_attention(*a, causal=causal, impl=name, tiling=tiling)

    wrt = (0, 1, 2, 3, 4)

    def grads(fn):
        return jax.jit(jax.value_and_grad(loss(fn), argnums=wrt))(q, ck, cv, bk, bv)

    (kernel_loss, kernel), (reference_loss, reference) = (
        grads(impl(name)) for name in ("pallas_interpret", "reference")
    )
    explicit_loss, explicit = grads(lambda *a: _explicit(*a, causal))
    assert abs(float(kernel_loss) - float(explicit_loss)) <= 1e-4 * abs(float(explicit_loss))
    assert abs(float(reference_loss) - float(explicit_loss)) <= 1e-4 * abs(float(explicit_loss))
    for name, got, want, anchor in zip(
        "q ck cv bk bv".split(), kernel, reference, explicit, strict=True
    ):
        assert _max_abs(got, want) <= 1e-5, name
        assert _max_abs(want, anchor) <= 1e-5, name
    # Stale context slots get no gradient; the visible ones do.
    for grad in kernel[1:3]:
        assert float(jnp.abs(grad[:, 20:]).max()) == 0.0
        assert float(jnp.abs(grad[:, :20]).min()) > 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_q=48), "block_q must be a power of two"),
        (dict(block_q=8), "block_q must be >= min_rows=16"),
        (dict(block_kv=8), "block_kv must be >= min_rows=16"),
        (dict(kv_splits=0), "kv_splits must be >= 1"),
    ],
)
def test_bad_tilings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Tiling(**kwargs)


def _replaced(index, shape):
    """An edit of the operands that swaps operand `index` for zeros of `shape`."""
    return lambda args: args[:index] + (jnp.zeros(shape),) + args[index + 1 :]


@pytest.mark.parametrize(
    "edit, message",
    [
        (_replaced(0, (2, 2, 2, 16)), r"q must be \[B, C, K, N, D\]"),
        (_replaced(2, (1, 5, 2, 16)), "context_k and context_v must both be"),
        (lambda a: _replaced(2, (1, 4, 2, 8))(_replaced(1, (1, 4, 2, 8))(a)), "does not fit q"),
        (_replaced(3, (1,)), r"context_lengths must be \[B, C\] = \(1, 1\)"),
        (_replaced(3, (1, 1)), "context_lengths must be integers, got float32"),
        (_replaced(4, (1, 1, 1, 2, 16)), r"block_k must be \[B, C, K, N_kv, D\]"),
    ],
)
def test_bad_shapes_are_named(edit, message):
    args = edit(_operands((1, 1, 2, 2, 2, 16, 4)))
    with pytest.raises(ValueError, match=message):
        refinement_attention(*args, causal=True)


def test_a_launch_without_a_tiling_gets_its_backends_default(monkeypatch):
    """A Mosaic (TPU) launch gets `TPU_TILING`, a Triton or interpreted one `GPU_TILING`."""
    tilings = []

    def launch(*args):
        tilings.append(args[-1].tiling)
        return args[0]

    monkeypatch.setattr(refinement, "_kernel_attention", launch)
    monkeypatch.setattr(select, "pallas_backend", lambda platform=None: "tpu")
    args = _operands((1, 1, 2, 2, 2, 128, 4))  # Mosaic takes head_dim 128
    refinement_attention(*args, causal=True, impl="pallas")
    refinement_attention(*args, causal=True, impl="pallas_interpret")
    assert tilings == [refinement.TPU_TILING, refinement.GPU_TILING]


def test_query_heads_must_group_over_kv_heads():
    q, k, v, lengths, bk, bv = _operands((1, 1, 2, 3, 2, 16, 4))
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2 KV heads"):
        refinement_attention(q, k, v, lengths, bk, bv, causal=True)


def test_impl_selection():
    args = _operands((1, 1, 2, 2, 2, 16, 4))
    with pytest.raises(ValueError, match="attention impl must be one of"):
        refinement_attention(*args, causal=True, impl="cudnn")
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="needs a GPU or TPU"):
            refinement_attention(*args, causal=True, impl="pallas")
        auto = _attention(*args, causal=True, impl="auto")
        np.testing.assert_array_equal(auto, _attention(*args, causal=True, impl="reference"))
    assert select.pallas_backend("gpu") == "triton"
    assert select.pallas_backend("tpu") == "tpu"
    assert select.pallas_backend("cpu") is None

    def operands(head_dim, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16):
        q = jax.ShapeDtypeStruct((1, 1, 16, 8, head_dim), dtype)
        kv = jax.ShapeDtypeStruct((1, 64, 2, head_dim), kv_dtype)
        blk = jax.ShapeDtypeStruct((1, 1, 16, 2, head_dim), kv_dtype)
        return q, kv, kv, blk, blk

    assert refinement.kernel_supports(*operands(128), "triton") is None
    assert refinement.kernel_supports(*operands(128), "tpu") is None
    assert "power-of-two" in refinement.kernel_supports(*operands(24), "triton")
    assert ">= 16, got 8" in refinement.kernel_supports(*operands(8), "triton")  # a power of two
    assert "head_dim % 128" in refinement.kernel_supports(*operands(64), "tpu")
    mixed = operands(128, jnp.float32)
    assert "several dtypes" in refinement.kernel_supports(*mixed, "triton")
    with pytest.raises(ValueError, match="several dtypes"):
        refinement_attention(
            *args[:3],
            args[3],
            *[a.astype(jnp.bfloat16) for a in args[4:]],
            causal=True,
            impl="pallas_interpret",
        )


def test_auto_takes_the_triton_kernel_for_bfloat16_only(monkeypatch):
    """On a GPU, "auto" launches the hardware-verified Triton kernel for bfloat16 operands (where
    it was measured faster) and keeps float32 on the reference (measured slower); operands the
    kernel does not take (head_dim 24) stay on the reference in any dtype."""
    monkeypatch.setattr(select, "pallas_backend", lambda platform=None: "triton")
    launched = []
    monkeypatch.setattr(
        refinement, "_kernel_attention", lambda *a: launched.append(a[-1].backend) or a[0]
    )
    for dtype, head_dim, expected in (
        (jnp.bfloat16, 16, ["triton"]),
        (jnp.float32, 16, []),
        (jnp.bfloat16, 24, []),
    ):
        launched.clear()
        args = _operands((1, 1, 2, 4, 2, head_dim, 4), dtype)
        refinement_attention(*args, causal=True, impl="auto")
        assert launched == expected, (dtype, head_dim)


# --- the draft ---------------------------------------------------------------------------------


def test_draft_attention_equals_the_explicit_mask_form():
    """`draft_hidden`'s attention (C = 1, stale cache slots past each row's length) is
    `layers.attention` under `_block_mask`, for the reference and the kernel (bidirectional here;
    the causal draft runs end to end below)."""
    draft_layers = TransformerConfig("qwen3", 97, 64, 96, 1, 4, 2, 16)
    config = DraftConfig(draft_layers, (0,), 5, **DraftConfig.variant_switches("dflash"))
    assert config.attention_impl == "auto"  # the default
    with pytest.raises(ValueError, match="attention impl must be one of"):
        dataclasses.replace(config, attention_impl="flash")
    c = config.layers
    rng = np.random.default_rng(5)
    cache = ContextCache(
        k=jnp.asarray(rng.standard_normal((1, 2, 24, c.num_kv_heads, c.head_dim)), jnp.float32),
        v=jnp.asarray(rng.standard_normal((1, 2, 24, c.num_kv_heads, c.head_dim)), jnp.float32),
        lengths=jnp.asarray([0, 17], jnp.int32),
    )
    q = jnp.asarray(rng.standard_normal((2, 5, c.num_heads, c.head_dim)), jnp.float32)
    bk, bv = (
        jnp.asarray(rng.standard_normal((2, 5, c.num_kv_heads, c.head_dim)), jnp.float32)
        for _ in range(2)
    )
    want = layers.attention(
        q,
        jnp.concatenate([cache.k[0], bk], axis=1),
        jnp.concatenate([cache.v[0], bv], axis=1),
        _block_mask(config, cache, 5),
    )
    for impl in ("reference", "pallas_interpret"):
        got = _attention(
            q[:, None],
            cache.k[0],
            cache.v[0],
            cache.lengths[:, None],
            bk[:, None],
            bv[:, None],
            causal=config.causal,
            impl=impl,
        )
        assert _max_abs(got.reshape(want.shape), want) <= 1e-6, impl


def test_greedy_speculative_decoding_is_the_same_with_the_kernel(checkpoints, monkeypatch):
    """Same tokens and the same per-round outcomes (k accepted, bonus), and the kernel did run.
    A vocabulary of 8 makes random drafts get accepted now and then, so the outcomes depend on
    the drafts."""
    launches = []  # counted when traced: every program that uses the kernel is traced once
    launch = pallas_refinement.kernel_call
    monkeypatch.setattr(
        pallas_refinement, "kernel_call", lambda *a, **k: launches.append(1) or launch(*a, **k)
    )
    target = jetspec_jax.load_target(checkpoints.get("qwen3_vocab8")[0])
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, init_std=0.1, seed=2)
    prompt = np.random.default_rng(6).integers(0, 8, 11).tolist()
    results = {}
    for impl in ("reference", "pallas_interpret"):
        results[impl] = jetspec_jax.generate(
            target,
            prompt,
            draft=draft.with_attention_impl(impl),
            method="jetspec++",
            max_new_tokens=24,
            stop_token_ids=[],
        )
        assert bool(launches) == (impl == "pallas_interpret"), impl
    ref, ker = results["reference"], results["pallas_interpret"]
    assert any(k > 0 for k, _ in ref.outcomes)
    assert ker.tokens == ref.tokens
    assert ker.outcomes == ref.outcomes


def test_a_float32_draft_and_adapter_run_the_kernel_on_a_bfloat16_target(checkpoints, monkeypatch):
    """The refinement stacks read the target's bf16 caches: their queries are cast to the cache
    dtype too, since the kernel takes one dtype (it refused the mix before). Same tokens and
    per-round outcomes as the reference, with the kernel launched; a vocabulary of 8 makes the
    outcomes depend on the drafts."""
    launches = []
    launch = pallas_refinement.kernel_call
    monkeypatch.setattr(
        pallas_refinement, "kernel_call", lambda *a, **k: launches.append(1) or launch(*a, **k)
    )
    path = checkpoints.get("qwen3_vocab8")[0]
    target = jetspec_jax.load_target(path, dtype="bfloat16")
    draft = jetspec_jax.init_draft(jetspec_jax.load_target(path), block_size=4, init_std=0.2)
    draft = draft.with_adapter(init_adapter(draft, init_std=0.05))
    assert draft.dtype == "float32"
    prompt = np.random.default_rng(7).integers(0, 8, 9).tolist()
    results = {}
    for impl in ("reference", "pallas_interpret"):
        results[impl] = jetspec_jax.generate(
            target,
            prompt,
            draft=draft.with_attention_impl(impl),
            method="jetspec++",
            refine_passes=1,
            refreshes=1,  # J1-R1: the adapter runs
            max_new_tokens=24,
            stop_token_ids=[],
        )
        assert bool(launches) == (impl == "pallas_interpret"), impl
    ref, ker = results["reference"], results["pallas_interpret"]
    assert any(k > 0 for k, _ in ref.outcomes)
    assert (ker.tokens, ker.outcomes) == (ref.tokens, ref.outcomes)
    assert (
        ref.tokens
        == jetspec_jax.generate(target, prompt, max_new_tokens=24, stop_token_ids=[]).tokens
    )
