"""Draft training on a tiny target: blocks, loss, resume, sharding, and that training helps tau."""

from __future__ import annotations

import dataclasses
import fcntl
import gc
import json
import os
import shutil
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from scipy import stats

import jetspec_jax
from jetspec_jax import CheckpointError
from jetspec_jax.adapter import init_adapter
from jetspec_jax.models.draft import DraftConfig
from jetspec_jax.training import evaluate as evaluate_module
from jetspec_jax.training import run_loop, trainer
from jetspec_jax.training.blocks import build_blocks
from jetspec_jax.training.config import (
    DataConfig,
    DraftArchConfig,
    MeshConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
)
from jetspec_jax.training.data import read_regenerated, to_example, training_dataset
from jetspec_jax.training.differences import leaf_differences
from jetspec_jax.training.evaluate import eval_prompt_ids, evaluate_tau, prompts_tau
from jetspec_jax.training.run_helpers import Throughput, check_fits_context, host_params
from jetspec_jax.training.run_loop import LOCK_FILE, has_checkpoint
from jetspec_jax.training.sharding import batch_sharding, make_mesh, param_shardings
from jetspec_jax.training.step import (
    StepConfig,
    apply_gradients,
    decayed_leaves,
    init_state,
    learning_rate_schedule,
    make_optimizer,
    train_step,
)
from jetspec_jax.training.trainer import train


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def data_files(target, tmp_path_factory):
    """Regenerated conversations: random prompts, the target's own greedy responses."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, int(rng.integers(6, 14))).tolist() for _ in range(28)]
    results = jetspec_jax.generate_batch(target, prompts, max_new_tokens=32, stop_token_ids=[])
    root = tmp_path_factory.mktemp("data")
    files = {"train": root / "train.jsonl", "heldout": root / "heldout.jsonl"}
    for name, rows in (("train", range(24)), ("heldout", range(24, 28))):
        with files[name].open("w") as f:
            for i in rows:
                f.write(json.dumps({"prompt_ids": prompts[i], "response_ids": results[i].tokens}))
                f.write("\n")
    return files


def _config(data_files, run_dir, *, evaluate: bool = True, **optim) -> TrainConfig:
    """The tiny run's config; `evaluate=False`: no tau evaluation (during or after the run)."""
    return TrainConfig(
        # Tau is measured on training prompts: on a random tiny target, what is learnable from 24
        # sequences is those sequences; the point is that learning reaches the inference path.
        data=DataConfig(
            files=(str(data_files["train"]),),
            max_length=48,
            eval_prompts=str(data_files["train"]) if evaluate else None,
            eval_num_prompts=4,
            eval_max_new_tokens=24,
        ),
        draft=DraftArchConfig(variant="jetspec++", num_layers=1, block_size=4, init_std=0.05),
        optim=OptimConfig(
            **{
                "batch_size": 4,
                "anchors_per_sequence": 16,
                "steps": 80,
                "learning_rate": 5e-3,
                "warmup_steps": 5,
                "compute_dtype": "float32",
                **optim,
            }
        ),
        mesh=MeshConfig(data=1, fsdp=1),
        run=RunConfig(dir=str(run_dir), checkpoint_every=1000, log_every=5, tensorboard=True),
    )


# The short runs' optimisation: one compiled train step for all of them (and, with an fsdp mesh,
# one for `test_two_devices_train_like_one[mesh1]` and the no-device test). No warmup: the first
# update moves every parameter by about the learning rate (the two-device test relies on it).
SHORT = dict(steps=6, warmup_steps=0)


@pytest.fixture(scope="module")
def straight_run(target, data_files, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    return train(_config(data_files, run_dir), target=target), run_dir


def test_training_lowers_the_loss_and_beats_the_random_draft_on_tau(
    target, data_files, straight_run
):
    result, run_dir = straight_run
    assert result.steps == 80
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [x["loss"] for x in lines if "loss" in x]
    assert losses[-1] < 0.5 * losses[0], losses
    assert any((run_dir / "tensorboard").iterdir())
    random_draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=0)
    random_tau = evaluate_tau(
        target, random_draft, data_files["train"], num_prompts=4, max_new_tokens=24
    )
    assert result.eval_tau > random_tau + 0.2, (result.eval_tau, random_tau)
    # The export loads back as a draft for this target and decodes losslessly.
    draft = jetspec_jax.load_draft(result.export_dir, target)
    prompt = json.loads(data_files["train"].read_text().splitlines()[0])["prompt_ids"]
    spec = jetspec_jax.generate(target, prompt, draft=draft, method="jetspec++", max_new_tokens=20)
    assert spec.tokens == jetspec_jax.generate(target, prompt, max_new_tokens=20).tokens


def test_eval_tau_pools_the_rounds_of_every_prompt(target, data_files, straight_run):
    """The trainers' tau: tokens per verification round over all prompts' rounds together (not a
    mean of per-prompt means), each prompt decoded as `generate` decodes it alone."""
    draft = jetspec_jax.load_draft(straight_run[0].export_dir, target)
    prompts = eval_prompt_ids(target, data_files["train"], num_prompts=3)
    rounds = [
        jetspec_jax.generate(
            target, p, draft=draft, method="jetspec++", max_new_tokens=24
        ).acceptance_lengths[1:]
        for p in prompts
    ]
    pooled = sum(map(sum, rounds)) / sum(map(len, rounds))
    assert pooled > 1.2  # trained: the check is not 1.0 == 1.0
    assert prompts_tau(target, draft, prompts, max_new_tokens=24) == pytest.approx(pooled)


def test_interrupted_and_resumed_run_equals_an_uninterrupted_one(
    target, data_files, straight_run, tmp_path
):
    straight, _ = straight_run
    config = _config(data_files, tmp_path / "resumed")
    config = dataclasses.replace(config, run=dataclasses.replace(config.run, checkpoint_every=20))
    assert not has_checkpoint(tmp_path / "resumed")
    assert train(config, target=target, stop_after=37) is None  # "killed" after 37 steps
    # Killed between two periodic checkpoints: the last (20) was followed by 17 more batches
    # drawn and 17 more (donating) steps, which the resumed run must redo exactly.
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "37")
    assert has_checkpoint(tmp_path / "resumed")
    # As if the killed run had logged steps past its last checkpoint (37), then died mid-line:
    # the resumed run logs those steps again, so the file must not keep the stale rows.
    with (tmp_path / "resumed" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 40, "loss": 9.0}\n{"step": 45, "loss": 9.0}\n{"step": 5')
    resumed = train(config, target=target)
    assert resumed.steps == straight.steps == 80
    pairs = zip(
        jax.tree.leaves(straight.draft.params), jax.tree.leaves(resumed.draft.params), strict=True
    )
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert resumed.metrics["loss"] == straight.metrics["loss"]
    rows = [json.loads(x) for x in (tmp_path / "resumed" / "metrics.jsonl").open()]
    assert [x["step"] for x in rows if "loss" in x] == list(range(5, 81, 5))
    assert [x["step"] for x in rows if "eval_tau" in x] == [80]
    kept = (tmp_path / "resumed" / "checkpoints").iterdir()
    assert sorted(int(p.name) for p in kept if p.name.isdigit()) == [40, 60, 80]  # keep 3


def test_a_finished_runs_rerun_keeps_the_setup_its_export_was_made_with(
    target, data_files, straight_run, caplog
):
    """Rerunning a finished run with another setting trains nothing: the change is warned
    about, and the recorded setup stays the one the checkpoints and the export were made with."""
    _, run_dir = straight_run
    recorded = (run_dir / "run_setup.json").read_text()
    config = _config(data_files, run_dir)
    changed = dataclasses.replace(config.optim, learning_rate=1e-4)
    with caplog.at_level("WARNING", logger="jetspec_jax.training.run_loop"):
        result = train(dataclasses.replace(config, optim=changed), target=target)
    assert result.already_finished and result.steps == 80
    assert "resuming with optim.learning_rate 0.0001 (the checkpoints': 0.005)" in caplog.text
    assert (run_dir / "run_setup.json").read_text() == recorded


def test_the_metrics_log_writes_a_scalar_per_tap_to_tensorboard(tmp_path, monkeypatch):
    """Per-tap vectors (the adapter's nmse, say) are one TensorBoard scalar per tap; the JSONL
    row keeps the list."""
    import tensorboardX

    scalars = []

    class Writer:
        def __init__(self, logdir):
            assert logdir == str(tmp_path / "tensorboard")

        def add_scalar(self, name, value, step):
            scalars.append((name, value, step))

        def close(self):
            pass

    monkeypatch.setattr(tensorboardX, "SummaryWriter", Writer)
    with run_loop.MetricsLog(tmp_path, True, start_step=0) as log:
        log.write(3, {"loss": 1.5, "nmse": [0.5, 0.25]})
    assert scalars == [("loss", 1.5, 3), ("nmse/0", 0.5, 3), ("nmse/1", 0.25, 3)]
    row = json.loads((tmp_path / "metrics.jsonl").read_text())
    assert row == {"step": 3, "loss": 1.5, "nmse": [0.5, 0.25]}


def test_logged_looks_for_the_key_at_that_step(tmp_path):
    """Whether a step's evaluation is in the metrics log: an earlier step's does not count."""
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 5, "eval_tau": 1.5}\n{"step": 10, "loss": 0.5}\n\n{"step": 10, "x": 1}\n'
    )
    assert run_loop.logged(tmp_path, 5, "eval_tau")
    assert not run_loop.logged(tmp_path, 10, "eval_tau")
    assert run_loop.logged(tmp_path, 10, "x")
    assert not run_loop.logged(tmp_path / "none", 5, "eval_tau")  # no log yet


def test_setup_differences_name_each_changed_leaf_and_skip_keys_of_one_side():
    """A key only one side has is another version's structure (a field added or removed
    since), not a change of setting."""
    was = {"optim": {"learning_rate": 0.1, "steps": 5, "removed": 1}, "target": "a"}
    now = {"optim": {"learning_rate": 0.2, "steps": 5, "added": 2}, "target": "b"}
    assert leaf_differences(was, now) == [
        ("optim.learning_rate", 0.1, 0.2),
        ("target", "a", "b"),
    ]


def _toy_config(variant, block_size=16):
    draft = jetspec_jax.models.config.TransformerConfig(
        model_type="qwen3",
        vocab_size=50,
        hidden_size=8,
        intermediate_size=8,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=8,
    )
    return DraftConfig(
        layers=draft,
        target_layer_ids=(0,),
        block_size=block_size,
        mask_token_id=49,
        **DraftConfig.variant_switches(variant),
    )


def test_a_resume_with_another_setup_is_warned_about_and_another_state_refused(
    checkpoints, target, data_files, tmp_path, caplog, monkeypatch
):
    """The restored data position and schedule assume the setup the checkpoints were written
    with; a resume with other data or optimisation settings says what changed. (The changed
    setting here is the data file, which compiles no other train step; the rerun of the finished
    run above is warned about a changed learning rate by the same `opened_run` check.)"""
    config = _config(data_files, tmp_path, evaluate=False, **SHORT)
    assert train(config, target=target, stop_after=1) is None
    assert json.loads((tmp_path / "run_setup.json").read_text())["records"] == 24
    with caplog.at_level("WARNING", logger="jetspec_jax.training.run_loop"):
        recorded = json.loads((tmp_path / "run_setup.json").read_text())
        del recorded["records"]  # as an older version recorded it: not a change of setup
        (tmp_path / "run_setup.json").write_text(json.dumps(recorded))
        assert train(config, target=target, stop_after=1) is None
        assert not [r for r in caplog.records if "resuming" in r.getMessage()]
        copy = str(shutil.copy(data_files["train"], tmp_path / "copy.jsonl"))  # the 24 records
        config = dataclasses.replace(config, data=dataclasses.replace(config.data, files=(copy,)))
        train(config, target=target, stop_after=1)
        # That resume trained on: its checkpoints are the new setup's, recorded; the next
        # resume with it (the same setup, every key recorded) is silent.
        assert train(config, target=target, stop_after=1) is None
    (warning,) = [r.getMessage() for r in caplog.records if "resuming" in r.getMessage()]
    was = [str(data_files["train"])]
    assert f"resuming with data_files {[copy]!r} (the checkpoints': {was!r})" in warning
    recorded = json.loads((tmp_path / "run_setup.json").read_text())
    assert recorded["data_files"] == [copy] and recorded["records"] == 24
    # A train state of another shape cannot be resumed: said by run, not as orbax's tree diff,
    # naming the setting that changed.
    deeper = dataclasses.replace(config.draft, num_layers=2)
    with pytest.raises(ValueError, match="does not hold this run's train state") as refused:
        train(dataclasses.replace(config, draft=deeper), target=target, stop_after=1)
    assert "changed since: draft.num_layers 2 (the checkpoints': 1)" in str(refused.value)
    assert "new run.dir" in str(refused.value)
    # So is another draft of the same shapes, which would restore and train on as the new one;
    # taps given as the default rule gives them are the same draft (no step runs either way).
    dflash = dataclasses.replace(config.draft, variant="dflash")
    with pytest.raises(ValueError, match="changed since: draft.variant 'dflash' \\(the checkp"):
        train(dataclasses.replace(config, draft=dflash), target=target, stop_after=0)
    taps = dataclasses.replace(config.draft, target_layer_ids=(0,))  # the rule's: (1,)
    with pytest.raises(
        ValueError, match="draft.target_layer_ids \\[0\\] \\(the checkpoints': None"
    ):
        train(dataclasses.replace(config, draft=taps), target=target, stop_after=0)
    # Each process saved its own data position: another process count is refused by name.
    recorded = json.loads((tmp_path / "run_setup.json").read_text())
    assert recorded["process_count"] == 1 and recorded["target"] == config.target
    (tmp_path / "run_setup.json").write_text(json.dumps({**recorded, "process_count": 2}))
    with pytest.raises(ValueError, match="written by 2 process\\(es\\), this run has 1"):
        train(config, target=target, stop_after=1)
    # It needs the recorded setup alone: refused before the target's weights load (minutes for a
    # large target), as a job moved to other hosts meets it.
    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("loaded"))
    named = dataclasses.replace(config, target=str(checkpoints.get("qwen3")[0]))
    with pytest.raises(ValueError, match="written by 2 process\\(es\\), this run has 1"):
        train(named, stop_after=1)


def test_the_mesh_is_part_of_the_recorded_setup(target, data_files, tmp_path, caplog):
    """Processes given different `mesh` settings would build different meshes and wait in their
    first collective forever: the resolved mesh is in the setup every process compares
    (`check_processes_agree`). A job moved to other hardware resumes, told what changed."""
    config = _config(data_files, tmp_path, evaluate=False, **SHORT)
    assert train(config, target=target, stop_after=1) is None
    recorded = json.loads((tmp_path / "run_setup.json").read_text())
    assert recorded["mesh"] == {"data": 1, "fsdp": 1}
    moved = dataclasses.replace(config, mesh=MeshConfig(data=1, fsdp=2))
    with caplog.at_level("WARNING", logger="jetspec_jax.training.run_loop"):
        assert train(moved, target=target, stop_after=1) is None
    assert "resuming with mesh.fsdp 2 (the checkpoints': 1)" in caplog.text


def test_weight_decay_takes_the_kernels_only_and_not_biases():
    """The decay mask is True on linear kernels alone: biases (a draft with attention biases has
    them) are left undecayed like the norm scales, the matrices-only convention."""
    params = {"q_proj": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "norm": {"scale": 1}}
    mask = decayed_leaves(params)
    assert mask == {"q_proj": {"kernel": True, "bias": False}, "norm": {"scale": False}}


def test_weight_decay_shrinks_the_kernels_and_leaves_the_norm_scales(target):
    draft = jetspec_jax.init_draft(target, block_size=4, seed=0)
    optim = OptimConfig(learning_rate=0.1, warmup_steps=1, steps=10, weight_decay=0.5)
    optimizer = make_optimizer(optim)
    state = init_state(draft.params, optimizer)
    zeros = jax.tree.map(jnp.zeros_like, state.params)
    update = jax.jit(optimizer.update)  # one dispatch instead of one per leaf and op
    updates, _ = update(zeros, state.opt_state, state.params)  # update 1: lr 0.1, no gradient
    flat = jax.tree_util.tree_leaves_with_path(updates)
    kernels = [(p, u) for p, u in flat if p[-1].key == "kernel"]
    scales = [(p, u) for p, u in flat if p[-1].key == "scale"]
    assert kernels and scales and len(kernels) + len(scales) == len(flat)
    params = dict(jax.tree_util.tree_leaves_with_path(state.params))
    for path, update in kernels:
        np.testing.assert_allclose(update, -0.1 * 0.5 * params[path], rtol=1e-6, atol=1e-9)
    for _, update in scales:
        assert not np.any(update)


def test_clean_prefix_lengths_follow_the_schedule():
    """c = 0 (all noise after the anchor) with probability 1/4, else uniform on 1 .. K-1: a
    chi-square test of the 4096 blocks' counts (false alarm 1e-4), and no c outside 0 .. K-1."""
    config = _toy_config("jetspec++")
    k_len = config.block_size
    tokens = jnp.tile(jnp.arange(200, dtype=jnp.int32) % 49, (64, 1))
    mask = jnp.arange(200)[None] >= 10
    blocks = build_blocks(jax.random.key(0), tokens, jnp.broadcast_to(mask, (64, 200)), config, 64)
    clean = np.asarray(blocks.clean).ravel()
    assert clean.min() >= 0 and clean.max() <= k_len - 1
    counts = np.bincount(clean, minlength=k_len)
    want = np.array([0.25] + [0.75 / (k_len - 1)] * (k_len - 1)) * clean.size
    statistic = np.sum((counts - want) ** 2 / want)
    assert statistic < stats.chi2.ppf(1 - 1e-4, k_len - 1), (statistic, counts)


@pytest.mark.parametrize("variant", ["dflash", "jetspec", "jetspec++"])
def test_blocks_never_show_a_row_its_own_future(variant):
    """Every input a row can see (itself and earlier rows if causal, all rows otherwise) comes
    from a position before the one the row predicts; masks carry no position."""
    config = _toy_config(variant, block_size=8)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 49, (8, 64)), jnp.int32)
    mask = jnp.asarray(np.arange(64)[None] >= rng.integers(1, 20, (8, 1)))
    blocks = build_blocks(jax.random.key(1), tokens, mask, config, 16)
    src, predicted, weights = (
        np.asarray(x) for x in (blocks.input_positions, blocks.predicted, blocks.weights)
    )
    assert np.count_nonzero(weights) > 100  # the loop below checks something
    for b, a, i in zip(*np.nonzero(weights), strict=True):
        visible = src[b, a, : i + 1] if config.causal else src[b, a]
        assert np.all(visible < predicted[b, a, i]), (variant, visible, predicted[b, a, i])
        assert np.all(visible <= blocks.anchors[b, a] + i)
    anchors_ok = np.asarray(mask)[np.arange(8)[:, None], np.asarray(blocks.anchors) + 1]
    assert np.all(anchors_ok | (weights.sum(-1) == 0))  # supervised anchors precede response tokens


@pytest.mark.parametrize("variant", ["dflash", "jetspec", "jetspec++"])
def test_blocks_supervise_exactly_the_drafts(variant):
    """A block of K rows is verified as [anchor, d_1 .. d_{K-1}]: every variant's loss covers the
    predictions of those K-1 drafts and nothing else (a token-input block's last row predicts the
    position after the block, which no decoding uses)."""
    config = _toy_config(variant, block_size=8)
    tokens = jnp.tile(jnp.arange(200, dtype=jnp.int32) % 49, (4, 1))
    blocks = build_blocks(jax.random.key(2), tokens, jnp.ones((4, 200), bool), config, 16)
    offsets = np.asarray(blocks.predicted) - np.asarray(blocks.anchors)[..., None]
    supervised = np.asarray(blocks.weights) > 0
    full = np.asarray(blocks.anchors) + 8 < 200  # blocks wholly inside the sequence
    assert full.sum() > 40
    assert np.all(supervised[full] == (offsets[full] >= 1) & (offsets[full] <= 7))


@pytest.mark.parametrize("variant", ["dflash", "jetspec"])
def test_mask_input_blocks_are_the_anchor_then_the_configs_mask_token(variant):
    """Mask-input drafts decode blocks of [anchor, mask x (K-1)] (`proposers.first_pass`), so they
    train on the same inputs: the config's mask token (49 here, a token no sequence holds), not
    some fixed id. The visibility tests above see input positions only, not the tokens."""
    config = _toy_config(variant, block_size=8)
    tokens = jnp.tile(jnp.arange(200, dtype=jnp.int32) % 49, (4, 1))
    blocks = build_blocks(jax.random.key(3), tokens, jnp.ones((4, 200), bool), config, 16)
    inputs, anchors = np.asarray(blocks.tokens), np.asarray(blocks.anchors)
    np.testing.assert_array_equal(inputs[..., 0], np.asarray(tokens)[0][anchors])
    assert np.all(inputs[..., 1:] == config.mask_token_id)


def _right_padded_batch():
    """`(tokens [4, 64], loss mask, T)`: responses after prompts of 7 .. 20 tokens, ending at
    30 .. 64 with padding after (mask False)."""
    rng = np.random.default_rng(5)
    length, prompt, end = 64, np.array([7, 12, 3, 20]), np.array([40, 55, 30, 64])
    positions = np.arange(length)[None]
    tokens = np.where(positions < end[:, None], rng.integers(1, 49, (4, length)), 0)
    mask = (positions >= prompt[:, None]) & (positions < end[:, None])
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask), length


@pytest.mark.parametrize("num_anchors", [24, 48])
def test_block_weights_equal_a_numpy_reference_on_right_padded_sequences(num_anchors):
    """Row i of anchor a is supervised exactly when i < K-1, a precedes a response token, and
    position a+i+1 is a response token: not the prompt, not right padding, not past the end.
    48 anchors are more than the 27 to 44 candidates of each sequence: the rest are invalid
    anchors, some of whose rows land on response tokens."""
    config = _toy_config("jetspec++", block_size=8)
    tokens, mask, length = _right_padded_batch()
    blocks = build_blocks(jax.random.key(3), tokens, mask, config, num_anchors)
    mask, anchors = np.asarray(mask), np.asarray(blocks.anchors)
    want = np.zeros(blocks.weights.shape, np.float32)
    for b, j in np.ndindex(anchors.shape):
        a = anchors[b, j]
        if a + 1 < length and mask[b, a + 1]:
            for i in range(7):
                want[b, j, i] = a + i + 1 < length and mask[b, a + i + 1]
    np.testing.assert_array_equal(np.asarray(blocks.weights), want)
    assert (want.sum(-1) < 7).sum() > 5  # blocks that run into the padding are among them


def test_block_rows_copy_the_clean_prefix_and_noise_from_at_or_before_the_anchor():
    """Rows 0..c of a token-input block are positions a..a+c of the sequence; the noise rows
    after them are copies of positions at or before the anchor; the tokens are those copies."""
    config = _toy_config("jetspec++", block_size=8)
    tokens, mask, length = _right_padded_batch()
    blocks = build_blocks(jax.random.key(4), tokens, mask, config, 24)
    src, clean = np.asarray(blocks.input_positions), np.asarray(blocks.clean)
    anchors = np.asarray(blocks.anchors)
    np.testing.assert_array_equal(
        blocks.tokens, np.asarray(tokens)[np.arange(4)[:, None, None], src]
    )
    for b, j in np.ndindex(anchors.shape):
        a, c = anchors[b, j], clean[b, j]
        np.testing.assert_array_equal(
            src[b, j, : c + 1], np.minimum(a + np.arange(c + 1), length - 1)
        )
        assert np.all(src[b, j, c + 1 :] <= a)
    # A process's x64 mode (64-bit draws by default) builds the same blocks from the same key.
    with jax.enable_x64(True):
        wide = build_blocks(jax.random.key(4), tokens, mask, config, 24)
    jax.tree.map(np.testing.assert_array_equal, wide, blocks)


def test_the_schedule_warms_up_then_decays_to_the_end_ratio_at_the_last_update():
    """Read at the updates done so far (optax's count): update 1 is the warmup's first step up
    from 0, update `warmup_steps` the peak, update `steps` (the last) the end rate."""
    config = OptimConfig(
        learning_rate=1e-3, warmup_steps=10, steps=100, end_learning_rate_ratio=0.1
    )
    schedule = learning_rate_schedule(config)
    assert float(schedule(0)) == pytest.approx(1e-4)
    assert float(schedule(4)) == pytest.approx(5e-4)
    assert float(schedule(9)) == pytest.approx(1e-3)
    assert float(schedule(54)) == pytest.approx(1e-4 + 0.5 * 9e-4)  # the cosine's middle
    assert float(schedule(99)) == pytest.approx(1e-4)


@pytest.mark.parametrize("grad_clip", [1.0, 2.5])
def test_gradients_are_clipped_to_their_global_norm_before_adam(grad_clip):
    """Adam's first update is about sign(g) whatever g's size, so the clipping is read from its
    first moment: (1 - b1) * clip * g / |g| for a gradient of norm 50 clipped to `grad_clip` (a
    second value: a clip norm fixed at the default would pass with 1.0 alone)."""
    config = OptimConfig(learning_rate=1e-3, warmup_steps=1, steps=10, grad_clip=grad_clip)
    optimizer = make_optimizer(config)
    params = {"w": {"kernel": jnp.ones((3,))}}
    gradient = {"w": {"kernel": jnp.asarray([30.0, 40.0, 0.0])}}
    _, state = optimizer.update(gradient, optimizer.init(params), params)
    adam = [
        s
        for s in jax.tree.leaves(state, is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    (moment,) = [s.mu["w"]["kernel"] for s in adam]
    np.testing.assert_allclose(moment, 0.1 * grad_clip * np.array([0.6, 0.8, 0.0]), rtol=1e-6)


def test_the_reported_gradient_norm_is_the_gradients_before_clipping():
    """`grad_norm` is the global norm of the loss's gradient as it came (50 here), not of the
    clipped gradient (1) nor of the update Adam made of it."""
    config = OptimConfig(learning_rate=1e-3, warmup_steps=1, steps=10, grad_clip=1.0)
    params = {"w": {"kernel": jnp.ones((3,))}}
    gradient = {"w": {"kernel": jnp.asarray([30.0, 40.0, 0.0])}}
    state = init_state(params, make_optimizer(config))
    _, metrics = apply_gradients(state, gradient, {}, config, None)
    assert float(metrics["grad_norm"]) == pytest.approx(50.0)


def _one_step_inputs(target, compute_dtype="float32"):
    """`(state, batch, config)` of a tiny draft's train step: a warmup of 2 steps to a rate of
    1e-3, one batch of 2 random sequences whose first 4 tokens are the prompt."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, num_layers=1)
    optim = OptimConfig(
        learning_rate=1e-3,
        warmup_steps=2,
        steps=4,
        batch_size=2,
        anchors_per_sequence=4,
        compute_dtype=compute_dtype,
    )
    config = StepConfig(target=target.config, draft=draft.config, optim=optim)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 32))
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "loss_mask": jnp.broadcast_to(jnp.arange(32) >= 4, (2, 32)),
    }
    return init_state(draft.params, make_optimizer(optim)), batch, config


def test_each_step_draws_new_blocks_and_reports_its_rate_and_gradient_norm(target):
    """The same batch and weights at steps 0 and 1: the steps draw other anchors and noise
    (their keys fold in the step), so their losses differ. Each step reports the rate it ran at
    (half the peak, then the peak: a warmup of 2 updates) and the gradient's norm."""
    state, batch, config = _one_step_inputs(target)
    start = jax.tree.map(np.asarray, state.params)  # the step donates the state's buffers
    after, first = train_step(state, target.params, batch, config=config)
    moved = jax.tree.map(lambda a, b: np.abs(np.asarray(a) - b).max(), after.params, start)
    assert min(jax.tree.leaves(moved)) > 0  # the first update already trains
    again = _one_step_inputs(target)[0].replace(step=after.step)
    _, second = train_step(again, target.params, batch, config=config)
    assert float(first["loss"]) != float(second["loss"])
    assert float(first["learning_rate"]) == pytest.approx(5e-4)
    assert float(second["learning_rate"]) == pytest.approx(1e-3)
    assert float(first["grad_norm"]) > 1e-3


@pytest.mark.parametrize("compute_dtype", ["bfloat16", "float32"])
def test_the_draft_runs_in_the_compute_dtype_and_keeps_float32_masters(target, compute_dtype):
    """The step casts the draft's weights to `compute_dtype` for its forward (the frozen target
    is float32 here: any bfloat16 in the program is the draft's); the updated masters stay
    float32."""
    state, batch, config = _one_step_inputs(target, compute_dtype)
    program = train_step.lower(state, target.params, batch, config=config).as_text()
    assert ("bf16" in program) == (compute_dtype == "bfloat16")
    state, _ = train_step(state, target.params, batch, config=config)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_a_step_under_strict_dtype_promotion_equals_the_default_one(target):
    """A user's process may set `jax_numpy_dtype_promotion="strict"`: the loss casts its bool
    matches, and optax's update (Python floats with its int32 count) runs with standard
    promotion, so the step trains as by default."""
    state, batch, config = _one_step_inputs(target)
    default, metrics = train_step(state, target.params, batch, config=config)
    with jax.numpy_dtype_promotion("strict"):
        strict, strict_metrics = train_step(
            _one_step_inputs(target)[0], target.params, batch, config=config
        )
    assert float(strict_metrics["loss"]) == float(metrics["loss"])
    jax.tree.map(np.testing.assert_array_equal, strict.params, default.params)


def test_updates_under_x64_equal_the_default_ones():
    """A user's process may set `jax_enable_x64`: optax's Python floats (Adam's bias corrections,
    the schedule) would then meet the int32 step count in float64, and round the float32 update
    otherwise; the updates run in 32 bits, so training equals the default run bit for bit."""
    optim = OptimConfig(learning_rate=1e-3, warmup_steps=2, steps=4)
    rng = np.random.default_rng(0)
    params = {"proj": {"kernel": rng.normal(size=(16, 16))}, "norm": {"scale": rng.normal(size=16)}}
    grads = [jax.tree.map(lambda x: rng.normal(size=x.shape), params) for _ in range(3)]

    def updated():
        state = init_state(params, make_optimizer(optim))
        update = jax.jit(lambda state, grads: apply_gradients(state, grads, {}, optim, None))
        for g in grads:
            state, metrics = update(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), g))
        return jax.tree.map(np.asarray, (state, metrics))

    default = updated()
    with jax.enable_x64(True):
        x64 = updated()
    jax.tree.map(np.testing.assert_array_equal, x64, default)


@pytest.mark.parametrize("mesh", [MeshConfig(data=2, fsdp=1), MeshConfig(data=1, fsdp=2)])
def test_two_devices_train_like_one(target, data_files, tmp_path, mesh):
    """Two steps on two devices give one device's losses, gradient norms and parameters. Without
    warmup the first step moves every parameter by about the learning rate (Adam's first update
    is about sign(g) * lr), so a gradient that is only one batch shard's flips many of those
    signs; a sum over shards instead of their mean (which Adam's updates do not see) doubles
    the gradient norm."""
    config = _config(data_files, tmp_path, **SHORT)
    records = [json.loads(x) for x in data_files["train"].read_text().splitlines()]
    batches = iter(training_dataset(records, batch_size=4, max_length=48, seed=0))
    batches = [next(batches) for _ in range(2)]
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=0)
    step_config = StepConfig(target=target.config, draft=draft.config, optim=config.optim)
    runs = []
    for devices, mesh_config in (([jax.devices()[0]], MeshConfig(1, 1)), (jax.devices()[:2], mesh)):
        m = make_mesh(mesh_config, devices)
        state = init_state(draft.params, make_optimizer(config.optim))
        state = jax.device_put(state, param_shardings(state, m))
        params = jax.device_put(target.params, param_shardings(target.params, m))
        metrics = []
        for batch in batches:
            sharded = {k: jax.device_put(v, batch_sharding(m)) for k, v in batch.items()}
            state, step_metrics = train_step(state, params, sharded, config=step_config, mesh=m)
            metrics.append([float(step_metrics["loss"]), float(step_metrics["grad_norm"])])
        runs.append((metrics, jax.tree.map(np.asarray, state.params)))
    assert len(jax.devices()) >= 2
    (one_metrics, one_params), (two_metrics, two_params) = runs
    np.testing.assert_allclose(two_metrics, one_metrics, rtol=1e-5)
    lr = config.optim.learning_rate
    leaves = [jax.tree.leaves(t) for t in (draft.params, one_params, two_params)]
    for start, one, two in zip(*leaves, strict=True):
        assert np.abs(one - np.asarray(start)).max() > lr  # two steps of about lr each
        np.testing.assert_allclose(two, one, atol=lr / 10, rtol=0)


def test_the_draft_section_sets_every_draft_config_keyword():
    """The `draft` section is `draft_config`'s keywords plus how a run starts: a keyword added to
    `draft_config` (and so to `init_draft`) without a section field could not be trained."""
    import inspect

    from jetspec_jax.draft import draft_config

    keywords = [
        name
        for name, p in inspect.signature(draft_config).parameters.items()
        if p.kind is p.KEYWORD_ONLY
    ]
    architecture = DraftArchConfig().architecture()
    assert sorted(architecture) == sorted(keywords)
    defaults = {k: inspect.signature(draft_config).parameters[k].default for k in keywords}
    assert architecture == defaults


def test_bad_configs_are_refused_by_key(tmp_path):
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\noptim: {learning_rate: fast}\n")
    with pytest.raises(ValueError, match="optim.learning_rate must be a number"):
        load_train_config(path)
    for key in ("1", "on"):  # keys YAML reads as an int and a bool: named, not a TypeError
        path.write_text(f"data: {{files: [a.jsonl]}}\n{key}: 2\n")
        with pytest.raises(ValueError, match="unknown key.*(1|True); known: adapter"):
            load_train_config(path)
    path.write_text("data: {files: [a.jsonl]}\noptim: {learning_rat: 0.1}\n")
    with pytest.raises(ValueError, match="unknown key.*optim.learning_rat"):
        load_train_config(path)
    path.write_text("optim: {steps: 3}\n")
    with pytest.raises(ValueError, match="missing required key data"):
        load_train_config(path)
    path.write_text("data: {files: [a.jsonl]}\ndraft: {variant: medusa}\n")
    with pytest.raises(ValueError, match="draft.variant"):
        load_train_config(path)
    # Values that would fail late (a division by zero, a top_k shape error) fail at load.
    for text, field in {
        "run: {log_every: 0}": "run.log_every",
        "draft: {init_std: .nan}": "draft.init_std",
        "draft: {init_std: .inf}": "draft.init_std",
        "draft: {block_size: 1}": "draft.block_size",
        "draft: {num_layers: 0}": "draft.num_layers",
        "draft: {num_heads: 0}": "draft.num_heads",
        "draft: {num_kv_heads: 0}": "draft.num_kv_heads",
        "draft: {mask_token_id: -1}": "draft.mask_token_id",
        # Taps an adapter could never chain (it would fail only after the draft trained).
        "draft: {target_layer_ids: [9, 1]}": r"draft.target_layer_ids \(distinct",
        "draft: {target_layer_ids: [1, 1, 9]}": r"draft.target_layer_ids \(distinct",
        "draft: {target_layer_ids: [-1, 2]}": r"draft.target_layer_ids \(distinct",
        "draft: {target_layer_ids: []}": r"draft.target_layer_ids \(distinct",
        "adapter: {init_std: .inf}": "adapter.init_std",
        "run: {checkpoint_every: 0}": "run.checkpoint_every",
        "run: {keep_checkpoints: 0}": "run.keep_checkpoints",
        "run: {eval_every: -1}": "run.eval_every",
        "data: {files: [a.jsonl], eval_num_prompts: 0}": "data.eval_num_prompts",
        "data: {files: [a.jsonl, b.jsonl, a.jsonl]}": "data.files",  # trained on twice
        "data: {files: [a.jsonl, '']}": r"data.files \(an empty path\)",
        "adapter: {eval_files: [h.jsonl, ./h.jsonl]}": "adapter.eval_files: 'h.jsonl' and",
        # Empty paths are no "none": the run would write into the working directory, the
        # evaluation would be off unsaid, the target would fail only at its load.
        "run: {dir: ''}": r"run.dir \(a directory\)",
        "data: {files: [a.jsonl], eval_prompts: ''}": "data.eval_prompts",
        "target: ''": "target",
        "data: {files: [a.jsonl], eval_max_new_tokens: 0}": "data.eval_max_new_tokens",
        "data: {files: [a.jsonl], max_length: 64}\noptim: {anchors_per_sequence: 65}": (
            r"optim.anchors_per_sequence \(<= data.max_length 64\): 65"
        ),
        # Values that would train wrongly without an error: a negative clip norm flips the
        # gradient's sign, a negative ratio makes the learning rate negative.
        "optim: {grad_clip: -1.0}": "optim.grad_clip",
        "optim: {end_learning_rate_ratio: -0.5}": "optim.end_learning_rate_ratio",
        "optim: {weight_decay: -0.01}": "optim.weight_decay",
        "adapter: {optim: {grad_clip: 0.0}}": "adapter.optim.grad_clip",
        "optim: {epochs: 0}": "optim.epochs",
        "optim: {epochs: .inf}": "optim.epochs",
        "optim: {learning_rate: .inf}": "optim.learning_rate",
        "optim: {learning_rate: 1" + "0" * 400 + "}": "optim.learning_rate",  # past a float
        # Each bound just past it (the values at it load: the next test).
        "data: {files: [a.jsonl], max_length: 16}\ndraft: {block_size: 16}": (
            r"data.max_length \(>= draft.block_size \+ 1: 17\): 16"
        ),
        "optim: {steps: 10, warmup_steps: 11}": r"optim.warmup_steps \(in \[0, optim.steps 10\]\)",
        "optim: {seed: 4294967296}": "optim.seed",
        # A dtype the models do not run in, or a variant spelled as the docs name the method, is
        # named with the choices.
        "draft: {variant: DFlash}": r"draft.variant \(dflash, jetspec or jetspec\+\+\): 'DFlash'",
        "target_dtype: float16": r"target_dtype \(float32 or bfloat16\): 'float16'",
        "export_dtype: fp16": r"export_dtype \(float32, bfloat16, or null for the target's\)",
        "optim: {compute_dtype: half}": r"optim.compute_dtype \(float32 or bfloat16\): 'half'",
        "adapter: {optim: {compute_dtype: float64}}": (
            r"adapter.optim.compute_dtype \(float32 or bfloat16\): 'float64'"
        ),
    }.items():
        if not text.startswith("data:"):
            text = "data: {files: [a.jsonl]}\n" + text
        path.write_text(text + "\n")
        with pytest.raises(ValueError, match=f"invalid value for {field}"):
            load_train_config(path)
    # A directory is named as one; a pipe (`--config <(...)`) is read like a file.
    with pytest.raises(IsADirectoryError, match="is a directory; give its YAML file"):
        load_train_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="gone.yaml not found"):
        load_train_config(tmp_path / "gone.yaml")
    read, write = os.pipe()
    with os.fdopen(write, "w") as f:
        f.write("data: {files: [a.jsonl]}\noptim: {steps: 7, warmup_steps: 1}\n")
    try:
        assert load_train_config(f"/dev/fd/{read}").optim.steps == 7
    finally:
        os.close(read)
    for text in ("optim: {steps: true}", "draft: {num_layers: false}"):  # YAML's booleans
        path.write_text("data: {files: [a.jsonl]}\n" + text + "\n")
        with pytest.raises(ValueError, match="must be an integer"):
            load_train_config(path)


def test_values_at_each_bound_are_accepted(tmp_path):
    """The bounds are inclusive where the rule allows the value: a sequence one token longer than
    a block, a run that warms up for all its steps, an anchor at every position, the largest
    32-bit seed; YAML 1.1 reads `3e-4` (no dot) as a string, which is read as the number."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {files: [a.jsonl], max_length: 17}\n"
        "draft: {block_size: 16}\n"
        "optim: {steps: 10, warmup_steps: 10, anchors_per_sequence: 17, seed: 4294967295, "
        "learning_rate: 3e-4}\n"
    )
    optim = load_train_config(path).optim
    assert (optim.steps, optim.warmup_steps, optim.anchors_per_sequence) == (10, 10, 17)
    assert optim.seed == 2**32 - 1 and optim.learning_rate == 3e-4


def test_with_epochs_the_warmup_is_not_checked_against_the_default_steps(tmp_path):
    """`steps` is derived from the data when `epochs` is set (`resolve_steps` caps the warmup)."""
    from jetspec_jax.training.config import load_train_config, resolve_steps

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\noptim: {epochs: 6, warmup_steps: 2000}\n")
    config = resolve_steps(load_train_config(path), num_examples=100)
    assert (config.optim.steps, config.optim.warmup_steps) == (75, 75)  # 6 * 100 / batch 8
    # A last partial batch is a step: 1 epoch of 10 examples in batches of 8 is 2 steps.
    path.write_text("data: {files: [a.jsonl]}\noptim: {epochs: 1, warmup_steps: 0}\n")
    assert resolve_steps(load_train_config(path), num_examples=10).optim.steps == 2


def test_command_line_overrides_are_typed_and_validated(tmp_path):
    """`train.py draft --set KEY=VALUE`: how the baseline drafts reuse one config."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\ndraft: {variant: jetspec++}\n")
    config = load_train_config(
        path,
        ["draft.variant=dflash", "optim.steps=500", "data.files=[b.jsonl, c.jsonl]", "run.dir=x"],
    )
    assert config.draft.variant == "dflash" and config.optim.steps == 500
    assert config.data.files == ("b.jsonl", "c.jsonl") and config.run.dir == "x"
    with pytest.raises(ValueError, match="section.key=value"):
        load_train_config(path, ["draft.variant"])
    with pytest.raises(ValueError, match="draft.variant is not a section"):
        load_train_config(path, ["draft.variant.x=1"])
    with pytest.raises(ValueError, match="unknown key.*draft.varient"):
        load_train_config(path, ["draft.varient=dflash"])
    with pytest.raises(ValueError, match="optim.steps must be an integer"):
        load_train_config(path, ["optim.steps=many"])
    # An empty value (a shell's `--set target=$T`, T unset) is no null: it would train the
    # default model, turn the evaluation off, or replace epochs with the default steps.
    for override in ("target=", "data.eval_prompts= ", "optim.epochs="):
        with pytest.raises(ValueError, match=f"override '{override}' gives no value; write null"):
            load_train_config(path, [override])
    # A section given by a YAML alias is a copy the override edits alone, not its anchor too.
    path.write_text("data: {files: [a.jsonl]}\noptim: &o {steps: 500}\nadapter: {optim: *o}\n")
    config = load_train_config(path, ["adapter.optim.steps=300", "optim.learning_rate=1e-3"])
    assert (config.optim.steps, config.adapter.optim.steps) == (500, 300)
    assert (config.optim.learning_rate, config.adapter.optim.learning_rate) == (1e-3, 3e-4)


def test_an_override_splits_at_its_first_equals_sign(tmp_path):
    """The key ends at the first `=`: a value may hold more (a run directory named by its
    settings), and is not read as part of the key."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\n")
    config = load_train_config(path, ["run.dir=runs/lr=3e-4", "data.files=[x=1.jsonl]"])
    assert config.run.dir == "runs/lr=3e-4" and config.data.files == ("x=1.jsonl",)


def test_a_steps_override_replaces_the_configs_epochs(tmp_path):
    """`--set optim.steps=N` on a config that gives epochs trains N steps (epochs used to win
    silently); a config giving both is refused."""
    from jetspec_jax.training.config import load_train_config, resolve_steps

    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {files: [a.jsonl]}\noptim: {epochs: 2, batch_size: 4}\n"
        "adapter: {optim: {epochs: 1}}\n"
    )
    assert resolve_steps(load_train_config(path), 100).optim.steps == 50
    config = load_train_config(path, ["optim.steps=700", "adapter.optim.steps=300"])
    assert resolve_steps(config, 100).optim.steps == 700
    assert config.adapter.optim.epochs is None and config.adapter.optim.steps == 300
    config = load_train_config(path, ["optim.steps=700", "optim.epochs=1"])  # the last one wins
    assert resolve_steps(config, 100).optim.steps == 25
    both = tmp_path / "both.yaml"
    both.write_text("data: {files: [a.jsonl]}\nadapter: {optim: {epochs: 1, steps: 900}}\n")
    with pytest.raises(ValueError, match="adapter.optim gives both steps and epochs"):
        load_train_config(both)
    # A null budget key is no budget.
    both.write_text("data: {files: [a.jsonl]}\noptim: {steps: 50, epochs: null, warmup_steps: 5}\n")
    assert load_train_config(both).optim.steps == 50


def test_epochs_that_leave_only_warmup_steps_are_warned_about(tmp_path, caplog):
    """Warmup is capped at the steps the epochs make; then the learning rate never decays."""
    from jetspec_jax.training.config import load_train_config, resolve_steps

    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {files: [a.jsonl]}\noptim: {epochs: 1, batch_size: 4, warmup_steps: 30}\n"
    )
    with caplog.at_level("WARNING"):
        assert resolve_steps(load_train_config(path), 400).optim.warmup_steps == 30  # 100 steps
    assert not caplog.records
    with caplog.at_level("WARNING"):
        optim = resolve_steps(load_train_config(path), 40).optim
    assert optim.steps == optim.warmup_steps == 10
    assert "optim.warmup_steps 30 >= the 10 steps" in caplog.text
    assert "the whole run warms up and the learning rate never decays" in caplog.text
    # The adapter's own section is named as its own.
    from jetspec_jax.training.adapter_trainer import adapter_optim

    path.write_text(
        "data: {files: [a.jsonl]}\nadapter: {optim: {epochs: 1, batch_size: 4, warmup_steps: 30}}\n"
    )
    caplog.clear()
    with caplog.at_level("WARNING"):
        adapter_optim(load_train_config(path), 40)
    assert "adapter.optim.warmup_steps 30 >= the 10 steps" in caplog.text


def test_an_adapter_optim_override_keeps_the_optim_the_adapter_ran_with(tmp_path):
    """Without an `adapter.optim` section the adapter trains with the top-level `optim`:
    `--set adapter.optim.steps=300` changes its steps, not its batch size and warmup too."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text(
        "data: {files: [a.jsonl]}\n"
        "optim: {batch_size: 16, warmup_steps: 7, epochs: 2, learning_rate: 1.0e-3}\n"
    )
    config = load_train_config(path, ["adapter.optim.steps=300"])
    optim = config.adapter.optim
    assert (optim.steps, optim.epochs, optim.batch_size, optim.warmup_steps) == (300, None, 16, 7)
    assert optim.learning_rate == 1e-3 and config.optim.epochs == 2  # the draft's is untouched
    # Top-level overrides reach it whatever their order.
    for overrides in (
        ["adapter.optim.steps=300", "optim.batch_size=8"],
        ["optim.batch_size=8", "adapter.optim.steps=300"],
    ):
        optim = load_train_config(path, overrides).adapter.optim
        assert (optim.steps, optim.epochs, optim.batch_size) == (300, None, 8), overrides
    # An adapter override of a key the top level sets wins over the inherited value.
    optim = load_train_config(path, ["adapter.optim.batch_size=4"]).adapter.optim
    assert (optim.batch_size, optim.warmup_steps) == (4, 7)
    # `optim: null` says "the top-level one" too.
    path.write_text(path.read_text() + "adapter: {optim: null}\n")
    optim = load_train_config(path, ["adapter.optim.steps=300"]).adapter.optim
    assert (optim.steps, optim.epochs, optim.batch_size, optim.warmup_steps) == (300, None, 16, 7)


def test_a_key_given_twice_is_refused_with_its_line(tmp_path):
    """PyYAML keeps the last of two identical keys silently: a second `optim:` section, or
    `steps:` twice in one, would drop settings."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    for text, key, line in (
        (
            "data: {files: [a.jsonl]}\noptim: {batch_size: 4}\nrun: {dir: x}\noptim: {steps: 9}\n",
            "optim",
            4,
        ),
        (
            "data: {files: [a.jsonl]}\noptim:\n  steps: 9\n  warmup_steps: 1\n  steps: 3\n",
            "steps",
            5,
        ),
    ):
        path.write_text(text)
        with pytest.raises(
            ValueError,
            match=f"not valid YAML: duplicate key '{key}' on line {line} \\(first given on line",
        ):
            load_train_config(path)
    path.write_text("data: {files: [a.jsonl]}\n")
    with pytest.raises(ValueError, match="override.*duplicate key 'a' on line 1"):
        load_train_config(path, ["data.files={a: 1, a: 2}"])
    # A merge key's values may still be overridden by the mapping's own keys.
    path.write_text(
        "data: {files: [a.jsonl]}\n"
        "adapter: {optim: &b {steps: 9, batch_size: 4, warmup_steps: 1}}\n"
        "optim: {<<: *b, steps: 3}\n"
    )
    optim = load_train_config(path).optim
    assert (optim.steps, optim.batch_size) == (3, 4)


def test_data_files_are_compared_by_real_path(tmp_path, monkeypatch):
    """`a.jsonl`, `./a.jsonl` and a link to it are one file, which would be trained on twice."""
    from jetspec_jax.training.config import load_train_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "a.jsonl")
    path = tmp_path / "c.yaml"
    for files in ("[runs/a.jsonl, ./runs/a.jsonl]", f"[a.jsonl, {tmp_path}/link.jsonl]"):
        path.write_text(f"data: {{files: {files}}}\n")
        with pytest.raises(ValueError, match="invalid value for data.files: .* are one file"):
            load_train_config(path)
    with pytest.raises(ValueError, match="'a.jsonl' and 'a.jsonl' are one file"):
        TrainConfig(data=DataConfig(files=("a.jsonl", "a.jsonl")))  # one string object twice
    path.write_text("data: {files: [a.jsonl, b.jsonl]}\n")
    assert load_train_config(path).data.files == ("a.jsonl", "b.jsonl")


def test_a_null_adapter_budget_override_keeps_the_top_level_budget(tmp_path):
    """`--set adapter.optim.epochs=null` on a config whose adapter inherits `optim: {epochs: 2}`
    gives no budget: the adapter keeps the epochs, not the built-in default steps."""
    from jetspec_jax.training.config import load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\noptim: {epochs: 2, batch_size: 4}\n")
    for overrides in (["adapter.optim.epochs=null"], ["adapter.optim.steps=null"]):
        optim = load_train_config(path, overrides).adapter.optim
        assert (optim.epochs, optim.batch_size) == (2, 4), overrides
    optim = load_train_config(
        path, ["adapter.optim.steps=300", "adapter.optim.epochs=null"]
    ).adapter.optim
    assert (optim.steps, optim.epochs, optim.batch_size) == (300, None, 4)


def test_an_empty_section_takes_its_defaults(tmp_path):
    """`adapter:` with every key commented out loads as null: its defaults, as an override
    (`--set adapter.kappa=0.3`) takes it, not "adapter must be a mapping"."""
    from jetspec_jax.training.config import AdapterTrainConfig, load_train_config

    path = tmp_path / "c.yaml"
    path.write_text("data: {files: [a.jsonl]}\nadapter:\n  # kappa: 0.3\noptim:\nrun:\n")
    config = load_train_config(path)
    assert config.adapter == AdapterTrainConfig() and config.optim == OptimConfig()
    assert config.run == RunConfig()
    assert load_train_config(path, ["adapter.kappa=0.3"]).adapter.kappa == 0.3
    path.write_text("data:\n")
    with pytest.raises(ValueError, match="missing required key data"):
        load_train_config(path)


def test_the_loss_and_its_gradient_do_not_depend_on_the_anchor_chunking(target):
    """Chunks of 3 of 8 anchors (the last padded), of 1, and all at once equal the loss written
    out whole: the `[B, A, K, V]` logits of both models in one piece (the oracle)."""
    from jetspec_jax.models.draft import draft_hidden_for_training, draft_logits
    from jetspec_jax.models.transformer import output_kernel, unembed
    from jetspec_jax.training.loss import draft_loss, teacher_forward

    draft = jetspec_jax.init_draft(
        target, variant="jetspec++", block_size=4, num_layers=1, init_std=0.2, seed=1
    )
    cfg, params = draft.config, target.params
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 24)), jnp.int32)
    loss_mask = jnp.arange(24)[None, :] >= jnp.asarray([[6], [9]])
    blocks = build_blocks(jax.random.key(0), tokens, loss_mask, cfg, num_anchors=8)
    teacher = teacher_forward(params, target.config, cfg, tokens)

    def whole(draft_params):
        hidden = draft_hidden_for_training(
            draft_params,
            cfg,
            params["embed_tokens"]["embedding"],
            teacher.taps,
            blocks.tokens,
            blocks.anchors,
        )
        logits = draft_logits(cfg, output_kernel(params, target.config), hidden)
        rows = teacher.hidden[jnp.arange(2)[:, None, None], blocks.predicted - 1]
        teacher_logp = jax.nn.log_softmax(unembed(params, target.config, rows), axis=-1)
        kl = jnp.sum(jnp.exp(teacher_logp) * (teacher_logp - jax.nn.log_softmax(logits)), -1)
        return jnp.sum(kl * blocks.weights) / jnp.sum(blocks.weights)

    expected, expected_grad = jax.jit(jax.value_and_grad(whole))(draft.params)
    assert float(jnp.sum(blocks.weights)) > 20  # enough supervised rows to mean something
    accuracies = []
    for chunk in (3, 1, 8, 64):

        def chunked(draft_params, chunk=chunk):
            return draft_loss(
                draft_params, cfg, params, target.config, teacher, blocks, anchors_per_chunk=chunk
            )

        (loss, metrics), grad = jax.jit(jax.value_and_grad(chunked, has_aux=True))(draft.params)
        np.testing.assert_allclose(loss, expected, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(grad), jax.tree.leaves(expected_grad), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
        assert metrics["supervised"] == jnp.sum(blocks.weights)
        accuracies.append(np.asarray(metrics["accuracy_by_row"]))
    for by_row in accuracies[1:]:
        np.testing.assert_allclose(by_row, accuracies[0], rtol=1e-6)


def test_a_batch_with_one_supervised_row_has_that_rows_kl_as_its_loss(target):
    """The loss divides by the supervised row count, floored at 1 only so that a batch without
    one gives 0: a single supervised row's loss is its KL, whole."""
    from jetspec_jax.training.loss import draft_loss, teacher_forward

    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, num_layers=1)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, (2, 24)), jnp.int32)
    loss_mask = jnp.arange(24)[None, :] >= jnp.asarray([[6], [9]])
    blocks = build_blocks(jax.random.key(0), tokens, loss_mask, draft.config, num_anchors=8)
    teacher = teacher_forward(target.params, target.config, draft.config, tokens)

    def loss(weights):
        return draft_loss(
            draft.params,
            draft.config,
            target.params,
            target.config,
            teacher,
            blocks.replace(weights=jnp.asarray(weights, jnp.float32)),
            anchors_per_chunk=8,
        )[0]

    rows = np.argwhere(np.asarray(blocks.weights) > 0)[:2]
    one_hots = [np.zeros(blocks.weights.shape) for _ in rows]
    for one_hot, row in zip(one_hots, rows, strict=True):
        one_hot[tuple(row)] = 1
    kl = [float(loss(one_hot)) for one_hot in one_hots]
    assert min(kl) > 0
    # Two rows weigh alike: their mean, which no floor touches, pins each row's KL.
    assert float(loss(one_hots[0] + one_hots[1])) == pytest.approx(np.mean(kl), rel=1e-5)
    assert float(loss(np.zeros(blocks.weights.shape))) == 0


def test_the_accuracy_is_pooled_over_the_supervised_rows_only(target, monkeypatch):
    """A draft made exact (its block rows' hidden states and head replaced by the teacher's) is
    right on every row, supervised or not: the accuracy is 1 pooled over the supervised rows,
    and by row 1 on the K-1 drafts' rows and 0 on the last, which no block supervises."""
    from jetspec_jax.models.transformer import unembed
    from jetspec_jax.training import loss

    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, num_layers=1)
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, (2, 24)), jnp.int32)
    loss_mask = jnp.arange(24)[None, :] >= jnp.asarray([[6], [9]])
    blocks = build_blocks(jax.random.key(0), tokens, loss_mask, draft.config, num_anchors=8)
    teacher = loss.teacher_forward(target.params, target.config, draft.config, tokens)
    rows = teacher.hidden[jnp.arange(2)[:, None, None], blocks.predicted - 1]
    monkeypatch.setattr(loss, "draft_hidden_for_training", lambda *args: rows)
    monkeypatch.setattr(
        loss, "draft_logits", lambda config, head, h: unembed(target.params, target.config, h)
    )
    _, metrics = loss.draft_loss(
        draft.params,
        draft.config,
        target.params,
        target.config,
        teacher,
        blocks,
        anchors_per_chunk=3,
    )
    weights = np.asarray(blocks.weights)
    assert weights[..., :3].sum(axis=(0, 1)).min() > 0 and weights[..., 3].sum() == 0
    assert float(metrics["accuracy"]) == pytest.approx(1.0)
    np.testing.assert_allclose(metrics["accuracy_by_row"], [1, 1, 1, 0], atol=1e-6)


@pytest.mark.parametrize("variant", ["dflash", "jetspec++"])
def test_training_forward_equals_the_inference_forward_block_by_block(target, variant):
    # (jitted pieces: op-by-op execution of a forward is slow on CPU)
    """All anchors in one block-sparse forward == each block drafted alone from a cache holding
    exactly the context before its anchor (what decoding does)."""
    from jetspec_jax.models.draft import (
        draft_hidden,
        draft_hidden_for_training,
        empty_cache,
        extend_context,
    )
    from jetspec_jax.models.transformer import forward

    draft = jetspec_jax.init_draft(
        target, variant=variant, block_size=5, num_layers=2, init_std=0.2, seed=0
    )
    cfg, emb = draft.config, target.params["embed_tokens"]["embedding"]
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 24)), jnp.int32)
    taps = forward(target.params, target.config, tokens, tap_layers=cfg.target_layer_ids).taps
    anchors = jnp.asarray([[5, 11, 17], [3, 9, 20]], jnp.int32)
    blocks = jnp.asarray(rng.integers(0, 97, (2, 3, 5)), jnp.int32)
    together = jax.jit(draft_hidden_for_training, static_argnums=1)(
        draft.params, cfg, emb, taps, blocks, anchors
    )
    extend = jax.jit(extend_context, static_argnums=1)
    alone_fn = jax.jit(draft_hidden, static_argnums=1)
    for b in range(2):
        for a in range(3):
            # The context before the anchor; later rows zeroed (and past the cache's length).
            n = int(anchors[b, a])
            visible = jnp.where(jnp.arange(24)[None, None, :, None] < n, taps[:, b : b + 1], 0)
            cache = empty_cache(cfg, 1, 32, jnp.float32)
            cache = extend(draft.params, cfg, cache, visible, jnp.asarray([n]))
            alone = alone_fn(draft.params, cfg, cache, emb, blocks[b : b + 1, a])
            np.testing.assert_allclose(together[b, a], alone[0], atol=2e-5)


@pytest.mark.parametrize("layers", [(0, 2), (1,)])
def test_training_targets_are_the_states_of_the_layers_decoding_taps(target, layers):
    """The draft's teacher taps and the adapter's training targets are the target's states at
    the layers the decode loop's proposer takes (`tap_layers`, with and without refreshes): a
    draft or adapter trained on other layers than it is fed would still decode losslessly, only
    with a lower tau, which no other unit test would see."""
    from jetspec_jax.models.transformer import forward
    from jetspec_jax.training.adapter_loss import teacher_levels
    from jetspec_jax.training.loss import teacher_forward

    draft = jetspec_jax.init_draft(target, target_layer_ids=layers, block_size=4, seed=1)
    draft = draft.with_adapter(init_adapter(draft))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 97, (2, 12)), jnp.int32)
    taps_of = jax.jit(
        lambda tap_layers: forward(target.params, target.config, tokens, tap_layers=tap_layers),
        static_argnums=0,
    )
    teacher = teacher_forward(target.params, target.config, draft.config, tokens)
    _, adapter_targets = teacher_levels(
        target.params, target.config, draft.adapter.config.target_layer_ids, tokens
    )
    for refreshes in (0, 1):
        proposer, _ = draft.proposer(
            target, method="jetspec++", refine_passes=refreshes, refreshes=refreshes
        )
        decoded = np.asarray(taps_of(proposer.tap_layers).taps)
        assert decoded.shape[0] == len(layers)
        # (jitted and eager forwards round apart; another layer's states differ by O(1))
        np.testing.assert_allclose(np.asarray(teacher.taps), decoded, atol=1e-5)
        np.testing.assert_allclose(np.asarray(adapter_targets), decoded, atol=1e-5)


def test_a_run_starts_from_a_saved_draft_of_its_architecture(target, tmp_path):
    """`draft.init_from`: the saved draft's weights, not a random initialisation; a saved draft
    of another architecture is refused by field."""
    from jetspec_jax.training.config import TrainConfig, from_dict
    from jetspec_jax.training.trainer import initial_draft

    saved = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=5)
    path = saved.save(tmp_path / "saved")
    section = dict(variant="jetspec++", block_size=4, init_from=str(path))
    config = from_dict(TrainConfig, dict(data=dict(files=["x.jsonl"]), draft=section), "")
    # Read in float32 even for a bfloat16 target: the fp32 master weights are not rounded.
    bf16_target = jetspec_jax.load_target(target.path, dtype="bfloat16")
    for start in (initial_draft(config, target), initial_draft(config, bf16_target)):
        leaves = zip(jax.tree.leaves(start.params), jax.tree.leaves(saved.params), strict=True)
        for got, want in leaves:
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got, want)
    section["block_size"] = 8
    config = from_dict(TrainConfig, dict(data=dict(files=["x.jsonl"]), draft=section), "")
    with pytest.raises(ValueError, match="block_size 4 \\(configured 8\\)"):
        initial_draft(config, target)

    # An imported draft with its own heads and mask token: named in the section, it is accepted.
    imported = jetspec_jax.init_draft(
        target, variant="dflash", block_size=4, num_heads=2, num_kv_heads=1, head_dim=8,
        mask_token_id=7,
    )  # fmt: skip
    section = dict(variant="dflash", block_size=4, init_from=str(imported.save(tmp_path / "imp")))
    config = from_dict(TrainConfig, dict(data=dict(files=["x.jsonl"]), draft=section), "")
    with pytest.raises(ValueError, match="mask_token_id 7 \\(configured") as refused:
        initial_draft(config, target)
    heads = target.config.num_heads
    assert f"layers.num_heads 2 (configured {heads})" in str(refused.value)  # by field, not dump
    section |= dict(num_heads=2, num_kv_heads=1, head_dim=8, mask_token_id=7)
    config = from_dict(TrainConfig, dict(data=dict(files=["x.jsonl"]), draft=section), "")
    assert initial_draft(config, target).config == imported.config


def test_init_from_is_checked_before_the_model_load(target, tmp_path):
    from jetspec_jax.training.config import TrainConfig, from_dict

    data = tmp_path / "d.jsonl"
    data.write_text("")
    section = dict(variant="jetspec++", block_size=4, init_from=str(tmp_path / "gone"))
    run = dict(dir=str(tmp_path / "run"))
    config = from_dict(
        TrainConfig,
        dict(target="no/such/target", data=dict(files=[str(data)]), draft=section, run=run),
        "",
    )
    with pytest.raises(FileNotFoundError, match="gone/config.json"):
        train(config)  # before the target load (whose path does not exist either)
    assert not (tmp_path / "run").exists()
    # A JetSpec++ checkpoint (its draft is the start) passes the check: the target load fails.
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    bundle = draft.with_adapter(init_adapter(draft)).save(tmp_path / "pp")
    section["init_from"] = str(bundle)
    config = from_dict(
        TrainConfig,
        dict(target="no/such/target", data=dict(files=[str(data)]), draft=section, run=run),
        "",
    )
    with pytest.raises(CheckpointError, match="no/such/target does not exist"):
        train(config)


def _warm_start_config(target, tmp_path, **draft) -> TrainConfig:
    """A run of `target` (read from its directory) with this draft section, over an empty data
    file and a run dir not made yet: the checks before the target load have all they need."""
    from jetspec_jax.training.config import from_dict

    data = tmp_path / "d.jsonl"
    data.write_text("")
    run = dict(dir=str(tmp_path / "run"))
    return from_dict(
        TrainConfig,
        dict(target=str(target.path), data=dict(files=[str(data)]), draft=draft, run=run),
        "",
    )


def test_an_init_from_of_another_architecture_is_refused_before_the_model_load(
    target, tmp_path, monkeypatch
):
    """The saved draft's config against the section's, from the target's `config.json` alone:
    not after minutes of loading a large target. A draft directory and a JetSpec++ checkpoint's
    draft alike."""
    saved = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    bundle = saved.with_adapter(init_adapter(saved)).save(tmp_path / "pp")
    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    for start in (saved.save(tmp_path / "plain"), bundle):
        config = _warm_start_config(
            target, tmp_path, variant="jetspec++", block_size=8, init_from=str(start)
        )
        with pytest.raises(ValueError, match="block_size 4 \\(configured 8\\)"):
            train(config)
        assert not (tmp_path / "run").exists()


def test_a_start_drafts_mask_token_is_left_to_the_tokenizers_rule_before_the_load(target, tmp_path):
    """`check_draft_start` runs before the tokenizer loads: a saved draft's mask token, where the
    section leaves it to the tokenizer's rule, is not compared there (`initial_draft` compares
    it with the rule's once loaded); one the section sets is."""
    from jetspec_jax.training.config import TrainConfig, from_dict

    saved = jetspec_jax.init_draft(target, variant="jetspec", block_size=4, mask_token_id=5)
    start = saved.save(tmp_path / "start")

    def config(**section):
        section = dict(variant="jetspec", block_size=4, init_from=str(start), **section)
        return from_dict(
            TrainConfig,
            dict(target=str(target.path), data=dict(files=["d.jsonl"]), draft=section),
            "",
        )

    trainer.check_draft_start(config(), target.config)  # the rule's token: not known yet
    trainer.check_draft_start(config(mask_token_id=5), target.config)
    with pytest.raises(ValueError, match="mask_token_id 5 \\(configured 7\\)"):
        trainer.check_draft_start(config(mask_token_id=7), target.config)


def test_missing_input_files_are_refused_before_an_unwritable_run_dir(data_files, tmp_path):
    """`_check_before_load`'s order: a missing input file is named first, even where run.dir
    cannot be written in either (a typo in a path is the likelier mistake to say)."""
    from jetspec_jax.training.config import TrainConfig, from_dict

    blocked = tmp_path / "file"
    blocked.write_text("")
    data = [str(data_files["train"]), str(tmp_path / "gone.jsonl")]
    config = from_dict(
        TrainConfig,
        dict(target="no/such/target", data=dict(files=data), run=dict(dir=str(blocked / "run"))),
        "",
    )
    with pytest.raises(FileNotFoundError, match="missing input file\\(s\\): .*gone.jsonl"):
        train(config)
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, files=data[:1]))
    with pytest.raises(NotADirectoryError, match="run.dir"):
        train(config)


def test_a_malformed_jetspec_pp_init_from_is_refused_as_load_draft_would(
    target, tmp_path, monkeypatch
):
    """A JetSpec++ checkpoint given as `draft.init_from` is checked before the model load as
    `load_bundle` checks it, with its messages: a missing `draft/` or one that is itself a
    bundle is said so (not as a config.json the draft directory lacks), and an unsupported
    manifest is refused then too."""
    saved = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    bundle = saved.with_adapter(init_adapter(saved)).save(tmp_path / "pp")
    no_draft, nested, version = (tmp_path / name for name in ("no_draft", "nested", "version"))
    for copy in (no_draft, nested, version):
        shutil.copytree(bundle, copy)
    shutil.rmtree(no_draft / "draft")
    shutil.rmtree(nested / "draft")
    shutil.copytree(bundle, nested / "draft")
    manifest = json.loads((version / "jetspec_pp.json").read_text())
    (version / "jetspec_pp.json").write_text(json.dumps(manifest | {"format_version": 99}))
    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    for start, message in (
        (no_draft, f"JetSpec++ checkpoint {no_draft} lacks its draft/ directory"),
        (nested, f"{nested / 'draft'} must be a plain draft directory, not another bundle"),
        (version, "format_version 99 is not supported"),
    ):
        config = _warm_start_config(
            target, tmp_path, variant="jetspec++", block_size=4, init_from=str(start)
        )
        with pytest.raises(CheckpointError) as refused:
            train(config)
        assert message in str(refused.value)
        assert not (tmp_path / "run").exists()


def test_a_run_resumes_without_its_deleted_start_draft(target, data_files, tmp_path, caplog):
    """A resumed run's weights are in its checkpoint: the `draft.init_from` it started from is
    neither checked nor read (it may be gone), and dropping it from the config is no change of
    setup."""
    start = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, num_layers=1)
    config = _config(data_files, tmp_path / "run", evaluate=False, **SHORT)
    section = dataclasses.replace(config.draft, init_from=str(start.save(tmp_path / "start")))
    config = dataclasses.replace(config, draft=section)
    assert train(config, target=target, stop_after=1) is None
    shutil.rmtree(tmp_path / "start")
    with caplog.at_level("WARNING"):
        assert train(config, target=target, stop_after=1) is None
        assert "resumes from its checkpoint: draft.init_from is not read" in caplog.text
        assert (tmp_path / "run" / "checkpoints" / "2").is_dir()  # one step past the first
        caplog.clear()
        section = dataclasses.replace(section, init_from=None)
        assert train(dataclasses.replace(config, draft=section), target=target).steps == 6
    assert "resuming with" not in caplog.text


def test_throughput_counts_the_steps_since_the_last_log_and_not_the_pauses():
    now = [0.0]
    throughput = Throughput(3, tokens_per_step=100, clock=lambda: now[0])  # resumed at step 3
    now[0] = 2.0
    assert throughput.rate(10) == pytest.approx(7 * 100 / 2.0)  # 7 steps, not log_every
    now[0] = 3.0
    with throughput.paused():  # a checkpoint or evaluation: 5 s not counted
        now[0] = 8.0
    now[0] = 8.5
    assert throughput.rate(13) == pytest.approx(3 * 100 / 1.5)  # a short last interval
    now[0] = 60.0  # a step that compiled
    throughput.restart(14)
    assert throughput.rate(14) is None  # no step since
    now[0] = 61.0
    assert throughput.rate(16) == pytest.approx(2 * 100 / 1.0)


def test_the_logged_throughput_leaves_out_each_processs_first_step(
    target, data_files, tmp_path, monkeypatch
):
    """`tokens_per_second` counts batch x sequence positions per step (padding included), not
    sequences, from the second step a process runs (the first is mostly compilation), a fresh
    start's or a resume's; the last step is logged whatever `log_every` is."""
    made, restarts = [], []

    class Recorded(Throughput):
        def __init__(self, step, tokens_per_step, **kwargs):
            made.append(tokens_per_step)
            super().__init__(step, tokens_per_step, **kwargs)

        def restart(self, step, *pending):
            restarts.append(step)
            super().restart(step, *pending)

    monkeypatch.setattr(run_loop, "Throughput", Recorded)
    config = _config(data_files, tmp_path, evaluate=False, **SHORT)  # 6 steps, log_every 5
    assert train(config, target=target, stop_after=1) is None
    assert train(config, target=target).metrics["tokens_per_second"] > 0  # step 6's
    assert made == [4 * 48] * 2  # batch_size x max_length
    assert restarts == [1, 2]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [5, 6]


def test_the_metrics_log_drops_a_torn_last_line_and_the_rows_after_the_restored_step(tmp_path):
    """What a run killed mid-write leaves: rows logged after its last checkpoint, and a last
    line cut short. Reopened at the restored step, the log keeps only the complete rows up to
    it, so the resumed run's rows follow on lines of their own."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 5, "loss": 1.0}\n{"step": 10, "loss": 0.5}\n{"step": 1')
    run_loop.drop_rows_after(path, 10)
    assert path.read_text() == '{"step": 5, "loss": 1.0}\n{"step": 10, "loss": 0.5}\n'
    run_loop.drop_rows_after(path, 5)
    assert path.read_text() == '{"step": 5, "loss": 1.0}\n'
    run_loop.drop_rows_after(path, 5)  # nothing to drop: left alone
    assert path.read_text() == '{"step": 5, "loss": 1.0}\n'
    path.write_text('{"step": 5}\n[1]\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2 is not a metrics row"):
        run_loop.drop_rows_after(path, 5)


def test_a_draft_without_rounds_has_the_tau_of_ar(target):
    """A budget of one token is decoded by the prefill alone: no verification round, tau 1."""
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    assert prompts_tau(target, draft, [[1, 2, 3], [4]], max_new_tokens=1) == 1.0


def test_evaluate_tau_decodes_with_the_refinement_it_is_given(target, tmp_path, monkeypatch):
    """`evaluate_tau` hands its `Jj-Rr` to the decode: one it dropped would report the tau of
    another setting than the one asked for."""
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [1, 2, 3]}\n')
    seen = {}

    def spy(target, prompts, **kwargs):
        seen.update(kwargs)
        return []

    monkeypatch.setattr(evaluate_module, "generate_batch", spy)
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4)
    assert evaluate_tau(target, draft, path, refine_passes=2, refreshes=1) == 1.0
    assert (seen["refine_passes"], seen["refreshes"]) == (2, 1)


def test_the_mesh_takes_the_devices_its_sizes_say(caplog):
    """-1 on one axis spans the devices the other leaves; explicit sizes take the first devices
    (the idle ones warned about); sizes that do not fit are refused."""
    devices = jax.devices()[:2]
    assert dict(make_mesh(MeshConfig(data=-1, fsdp=2), devices).shape) == {"data": 1, "fsdp": 2}
    assert dict(make_mesh(MeshConfig(data=2, fsdp=-1), devices).shape) == {"data": 2, "fsdp": 1}
    with caplog.at_level("WARNING", logger="jetspec_jax.training.sharding"):
        mesh = make_mesh(MeshConfig(data=1, fsdp=1), devices)
    assert list(mesh.devices.flat) == devices[:1]
    assert "mesh 1 x 1 leaves 1 device idle" in caplog.text
    with pytest.raises(ValueError, match="at most one of data, fsdp may be -1"):
        make_mesh(MeshConfig(data=-1, fsdp=-1), devices)
    for data, fsdp in [(-1, 3), (3, 1)]:
        with pytest.raises(
            ValueError, match=f"mesh data={data} x fsdp={fsdp} does not fit 2 devices"
        ):
            make_mesh(MeshConfig(data=data, fsdp=fsdp), devices)


def test_fsdp_splits_each_leaf_along_its_largest_divisible_axis():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[:2])
    tree = {"w": jnp.zeros((4, 8)), "tall": jnp.zeros((6, 3)), "b": jnp.zeros((3,))}
    specs = {k: tuple(v.spec) for k, v in param_shardings(tree, mesh).items()}
    assert specs == {"w": (None, "fsdp"), "tall": ("fsdp", None), "b": (None,)}


def test_fsdp_splits_the_first_of_equal_largest_axes():
    """Of equal largest axes the size divides, `param_shardings` splits the first."""
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[:2])
    tree = {"square": jnp.zeros((4, 4)), "cube": jnp.zeros((3, 6, 6))}
    specs = {k: tuple(v.spec) for k, v in param_shardings(tree, mesh).items()}
    assert specs == {"square": ("fsdp", None), "cube": (None, "fsdp", None)}


@pytest.mark.parametrize("data, fsdp", [(2, 1), (1, 2)])
def test_a_batch_is_split_over_both_mesh_axes(data, fsdp):
    """Every device gets different examples, on the `fsdp` axis too (not replicated over it)."""
    mesh = make_mesh(MeshConfig(data=data, fsdp=fsdp), jax.devices()[:2])
    batch = jax.device_put(np.arange(8).reshape(4, 2), batch_sharding(mesh))
    rows = sorted(np.asarray(s.data)[:, 0].tolist() for s in batch.addressable_shards)
    assert rows == [[0, 2], [4, 6]]


@pytest.mark.parametrize("variant", ["dflash", "jetspec"])
def test_tau_is_measured_with_the_drafts_own_method(target, variant):
    """A mask-input draft (DFlash, JetSpec) is evaluated as it decodes, not as JetSpec++."""
    draft = jetspec_jax.init_draft(target, variant=variant, block_size=4, seed=1)
    prompts = [[1, 2, 3], [4, 5]]
    results = jetspec_jax.generate_batch(
        target, prompts, draft=draft, method=variant, max_new_tokens=12
    )
    rounds = [n for r in results for n in r.acceptance_lengths[1:]]
    assert prompts_tau(target, draft, prompts, max_new_tokens=12) == pytest.approx(np.mean(rounds))


def test_host_params_reassembles_sharded_leaves_in_the_dtype():
    mesh = make_mesh(MeshConfig(data=1, fsdp=2), jax.devices()[:2])
    tree = {"w": jnp.arange(12.0).reshape(4, 3), "b": jnp.ones((3,))}
    sharded = jax.device_put(tree, param_shardings(tree, mesh))
    assert not sharded["w"].sharding.is_fully_replicated
    out = host_params(sharded, jnp.bfloat16)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].shape == (4, 3)
    np.testing.assert_array_equal(np.asarray(out["w"], np.float32), np.asarray(tree["w"]))


def test_a_bad_evaluation_prompt_file_fails_before_training(target, data_files, tmp_path):
    config = _config(data_files, tmp_path / "run")
    missing = tmp_path / "missing.jsonl"
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_prompts=str(missing))
    )
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        train(config, target=target)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\n{"id": "x"}\n')
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_prompts=str(bad))
    )
    with pytest.raises(ValueError, match="bad.jsonl:2 has neither 'prompt_ids' nor a string"):
        train(config, target=target)
    # A prompt that with the evaluation's new tokens overflows the context: its first evaluation
    # would fail, and every resume with it.
    context = target.config.max_position_embeddings
    long = tmp_path / "long.jsonl"
    long.write_text('{"prompt_ids": [1, 2]}\n' + json.dumps({"prompt_ids": [1] * (context - 2)}))
    data = dataclasses.replace(config.data, eval_prompts=str(long), eval_max_new_tokens=16)
    message = f"long.jsonl:2: a prompt of {context - 2} tokens \\+ data.eval_max_new_tokens=16"
    with pytest.raises(ValueError, match=message):
        train(dataclasses.replace(config, data=data), target=target)
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing was trained


def test_the_draft_is_exported_before_the_final_evaluation(
    target, data_files, straight_run, tmp_path, monkeypatch
):
    """A final evaluation that fails must not cost the trained draft."""
    _, straight_dir = straight_run
    shutil.copytree(straight_dir / "checkpoints", tmp_path / "checkpoints")  # all 80 steps done

    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(trainer, "prompts_tau", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train(_config(data_files, tmp_path), target=target)
    assert jetspec_jax.load_draft(tmp_path / "draft", target).config.block_size == 4
    # The failed run closed its TensorBoard writer: no writer thread outlives it.
    writers = [t for t in threading.enumerate() if t.__module__.startswith("tensorboardX")]
    assert not writers
    # The rerun finds the run finished and exported, but not its evaluation: it evaluates.
    monkeypatch.undo()
    result = train(_config(data_files, tmp_path), target=target)
    assert result.already_finished and result.eval_tau is not None
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_tau" in r] == [80]
    assert train(_config(data_files, tmp_path), target=target).eval_tau is None  # logged: done


def test_an_export_of_an_earlier_end_is_made_anew(target, data_files, straight_run, tmp_path):
    """A run extended with more steps and killed while exporting its new last step leaves its
    earlier end's export: the rerun finds the steps done but exports the final weights, rather
    than keep that export as the finished run's."""
    _, straight_dir = straight_run
    shutil.copytree(straight_dir / "checkpoints", tmp_path / "checkpoints")  # all 80 steps done
    earlier = jetspec_jax.init_draft(target, variant="jetspec++", block_size=4, seed=1)
    earlier.save(tmp_path / "draft")  # as if exported at the end of a shorter run
    result = train(_config(data_files, tmp_path, evaluate=False), target=target)
    assert not result.already_finished and result.steps == 80
    exported = jetspec_jax.load_draft(tmp_path / "draft", target)
    pairs = zip(jax.tree.leaves(exported.params), jax.tree.leaves(result.draft.params), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Now the export holds the final weights: a rerun keeps it.
    assert train(_config(data_files, tmp_path, evaluate=False), target=target).already_finished


def test_a_run_dir_another_process_trains_is_refused(target, data_files, tmp_path):
    """Two trainings of one run.dir would interleave checkpoints (orbax errors) and duplicate
    metrics rows: the second is refused while the first holds the run's lock."""
    tmp_path.mkdir(exist_ok=True)
    with (tmp_path / LOCK_FILE).open("ab") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)  # another open file: as another process holds it
        with pytest.raises(ValueError, match="being trained by another process"):
            train(_config(data_files, tmp_path, **SHORT), target=target)
        assert not has_checkpoint(tmp_path) and not (tmp_path / "metrics.jsonl").exists()
    # Released: the run trains (a step and its checkpoint).
    assert train(_config(data_files, tmp_path, **SHORT), target=target, stop_after=1) is None
    assert has_checkpoint(tmp_path)


def test_a_resume_with_another_process_count_is_refused_before_the_model_load(
    target, data_files, tmp_path, monkeypatch
):
    """Each process saved its own data position: a draft run moved to another process count is
    refused from its recorded setup, before the target's weights load (minutes for a large
    target)."""
    config = dataclasses.replace(
        _config(data_files, tmp_path, evaluate=False, **SHORT), target=str(target.path)
    )
    assert train(config, target=target, stop_after=1) is None
    setup = tmp_path / "run_setup.json"
    setup.write_text(json.dumps({**json.loads(setup.read_text()), "process_count": 2}))
    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("weights loaded"))
    with pytest.raises(ValueError, match="written by 2 process\\(es\\), this run has 1"):
        train(config)


def test_processes_given_different_settings_are_refused_by_name(tmp_path, monkeypatch):
    """A `--set` on one host only: refused on every process, naming the keys and the process,
    not left to fail in a collective. Paths may differ between hosts. Seen from process 0 of 2."""
    setup = dict(target="/a/t", data_files=["/a/d.jsonl"], records=8, optim={"steps": 6})
    paths = ("target", "data_files")
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    allgather = "process_allgather"

    def gathered_with(other):  # process 1's digests, as its own call sends them
        sent = []
        monkeypatch.setattr(
            run_loop.multihost_utils, allgather, lambda d: sent.append(d) or d[None]
        )
        run_loop.check_processes_agree(tmp_path, other, paths)
        monkeypatch.setattr(run_loop.multihost_utils, allgather, lambda d: np.stack([d, sent[0]]))

    gathered_with({**setup, "target": "/b/t", "data_files": ["/b/d.jsonl"]})
    run_loop.check_processes_agree(tmp_path, setup, paths)  # other mount points: the same run
    gathered_with({**setup, "records": 9, "optim": {"steps": 8}})
    with pytest.raises(ValueError, match=r"process\(es\) 1 were given another optim, records "):
        run_loop.check_processes_agree(tmp_path, setup, paths)


def test_a_refusal_by_process_0_alone_fails_every_process(tmp_path, monkeypatch):
    """Process 0 alone holds the run's lock and writes its metrics: when it refuses the run (the
    lock held, a corrupt metrics log), the others refuse too, rather than go on to their first
    collective and wait there for it, and it for them at exit, forever. Seen from process 1 of
    2, told by the broadcast that process 0 failed."""
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(run_loop.multihost_utils, "process_allgather", lambda d: d[None])
    monkeypatch.setattr(run_loop.multihost_utils, "broadcast_one_to_all", lambda x: np.int32(1))
    run = run_loop.RunConfig(dir=str(tmp_path))
    opened = run_loop.opened_run(tmp_path, run, None, None, setup={}, paths=(), total_steps=2)
    with pytest.raises(ValueError, match=f"{tmp_path}: process 0 refused to open the run"):
        with opened:
            pass
    assert list(tmp_path.iterdir()) == []  # nothing begun: no checkpoint directory


def test_a_run_killed_while_evaluating_evaluates_that_step_on_resume(
    target, data_files, tmp_path, monkeypatch
):
    """The evaluation of step k runs before step k's checkpoint: a run that dies evaluating
    resumes before k and evaluates it, rather than after k without its evaluation."""
    config = _config(data_files, tmp_path, **SHORT)  # the straight run's evaluation shapes
    config = dataclasses.replace(
        config,
        run=dataclasses.replace(config.run, checkpoint_every=2, eval_every=2, tensorboard=False),
    )

    def dying(*args, **kwargs):
        raise RuntimeError("killed while evaluating")

    monkeypatch.setattr(trainer, "prompts_tau", dying)
    with pytest.raises(RuntimeError, match="killed while evaluating"):
        train(config, target=target)
    assert not has_checkpoint(tmp_path)
    monkeypatch.undo()
    train(config, target=target)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval_tau" in r] == [2, 4, 6]


def test_no_device_keeps_the_loaded_target_while_the_steps_run(
    checkpoints, data_files, tmp_path, monkeypatch
):
    """The steps read the target sharded over the mesh (fsdp here); the whole copy the run loaded
    must leave the device, and come back only while an evaluation decodes."""
    loaded, seen = [], {}
    load_target, run_steps = trainer.load_target, trainer.run_steps
    prompts_tau = trainer.prompts_tau

    def spy_load(*args, **kwargs):
        target = load_target(*args, **kwargs)
        loaded.append(weakref.ref(target.params["embed_tokens"]["embedding"]))
        return target

    def spy_steps(*args, **kwargs):
        gc.collect()
        seen["loaded copy alive"] = loaded[0]() is not None
        return run_steps(*args, **kwargs)

    def spy_evaluate(target, *args, **kwargs):
        seen["evaluated on"] = type(target.params["embed_tokens"]["embedding"])
        return prompts_tau(target, *args, **kwargs)

    monkeypatch.setattr(trainer, "load_target", spy_load)
    monkeypatch.setattr(trainer, "run_steps", spy_steps)
    monkeypatch.setattr(trainer, "prompts_tau", spy_evaluate)
    config = dataclasses.replace(
        _config(data_files, tmp_path, **SHORT),
        target=str(checkpoints.get("qwen3")[0]),
        target_dtype="float32",
        mesh=MeshConfig(data=1, fsdp=2),
    )
    result = train(config)
    assert seen["loaded copy alive"] is False
    assert issubclass(seen["evaluated on"], jax.Array)  # not host arrays copied on every call
    assert result.eval_tau is not None


def test_sequences_longer_than_the_targets_context_are_refused(target, data_files, tmp_path):
    config = _config(data_files, tmp_path)
    context = target.config.max_position_embeddings
    data = dataclasses.replace(config.data, max_length=context + 1)
    with pytest.raises(ValueError, match=f"data.max_length {context + 1} exceeds .* {context}"):
        train(dataclasses.replace(config, data=data), target=target)
    assert not (tmp_path / "checkpoints").exists()
    # The whole context is a valid length.
    at_context = dataclasses.replace(config.data, max_length=context)
    check_fits_context(dataclasses.replace(config, data=at_context), target.config)


def test_an_evaluation_prompt_may_fill_the_context_with_its_budget():
    """Prompt plus `data.eval_max_new_tokens` may equal the context; one token more is refused."""
    import types

    from jetspec_jax.training.config import DataConfig, TrainConfig
    from jetspec_jax.training.run_helpers import _check_eval_prompt_fits

    config = TrainConfig(data=DataConfig(files=("a.jsonl",), eval_max_new_tokens=4))
    target_config = types.SimpleNamespace(max_position_embeddings=32)
    _check_eval_prompt_fits(config, target_config, "e.jsonl:1", 28)
    with pytest.raises(ValueError, match="e.jsonl:1: a prompt of 29 tokens"):
        _check_eval_prompt_fits(config, target_config, "e.jsonl:1", 29)


def test_evaluation_prompt_records_are_checked_by_line(target, tmp_path):
    path = tmp_path / "p.jsonl"
    cases = {
        '{"id": "a"}': "p.jsonl:2 has neither 'prompt_ids' nor a string 'prompt'",
        '{"prompt_ids": "1 2 3"}': "p.jsonl:2: 'prompt_ids' must be a non-empty list of integers",
        '{"prompt_ids": [1, 2.5]}': "p.jsonl:2: 'prompt_ids' must be a non-empty list",
        '{"prompt_ids": [1, true]}': "p.jsonl:2: 'prompt_ids' must be a non-empty list",
        '{"prompt_ids": []}': "p.jsonl:2: 'prompt_ids' must be a non-empty list",
        '{"prompt": 7}': "p.jsonl:2 has neither",
        '{"prompt_ids": [1, 97]}': r"p.jsonl:2: 'prompt_ids' holds ids outside .* \[0, 97\)",
    }
    for line, message in cases.items():
        path.write_text('{"prompt_ids": [1, 2]}\n' + line + "\n")
        with pytest.raises(ValueError, match=message):
            eval_prompt_ids(target, path, num_prompts=4)
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3]}\n{"id": "unread"}\n')
    assert eval_prompt_ids(target, path, num_prompts=2) == [[1, 2], [3]]


def test_every_process_refuses_too_few_examples_alike():
    """7 examples over 2 processes with batch 4: process 0's share (4) would fit, process 1's (3)
    not; refused by one process alone, the other would wait forever in its first collective."""
    records = [{"prompt_ids": [1, i], "response_ids": [3, 4, 5]} for i in range(7)]
    for index in (0, 1):
        with pytest.raises(ValueError, match="fewer than one batch of 4"):
            training_dataset(
                records, batch_size=4, max_length=16, seed=0, process_index=index, process_count=2
            )
    # Batches of 3: process 1's share (3 of the 7) is exactly one batch.
    batch = next(
        iter(
            training_dataset(
                records, batch_size=3, max_length=16, seed=0, process_index=1, process_count=2
            )
        )
    )
    assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {
        "tokens": ((3, 16), np.int32),
        "loss_mask": ((3, 16), np.bool_),
    }
    assert len(set(batch["tokens"][:, 1].tolist())) == 3
    np.testing.assert_array_equal(batch["tokens"][:, 2:5], [[3, 4, 5]] * 3)
    response = (np.arange(16) >= 2) & (np.arange(16) < 5)
    np.testing.assert_array_equal(batch["loss_mask"], np.tile(response, (3, 1)))


def test_global_batches_mix_records_from_the_whole_file():
    """Each epoch, the processes' shares are disjoint and cover every record, and a global batch
    (the processes' local batches side by side) is a random draw of the file: not, as when each
    process shuffled its own slice alike, runs of neighbouring records (which `regenerate`
    writes sorted by length)."""
    count, processes, local = 64, 4, 2
    records = [{"prompt_ids": [1, i], "response_ids": [3, 4]} for i in range(count)]
    per_epoch = count // processes // local  # batches per process per epoch
    orders = []  # orders[p][epoch] = the record ids process p reads in that epoch
    for index in range(processes):
        batches = iter(
            training_dataset(
                records,
                batch_size=local,
                max_length=8,
                seed=0,
                process_index=index,
                process_count=processes,
            )
        )
        ids = [next(batches)["tokens"][:, 1].tolist() for _ in range(2 * per_epoch)]
        flat = [i for batch in ids for i in batch]
        orders.append([flat[: count // processes], flat[count // processes :]])
    for epoch in (0, 1):
        assert sorted(i for order in orders for i in order[epoch]) == list(range(count))
    assert orders[0][0] != orders[0][1]  # each epoch shuffled anew
    # Process p's k-th record was processes * perm[k] + p for every p: the same group each step.
    groups = [[i // processes for i in order[0]] for order in orders]
    assert any(group != groups[0] for group in groups[1:])


def test_training_data_is_checked_against_the_target(tmp_path, caplog):
    """Ids past the vocabulary (data of another tokenizer) are refused by line; a prompt that fills
    max_length leaves nothing to supervise: skipped and counted; a response that runs past it is
    cut there (kept, and the tokens lost counted)."""
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt_ids": [1, 2], "response_ids": [3, 4]},
        {"prompt_ids": [1] * 8, "response_ids": [3]},  # fills max_length 8
        {"prompt_ids": [1, 2], "response_ids": []},
        {"prompt_ids": [1, 2], "response_ids": [3] * 10},  # 4 tokens past max_length 8
        {"prompt_ids": [], "response_ids": [3, 4]},  # a first token with no context
        {"prompt_ids": [1, 2], "response_ids": [4] * 6},  # fits max_length 8 exactly
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with caplog.at_level("WARNING"):
        records = read_regenerated([path], vocab_size=5, max_length=8)
    assert [{k: v.tolist() for k, v in r.items()} for r in records] == [rows[0], rows[3], rows[5]]
    assert all(v.dtype == np.int32 for r in records for v in r.values())  # 4 bytes a token
    assert "skipped 1 records whose prompt fills max_length 8" in caplog.text
    assert "skipped 2 records with an empty prompt or response" in caplog.text
    assert "cut 1 of 3 records at max_length 8: 4 of all 18 response tokens (22.2%)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        read_regenerated([path], vocab_size=5, max_length=16)  # nothing cut or skipped...
    assert "cut" not in caplog.text and "fills" not in caplog.text  # ...nothing said of it
    booleans = tmp_path / "booleans.jsonl"
    booleans.write_text('{"prompt_ids": [true, 2], "response_ids": [3]}\n')
    with pytest.raises(ValueError, match="booleans.jsonl:1 lacks integer prompt_ids"):
        read_regenerated([booleans])
    with pytest.raises(ValueError, match=f"{path}:1 holds a token id outside .* vocabulary of 4"):
        read_regenerated([path], vocab_size=4)
    with pytest.raises(ValueError, match="no usable records"):
        read_regenerated([path], max_length=2)
    (tmp_path / "huge.jsonl").write_text('{"prompt_ids": [1, 2147483648], "response_ids": [3]}\n')
    with pytest.raises(
        ValueError, match="huge.jsonl:1 holds a token id outside \\[0, 2\\*\\*31\\)"
    ):
        read_regenerated([tmp_path / "huge.jsonl"])


def test_evaluation_prompts_that_are_training_prompts_are_warned_about(target, tmp_path, caplog):
    from jetspec_jax.training.config import load_train_config
    from jetspec_jax.training.run_helpers import read_eval_prompts

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [3, 4]}\n{"prompt_ids": [5]}\n')
    path = tmp_path / "c.yaml"
    path.write_text(f"data: {{files: [a.jsonl], eval_prompts: {prompts}, eval_num_prompts: 2}}\n")
    config = load_train_config(path)
    training = [{"prompt_ids": p, "response_ids": [6]} for p in ([1, 2], [5], [2, 1])]
    with caplog.at_level("WARNING", logger="jetspec_jax.training.trainer"):
        assert read_eval_prompts(config, target, training) == [[1, 2], [3, 4]]
        assert "1 of the 2 evaluation prompts" in caplog.text  # [5] is past eval_num_prompts
        caplog.clear()
        read_eval_prompts(config, target, training[1:])
        assert not caplog.text


def test_a_draft_run_in_an_adapter_runs_directory_is_refused_before_the_model_load(
    tmp_path, monkeypatch
):
    """A draft run pointed at an adapter run's directory is named as such before the target
    loads, not by orbax's tree dump after it."""
    from jetspec_jax.training import trainer
    from jetspec_jax.training.config import load_train_config

    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("loaded"))
    monkeypatch.setattr(trainer, "has_checkpoint", lambda run_dir: True)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    run_dir = tmp_path / "adapter_run"
    run_dir.mkdir()
    setup = {"draft": "runs/x/draft", "adapter": {"kappa": 0.5}, "process_count": 1}
    (run_dir / "run_setup.json").write_text(json.dumps(setup))
    (tmp_path / "c.yaml").write_text("")
    config = load_train_config(tmp_path / "c.yaml", [f"data.files=[{data}]", f"run.dir={run_dir}"])
    with pytest.raises(ValueError, match=f"run.dir {run_dir} holds an adapter run"):
        trainer.train(config)


def test_missing_input_files_and_a_bad_seed_fail_before_the_model_load(tmp_path, monkeypatch):
    from jetspec_jax.training import adapter_trainer, trainer
    from jetspec_jax.training.config import load_train_config

    monkeypatch.setattr(trainer, "load_target", lambda *a, **k: pytest.fail("loaded"))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    path = tmp_path / "c.yaml"
    path.write_text(f"data: {{files: [{data}, {tmp_path}/gone.jsonl]}}\nrun: {{dir: {tmp_path}}}\n")
    with pytest.raises(FileNotFoundError, match=f"missing input file\\(s\\): {tmp_path}/gone"):
        trainer.train(load_train_config(path))
    config = load_train_config(path, [f"data.files=[{data}]", "adapter.eval_files=[held.jsonl]"])
    with pytest.raises(
        FileNotFoundError, match="missing input file\\(s\\): held.jsonl \\(adapter.eval_files\\)"
    ):
        adapter_trainer.train_adapter(config)
    gone = f"{tmp_path}/gone.jsonl"  # the data and the eval prompts: one file, named once
    config = load_train_config(path, [f"data.files=[{gone}]", f"data.eval_prompts={gone}"])
    with pytest.raises(
        FileNotFoundError,
        match=f"missing input file\\(s\\): {gone} \\(data.files, data.eval_prompts\\)$",
    ):
        trainer.train(config)
    # Each file is named with the setting that gives it: a start draft's file is one the user
    # never typed (its config.json).
    config = load_train_config(path, [f"data.files=[{data}]", f"draft.init_from={tmp_path}/no"])
    with pytest.raises(
        FileNotFoundError, match=f"file\\(s\\): {tmp_path}/no/config.json \\(draft.init_from\\)$"
    ):
        trainer.train(config)
    with pytest.raises(ValueError, match="optim.seed"):
        load_train_config(path, ["optim.seed=-1"])
    # A batch the mesh does not split (2 devices here).
    config = load_train_config(path, [f"data.files=[{data}]", "optim.batch_size=3", "mesh.data=2"])
    with pytest.raises(ValueError, match=r"^optim\.batch_size=3 must be a multiple of the mesh"):
        trainer.train(config)


def test_what_the_targets_config_refuses_fails_before_its_weights_load(
    checkpoints, target, tmp_path, monkeypatch
):
    """A draft section or a training length the target's architecture cannot take is refused
    from its config.json, not after its weights load (minutes for a large target)."""
    from jetspec_jax.training import adapter_trainer, trainer
    from jetspec_jax.training.config import load_train_config

    for module in (trainer, adapter_trainer):
        monkeypatch.setattr(module, "load_target", lambda *a, **k: pytest.fail("loaded"))
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt_ids": [1], "response_ids": [2]}\n')
    path = tmp_path / "c.yaml"
    path.write_text(
        f"target: {checkpoints.get('qwen3')[0]}\ndata: {{files: [{data}]}}\n"
        f"run: {{dir: {tmp_path / 'run'}}}\n"
    )
    layers, context = target.config.num_layers, target.config.max_position_embeddings
    taps = f"draft.target_layer_ids=[0, {layers}]"
    with pytest.raises(CheckpointError, match=f"target_layer_ids .*{layers}"):
        trainer.train(load_train_config(path, [taps]))
    too_long = f"data.max_length={context + 1}"
    with pytest.raises(ValueError, match=f"data.max_length {context + 1} exceeds"):
        trainer.train(load_train_config(path, [too_long]))
    draft = jetspec_jax.init_draft(target, block_size=4)
    # Checked against the target the run loads, not the one a given draft was built for.
    longer = dataclasses.replace(target.config, max_position_embeddings=2 * context)
    draft = dataclasses.replace(draft, target_config=longer)
    with pytest.raises(ValueError, match=f"data.max_length {context + 1} exceeds"):
        adapter_trainer.train_adapter(load_train_config(path, [too_long]), draft=draft)
    assert not (tmp_path / "run").exists()


def test_a_mesh_on_several_processes_takes_as_many_devices_of_each():
    """2 hosts x 4 devices with `mesh: {data: 1, fsdp: 4}` would hold host 0's devices only, and
    host 1 would feed its share of the batch to none (the 2-process CLI test runs a valid one)."""
    from types import SimpleNamespace

    from jetspec_jax.training.config import MeshConfig
    from jetspec_jax.training.sharding import make_mesh

    devices = [SimpleNamespace(process_index=i // 4, id=i) for i in range(8)]
    for data, fsdp in ((1, 4), (1, 6)):
        with pytest.raises(ValueError, match="the same number of devices of each"):
            make_mesh(MeshConfig(data=data, fsdp=fsdp), devices)


def test_export_dtype_keeps_a_bfloat16_targets_draft_in_float32(target, data_files, tmp_path):
    """By default the export is in the target's dtype; `export_dtype: float32` keeps the float32
    master weights unrounded, and the adapter stage reads the draft back in it."""
    bf16_target = jetspec_jax.load_target(target.path, dtype="bfloat16")
    config = _config(data_files, tmp_path, evaluate=False, steps=2, warmup_steps=1)
    config = dataclasses.replace(config, export_dtype="float32")
    result = train(config, target=bf16_target)
    assert result.draft.dtype == "float32"
    saved = jetspec_jax.load_draft(result.export_dir, bf16_target, dtype="float32")
    leaves = jax.tree.leaves(saved.params)
    for got, want in zip(leaves, jax.tree.leaves(result.draft.params), strict=True):
        np.testing.assert_array_equal(got, want)
    # Weights bfloat16 cannot hold: the export was not rounded on the way.
    assert any(np.any(x != x.astype(jnp.bfloat16).astype(np.float32)) for x in leaves)
    with pytest.raises(ValueError, match="invalid value for export_dtype"):
        dataclasses.replace(config, export_dtype="float16")
    config = dataclasses.replace(
        config, run=dataclasses.replace(config.run, dir=str(tmp_path / "d"))
    )
    default = train(dataclasses.replace(config, export_dtype=None), target=bf16_target)
    assert default.draft.dtype == "bfloat16"
    assert jetspec_jax.load_draft(default.export_dir, bf16_target).dtype == "bfloat16"


def test_an_example_keeps_the_prompt_cuts_the_responses_end_and_masks_the_response():
    record = {
        "prompt_ids": np.asarray([1, 2, 3], np.int32),
        "response_ids": np.asarray([4, 5, 6, 7, 8, 9], np.int32),
    }
    cut = to_example(record, max_length=6)
    assert cut["tokens"].tolist() == [1, 2, 3, 4, 5, 6]
    assert cut["loss_mask"].tolist() == [False] * 3 + [True] * 3
    padded = to_example(record, max_length=12)
    assert padded["tokens"].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 0]
    assert padded["loss_mask"].tolist() == [False] * 3 + [True] * 6 + [False] * 3
