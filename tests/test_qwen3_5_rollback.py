"""Speculative decoding on the Qwen3.5 hybrid: recurrent/conv state rollback after rejections."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.models.hybrid_cache import ROLLBACK_WINDOW
from jetspec_jax.models.transformer import init_cache
from tests.oracles import OracleDraft, OracleProposer
from tests.test_qwen3_5_parity import append

N_NEW = 32
BLOCK = 8


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3_5")[0])


@dataclasses.dataclass(frozen=True)
class CyclingWrongProposer(OracleProposer):
    """The oracle's drafts, corrupted at block index `(round + row) % (K - 1)`: over the rounds
    every block position gets rejected, and rows of one batch reject at different positions."""

    def propose(self, params, target_params, state, anchor, anchor_positions, sequence):
        args = (params, target_params, state, anchor, anchor_positions, sequence)
        drafts, _ = super().propose(*args)
        wrong = ((state + jnp.arange(drafts.shape[0])) % (self.block_size - 1))[:, None]
        hit = jnp.arange(self.block_size - 1)[None, :] == wrong
        return jnp.where(hit, (drafts + 1) % self.vocab_size, drafts), state

    def observe(self, params, target_params, state, *_):
        return state + 1  # the state is the round counter (`start` gives 0)


@dataclasses.dataclass(eq=False)
class CyclingWrongDraft(OracleDraft):
    def proposer(self, target, *, method: str, block_size: int | None = None, **_):
        if block_size is not None:
            raise ValueError("an oracle drafts blocks of its own block_size")
        return CyclingWrongProposer(self.block_size, self.vocab_size), self.params()


def _greedy(target, prompts):
    """Autoregressive greedy tokens, one target forward per token (reusing the parity tests'
    compiled prefill and step shapes rather than compiling the AR loop again)."""
    cache = init_cache(target.config, 3, 128, jnp.float32)
    lengths = jnp.asarray([len(p) for p in prompts])
    tokens = np.array([p + [0] * (80 - len(p)) for p in prompts])
    logits, cache = append(target.params, tokens, cache, lengths, config=target.config)
    last = np.asarray(logits)[np.arange(3), np.asarray(lengths) - 1].argmax(-1)
    out = [last]
    for _ in range(N_NEW - 1):
        logits, cache = append(
            target.params, last[:, None], cache, jnp.ones((3,), jnp.int32), config=target.config
        )
        last = np.asarray(logits)[:, 0].argmax(-1)
        out.append(last)
    return np.stack(out, axis=1).tolist()


def test_greedy_speculative_equals_autoregressive_with_rejections_everywhere(target):
    """Rows of 13, 5 and 21 prompt tokens, each rejecting at
    every block position over its rounds: the tokens are exactly greedy AR's."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, n).tolist() for n in (13, 5, 21)]
    reference = _greedy(target, prompts)
    continuation = np.zeros((4, 128), np.int32)  # the session buckets 3 rows to 4
    for b, (prompt, tokens) in enumerate(zip(prompts, reference, strict=True)):
        sequence = prompt + tokens
        continuation[b, : len(sequence)] = sequence
    draft = CyclingWrongDraft(continuation, BLOCK, target.config.vocab_size)
    results = jetspec_jax.generate_batch(
        target, prompts, draft=draft, method="dflash", max_new_tokens=N_NEW, stop_token_ids=[]
    )
    for ref, result in zip(reference, results, strict=True):
        assert result.tokens == ref
        accepted = {k for k, _ in result.outcomes[:-1]}
        assert accepted == set(range(BLOCK - 1))  # a rejection at every position


@functools.partial(jax.jit, static_argnames="appended")
def _rolled_back(cache, lengths, appended=None):
    return cache.rolled_back(lengths, appended=appended)


def _prefill(target, rows, capacity=128):
    """A fresh cache holding `rows` (lists of token ids), right-padded to the parity tests' 80."""
    width = 80
    tokens = np.array([r + [0] * (width - len(r)) for r in rows])
    cache = init_cache(target.config, len(rows), capacity, jnp.float32)
    lengths = jnp.asarray([len(r) for r in rows])
    return append(target.params, tokens, cache, lengths, config=target.config)[1]


def _roll_back_and_prefill(target, verified, prompts, block, keep, appended):
    """`(rolled, fresh, kept lengths)`: `verified` (the prompts' cache after a forward over
    `block`) rolled back to keep `keep[b]` tokens of row b's block, and a fresh prefill of them."""
    kept = np.array([len(p) + k for p, k in zip(prompts, keep, strict=True)])
    rolled = _rolled_back(verified, jnp.asarray(kept), appended)
    rows = [p + block[b, :k].tolist() for b, (p, k) in enumerate(zip(prompts, keep, strict=True))]
    return rolled, _prefill(target, rows), kept


def _assert_same_state(ours, fresh, lengths):
    np.testing.assert_array_equal(np.asarray(ours.lengths), lengths)
    np.testing.assert_allclose(ours.state, fresh.state, atol=1e-5, rtol=0)
    np.testing.assert_allclose(ours.conv, fresh.conv, atol=1e-5, rtol=0)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(ours.k[:, b, :n], fresh.k[:, b, :n], atol=1e-5, rtol=0)
        np.testing.assert_allclose(ours.v[:, b, :n], fresh.v[:, b, :n], atol=1e-5, rtol=0)


@pytest.mark.parametrize("appended", [None, BLOCK])
def test_rollback_after_a_partially_accepted_block_equals_a_fresh_prefill(target, appended):
    """Verify a block of 8 on rows at different lengths, keep 0, 3 and all 8 of it: the conv,
    recurrent and KV states are those of a prefill of the kept tokens, decoding continues as from
    that prefill, and a second, deeper rollback within the same block works too. Over the whole
    window, or over the block's 8 positions only (`appended`, as verification rolls back)."""
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, n).tolist() for n in (9, 70, 2)]  # + 8 fits the width 80
    block = rng.integers(0, 97, (3, BLOCK))
    cache = _prefill(target, prompts)
    _, verified = append(target.params, block, cache, jnp.full((3,), BLOCK), config=target.config)
    for keep in ([0, 3, 8], [0, 1, 2]):
        rolled, fresh, kept = _roll_back_and_prefill(
            target, verified, prompts, block, keep, appended
        )
        _assert_same_state(rolled, fresh, kept)
        verified = rolled  # the second rollback goes deeper into the same block

    nxt = rng.integers(0, 97, (3, BLOCK))
    ours, _ = append(target.params, nxt, rolled, jnp.full((3,), BLOCK), config=target.config)
    theirs, _ = append(target.params, nxt, fresh, jnp.full((3,), BLOCK), config=target.config)
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)


@pytest.mark.parametrize("appended", [None, 8])
def test_rollback_before_the_window_poisons_the_row(target, appended):
    """Past the last forward's block there is no state to restore: NaN, never a wrong state."""
    cache = _prefill(target, [[1, 2, 3], [4, 5, 6, 7], [8]])
    _, verified = append(
        target.params, np.ones((3, 8), np.int32), cache, jnp.full((3,), 8), config=target.config
    )
    # Row 0 before its block start (3).
    rolled = _rolled_back(verified, jnp.asarray([2, 5, 9]), appended)
    assert np.isnan(np.asarray(rolled.state[:, 0])).all()
    assert np.isnan(np.asarray(rolled.conv[:, 0], np.float32)).all()  # not the window's start
    assert np.isfinite(np.asarray(rolled.state[:, 1:])).all()
    assert np.isfinite(np.asarray(rolled.conv[:, 1:], np.float32)).all()


@pytest.mark.parametrize("appended", [None, 8])
def test_rolling_back_a_hybrid_row_past_its_length_keeps_the_row(target, appended):
    """`rolled_back` to a length past a row's own keeps the row as it is (its length, recurrent
    and conv states), as `KVCache` does: what lies past a row's length is not its context."""
    cache = _prefill(target, [[1, 2, 3], [4, 5, 6, 7]])
    _, verified = append(
        target.params, np.ones((2, 8), np.int32), cache, jnp.full((2,), 8), config=target.config
    )
    rolled = _rolled_back(verified, jnp.asarray([9, 40]), appended)  # row 1 holds 12
    np.testing.assert_array_equal(rolled.lengths, [9, 12])
    np.testing.assert_allclose(rolled.state[:, 1], verified.state[:, 1], atol=1e-5, rtol=0)
    np.testing.assert_allclose(
        np.asarray(rolled.conv[:, 1], np.float32), np.asarray(verified.conv[:, 1], np.float32)
    )


def test_a_rollback_past_the_window_width_is_refused(target):
    cache = _prefill(target, [[1, 2, 3]])
    for appended in (0, ROLLBACK_WINDOW + 1):
        with pytest.raises(ValueError, match=f"appended={appended}: a forward of 1 to"):
            cache.rolled_back(jnp.asarray([2]), appended=appended)


def test_a_draft_block_longer_than_the_rollback_window_is_refused(target):
    """A verified block longer than the hybrid cache's window would be taken for a prefill and
    leave rejecting rows with unreachable (NaN) recurrent states: refused where draft meets
    target."""
    jetspec_jax.init_draft(target, variant="jetspec", num_layers=1, block_size=ROLLBACK_WINDOW)
    with pytest.raises(jetspec_jax.CheckpointError, match="exceeds the 32 positions"):
        jetspec_jax.init_draft(
            target, variant="jetspec", num_layers=1, block_size=ROLLBACK_WINDOW + 1
        )


@pytest.mark.parametrize("appended", [None, ROLLBACK_WINDOW])
def test_a_block_as_long_as_the_rollback_window_rolls_back(target, appended):
    """A verified block of exactly W = ROLLBACK_WINDOW positions is still a block, not a
    prefill: it records a window to roll back in, and `appended=W` is accepted."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 97, n).tolist() for n in (9, 40, 2)]
    block = rng.integers(0, 97, (3, ROLLBACK_WINDOW))
    cache = _prefill(target, prompts)
    width = jnp.full((3,), ROLLBACK_WINDOW)
    _, verified = append(target.params, block, cache, width, config=target.config)
    keep = [0, 17, ROLLBACK_WINDOW]
    _assert_same_state(*_roll_back_and_prefill(target, verified, prompts, block, keep, appended))
