"""The gated-delta-rule kernel (Pallas, interpreted on CPU) against the XLA chunked form, its
lowering for GPUs, the impl switch, and the hybrid target running on it end to end.

The XLA form (`gated_deltanet.chunked`) is itself checked against transformers' recurrence in
`test_qwen3_5_parity.py`; here it is the reference.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.kernels import chunked_delta_rule, delta_rule, pallas_delta_rule
from jetspec_jax.models import gated_deltanet
from jetspec_jax.models.config import TransformerConfig
from tests.lowering import abstract_mesh


@pytest.fixture(scope="module")
def hybrid_target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])


def _operands(
    batch, length, key_heads, heads, dk, dv, *, seed=0, parallel_keys=False, strong_decay=False
):
    """Prepared q, k (l2-normed, heads repeated), v, g <= 0, beta in (0, 1), a nonzero state.

    `parallel_keys`: every key is close to the first one and beta is near 1, the regime where
    the UT transform's matrix is nearly all ones below the diagonal (its power series would
    cancel catastrophically in float32; substitution must not).
    `strong_decay`: g = -A softplus(x + 1) with A ~ U(0.01, 16) per head, as transformers
    initialises Gated DeltaNet (about -15 per token): within a chunk the cumulative decay
    reaches ~ -1e3, where float32 sums of g in different orders disagree by ~ 1e-4.
    """
    ks = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(ks[0], (batch, length, key_heads, dk))
    k = jax.random.normal(ks[1], (batch, length, key_heads, dk))
    if parallel_keys:
        k = k[:, :1] + 0.05 * k
    q, k = gated_deltanet.prepare_qk(q, k, heads)
    v = jax.random.normal(ks[2], (batch, length, heads, dv))
    g = -0.3 * jax.nn.softplus(jax.random.normal(ks[3], (batch, length, heads)))
    if strong_decay:
        a = jax.random.uniform(jax.random.fold_in(ks[3], 1), (heads,), minval=0.01, maxval=16.0)
        g = -a * jax.nn.softplus(jax.random.normal(ks[3], (batch, length, heads)) + 1.0)
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (batch, length, heads)) + 3 * parallel_keys)
    state = jax.random.normal(ks[5], (batch, heads, dk, dv))
    return q, k, v, g, beta, state


# (B, T, Hk, H, Dk, Dv, parallel_keys, strong_decay): what each case exercises is in its id.
CASES = {
    "verify-block-16": (2, 16, 1, 2, 16, 16, True, False),
    "gqa2-dk-ne-dv-37-not-a-chunk-multiple": (1, 37, 2, 4, 16, 32, False, False),
    "three-chunks-parallel-keys": (1, 150, 1, 2, 16, 16, True, False),
    "three-chunks-strong-decay": (1, 150, 1, 2, 16, 16, True, True),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_the_xla_form(case):
    *shape, parallel, strong = CASES[case]
    args = _operands(*shape, parallel_keys=parallel, strong_decay=strong)
    want_out, want_state = chunked_delta_rule(*args, impl="reference")
    got_out, got_state = chunked_delta_rule(*args, impl="pallas_interpret")
    assert got_out.shape == want_out.shape and got_state.shape == want_state.shape
    assert float(jnp.max(jnp.abs(got_out - want_out))) <= 1e-5
    assert float(jnp.max(jnp.abs(got_state - want_state))) <= 1e-5


@pytest.mark.parametrize("impl", ["reference", "pallas_interpret"])
def test_operands_of_other_shapes_are_refused_and_an_empty_sequence_changes_nothing(impl):
    """The kernel sizes its blocks by the keys alone: a shorter `g` gave NaN outputs, a state of
    another width a non-finite one, without an error."""
    q, k, v, g, beta, state = _operands(1, 20, 1, 2, 16, 8)
    bad = dict(g=g[:, :16], state=state[:, :, :8], beta=beta[:, :, :1], v=v[:, :, :1])
    for name, wrong in bad.items():
        args = dict(q=q, k=k, v=v, g=g, beta=beta, state=state) | {name: wrong}
        with pytest.raises(ValueError, match=f"{name} has shape"):
            chunked_delta_rule(**args, impl=impl)
    out, final = chunked_delta_rule(*(x[:, :0] for x in (q, k, v, g, beta)), state, impl=impl)
    assert out.shape == (1, 0, 2, 8)
    np.testing.assert_array_equal(final, state)
    # float32 as documented, as a non-empty sequence's state, whatever the state came in.
    empty = (x[:, :0] for x in (q, k, v, g, beta))
    _, final = chunked_delta_rule(*empty, state.astype(jnp.bfloat16), impl=impl)
    assert final.dtype == jnp.float32


@pytest.mark.parametrize("strong_decay", [False, True])
def test_chunk_step_solves_the_ut_transform_stably(strong_decay):
    """One 64-position chunk with nearly parallel keys, against the float64 recurrence:
    substitution keeps float32 accuracy where a power series would not, and strong decays
    (cumulative ~ -1e3 within the chunk) keep it too."""
    q, k, v, g, beta, state = _operands(
        1, 64, 1, 1, 16, 16, parallel_keys=True, strong_decay=strong_decay
    )
    q, k, v, g, beta = (np.asarray(x[0, :, 0]) for x in (q, k, v, g, beta))
    state = np.asarray(state[0, 0])
    out, new_state = pallas_delta_rule.chunk_step(
        *(jnp.asarray(x) for x in (q, k, v, g[None, :], beta[:, None], state)),
        precision=jax.lax.Precision.HIGHEST,
    )
    # The recurrence itself, token by token, in float64.
    s, want = state.astype(np.float64), []
    for t in range(64):
        s = s * np.exp(g[t])
        s = s + np.outer(k[t], beta[t] * (v[t] - s.T @ k[t]))
        want.append(s.T @ q[t])
    assert np.max(np.abs(np.asarray(out) - np.stack(want))) <= 1e-5
    assert np.max(np.abs(np.asarray(new_state) - s)) <= 1e-5


def test_kernel_lowers_for_gpu_at_qwen3_5_27b_shapes():
    """Pallas' Triton lowering accepts the kernel, from CPU: a verification block and a prefill
    at the 27B's 48 value heads of 128 channels. (Triton's PTX compile runs only on a GPU.)"""
    for length in (16, 2048):
        x = jax.ShapeDtypeStruct((1, length, 48, 128), jnp.float32)
        g = jax.ShapeDtypeStruct((1, length, 48), jnp.float32)
        state = jax.ShapeDtypeStruct((1, 48, 128, 128), jnp.float32)
        call = functools.partial(
            pallas_delta_rule.kernel_call,
            chunk=min(length, delta_rule.MAX_CHUNK),
            num_warps=4,
            num_stages=1,
            interpret=False,
        )
        with jax.sharding.use_abstract_mesh(abstract_mesh("cuda")):
            traced = jax.jit(call).trace(x, x, x, g, g, state)
            text = traced.lower(lowering_platforms=("cuda",))
        assert "triton" in text.as_text()


def test_impl_selection():
    args = _operands(1, 16, 1, 2, 16, 16)
    empty = (*(x[:, :0] for x in args[:5]), args[5])  # refused alike: nothing to run is no excuse
    for operands in (args, empty):
        with pytest.raises(ValueError, match="must be one of"):
            chunked_delta_rule(*operands, impl="cuda")
        if jax.default_backend() == "cpu":
            with pytest.raises(ValueError, match="needs a GPU"):
                chunked_delta_rule(*operands, impl="pallas")
    assert delta_rule.kernel_supports((1, 16, 2, 16), (1, 16, 2, 16), "interpret") is None
    assert "power-of-two" in delta_rule.kernel_supports((1, 16, 2, 16), (1, 16, 2, 12), "triton")
    assert "TPU" in delta_rule.kernel_supports((1, 16, 2, 128), (1, 16, 2, 128), "tpu")
    with pytest.raises(ValueError, match="recurrence_impl must be one of"):
        TransformerConfig("qwen3", 8, 8, 8, 1, 2, 2, 4, recurrence_impl="fast")
    with pytest.raises(ValueError, match="not a multiple of chunk 16"):  # would drop 4 positions
        pallas_delta_rule.kernel_call(
            *_operands(1, 20, 1, 2, 16, 16), chunk=16, num_warps=4, num_stages=1, interpret=True
        )


def _record_launches(monkeypatch) -> list[dict]:
    """The keyword arguments of every kernel launch from here on (recorded when traced: a
    program that uses the kernel is traced once); each launch still runs."""
    launches, launch = [], pallas_delta_rule.kernel_call

    def recording(*args, **kwargs):
        launches.append(kwargs)
        return launch(*args, **kwargs)

    monkeypatch.setattr(pallas_delta_rule, "kernel_call", recording)
    return launches


def test_hybrid_target_is_the_same_on_the_kernel(hybrid_target, monkeypatch):
    """Greedy speculative decoding of the tiny hybrid target (prefill over several chunks, then
    verification blocks) gives the same tokens with the recurrence on the interpreted kernel,
    which did run."""
    launches = _record_launches(monkeypatch)
    kernel_config = dataclasses.replace(hybrid_target.config, recurrence_impl="pallas_interpret")
    on_kernel = dataclasses.replace(hybrid_target, config=kernel_config)
    draft = jetspec_jax.init_draft(hybrid_target, variant="jetspec", block_size=4, seed=0)
    prompt = np.random.default_rng(0).integers(0, 97, 70).tolist()
    tokens = []
    for target in (hybrid_target, on_kernel):
        tokens.append(
            jetspec_jax.generate(
                target, prompt, draft=draft, method="jetspec", max_new_tokens=12, stop_token_ids=[]
            ).tokens
        )
        assert bool(launches) == (target is on_kernel)
    assert tokens[0] == tokens[1]


@pytest.mark.parametrize("size", [1, 2, 16, 64])
def test_unit_lower_inverse_is_the_inverse(size):
    """The XLA form's blocked inverse against float64 `inv`, with the nearly-all-ones strict lower
    part of nearly parallel keys (where the power series would lose every digit)."""
    rng = np.random.default_rng(size)
    strict = np.tril(0.95 + 0.05 * rng.random((3, size, size)), -1).astype(np.float32)
    got = np.asarray(gated_deltanet.unit_lower_inverse(jnp.asarray(strict)))
    want = np.linalg.inv(np.eye(size) + strict.astype(np.float64))
    assert np.max(np.abs(got - want)) <= 1e-5


def test_chunk_sizes_agree_and_must_be_powers_of_two():
    """The chunking is an implementation detail: any power-of-two chunk gives the same result;
    another size is refused by name (the blocked inverse doubles its blocks)."""
    args = _operands(*CASES["gqa2-dk-ne-dv-37-not-a-chunk-multiple"][:-2])
    want_out, want_state = gated_deltanet.chunked(*args, chunk_size=64)
    for size in (4, 16):
        out, state = gated_deltanet.chunked(*args, chunk_size=size)
        assert float(jnp.max(jnp.abs(out - want_out))) <= 1e-5
        assert float(jnp.max(jnp.abs(state - want_state))) <= 1e-5
    for size in (0, 24):
        with pytest.raises(ValueError, match=f"chunk_size must be a power of two, got {size}"):
            gated_deltanet.chunked(*args, chunk_size=size)


def test_a_short_sequence_is_one_chunk_of_the_next_power_of_two():
    """A 16-token verification block solves a 16 x 16 system, not one of DEFAULT_CHUNK padded with
    inert positions: the result would be the same (which no other test can tell), at up to 16x the
    work in every verify forward."""

    def dims(jaxpr) -> set[int]:
        found = set()
        for eqn in jaxpr.eqns:
            for var in eqn.outvars:
                found.update(getattr(var.aval, "shape", ()))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                found |= dims(sub)
        return found

    for length, size in ((16, 16), (5, 8)):
        args = _operands(1, length, 1, 2, 16, 16)
        traced = jax.make_jaxpr(gated_deltanet.chunked)(*args)
        assert max(dims(traced.jaxpr)) == 16 and size in dims(traced.jaxpr), (length, size)
        assert gated_deltanet.DEFAULT_CHUNK not in dims(traced.jaxpr), length


def test_auto_never_takes_the_delta_rule_kernel_until_measured_faster(monkeypatch):
    """No backend is in `AUTO_BACKENDS` yet: even where Triton is hardware-verified, "auto" runs
    the XLA recurrence."""
    from jetspec_jax.kernels import select

    monkeypatch.setattr(select, "pallas_backend", lambda platform=None: "triton")
    launched = []

    def launch(*args, **kwargs):
        launched.append(kwargs)
        return args[2], args[5]

    monkeypatch.setattr(pallas_delta_rule, "kernel_call", launch)
    delta_rule.chunked_delta_rule(*_operands(1, 16, 1, 2, 16, 16), impl="auto")
    assert launched == []


@pytest.mark.parametrize("length", [1, 4, 16, 37])
def test_the_delta_rule_kernel_runs_chunks_of_at_least_16(monkeypatch, length):
    """Triton's dot needs >= 16 rows: a short sequence still runs chunks of 16 (zero-padded,
    inert), a long one chunks of at most MAX_CHUNK."""
    launches = _record_launches(monkeypatch)
    delta_rule.chunked_delta_rule(*_operands(1, length, 1, 2, 16, 16), impl="pallas_interpret")
    chunks = [launch["chunk"] for launch in launches]
    assert chunks and all(16 <= chunk <= delta_rule.MAX_CHUNK for chunk in chunks), chunks
