"""One seed, independent streams: no consumer of a run's seed draws with another's key."""

from __future__ import annotations

import jax
import numpy as np

import jetspec_jax
import jetspec_jax.adapter
import jetspec_jax.draft
from jetspec_jax.adapter import init_adapter
from jetspec_jax.random_streams import ADAPTER_INIT, DRAFT_INIT, EVAL_BATCH, TRAIN_STEP, stream

SEED = 0


def _bits(keys) -> set[tuple[int, ...]]:
    return {tuple(row) for row in np.asarray(jax.random.key_data(keys)).reshape(-1, 2).tolist()}


def _folded(purpose: int, n: int) -> set[tuple[int, ...]]:
    return _bits(jax.vmap(lambda i: jax.random.fold_in(stream(SEED, purpose), i))(np.arange(n)))


def test_init_step_and_eval_keys_never_coincide(checkpoints, monkeypatch):
    """The keys the initialisers really use (recorded), against the training and evaluation
    streams the step functions fold their counters into."""
    used = {"draft": [], "adapter": []}
    into = []  # the initialiser running

    def random_tensor(spec, key, init_std):
        used[into[-1]].append(key)
        return original(spec, key, init_std)

    original = jetspec_jax.draft.random_tensor
    monkeypatch.setattr(jetspec_jax.draft, "random_tensor", random_tensor)  # both draw with it
    target = jetspec_jax.load_target(checkpoints.get("qwen3")[0])
    into.append("draft")
    draft = jetspec_jax.init_draft(target, variant="jetspec++", num_layers=1, seed=SEED)
    into.append("adapter")
    init_adapter(draft, seed=SEED)

    draft_keys = _bits(jax.numpy.stack(used["draft"]))
    adapter_keys = _bits(jax.numpy.stack(used["adapter"]))
    steps, evals = _folded(TRAIN_STEP, 256), _folded(EVAL_BATCH, 256)
    assert len(draft_keys) == len(used["draft"]) and len(adapter_keys) == len(used["adapter"])
    groups = [draft_keys, adapter_keys, steps, evals]
    for i, a in enumerate(groups):
        for b in groups[i + 1 :]:
            assert not a & b


def test_streams_of_different_seeds_never_coincide():
    """Each stream folds its purpose into its seed's key: a stream of one seed is no stream of
    another (as `key(seed + purpose)` would make seed 0's training draws seed 1's adapter's)."""
    purposes = (DRAFT_INIT, ADAPTER_INIT, TRAIN_STEP, EVAL_BATCH)
    keys = _bits(jax.numpy.stack([stream(seed, p) for seed in range(4) for p in purposes]))
    assert len(keys) == 4 * len(purposes)
