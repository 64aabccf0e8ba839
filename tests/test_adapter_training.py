"""Adapter training (`train.py adapter`): weighting, blocks, the stale baseline, training, resume,
the CLI and config refusals, on the tiny target."""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
import json
import pathlib
import shutil
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jetspec_jax
from jetspec_jax.adapter import init_adapter
from jetspec_jax.checkpoint.adapter_files import load_adapter
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.decoding.target_proxy import TargetProxyDraft
from jetspec_jax.models import adapter as adapter_model
from jetspec_jax.models.transformer import forward
from jetspec_jax.random_streams import EVAL_BATCH, stream
from jetspec_jax.training import adapter_trainer
from jetspec_jax.training.adapter_evaluate import adapter_state_metrics
from jetspec_jax.training.adapter_loss import (
    adapter_loss,
    normalised_mse,
    position_weights,
    sample_blocks,
    teacher_levels,
)
from jetspec_jax.training.adapter_step import (
    AdapterStepConfig,
    adapter_eval_metrics,
    adapter_train_step,
)
from jetspec_jax.training.adapter_trainer import (
    _eval_batches,
    adapter_optim,
    initial_adapter,
    train_adapter,
)
from jetspec_jax.training.config import (
    AdapterTrainConfig,
    DataConfig,
    MeshConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    load_train_config,
)
from jetspec_jax.training.data import read_regenerated, to_example
from jetspec_jax.training.evaluate import evaluate_tau
from jetspec_jax.training.run_helpers import batch_sizes
from jetspec_jax.training.sharding import batch_sharding, make_mesh, param_shardings
from jetspec_jax.training.step import init_state, make_optimizer

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target(checkpoints):
    return jetspec_jax.load_target(checkpoints.get("qwen3")[0])


@pytest.fixture(scope="module")
def draft(target):
    """A jetspec++ draft with two taps (the adapter chains embedding -> tap 0 -> tap 1)."""
    return jetspec_jax.init_draft(
        target, variant="jetspec++", num_layers=1, target_layer_ids=(0, 1), block_size=4
    )


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """Conversations of random tokens: the adapter learns the target's states of any sequence, so
    the target's own responses (slow to generate) are not needed here."""
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("adapter_data") / "data.jsonl"
    with path.open("w") as f:
        for _ in range(8):
            prompt = rng.integers(0, 97, int(rng.integers(6, 12))).tolist()
            response = rng.integers(0, 97, int(rng.integers(12, 24))).tolist()
            f.write(json.dumps({"prompt_ids": prompt, "response_ids": response}) + "\n")
    return path


def _config(data_file, run_dir, **adapter) -> TrainConfig:
    optim = OptimConfig(
        batch_size=4,
        anchors_per_sequence=8,
        steps=4,
        learning_rate=1e-2,
        warmup_steps=1,
        compute_dtype="float32",
    )
    return TrainConfig(
        data=DataConfig(files=(str(data_file),), max_length=32, eval_prompts=None),
        target_dtype="float32",
        optim=optim,
        adapter=AdapterTrainConfig(
            **{"layers_per_module": (1, 2), "intermediate_size": 32, **adapter}
        ),
        mesh=MeshConfig(data=1, fsdp=1),
        run=RunConfig(dir=str(run_dir), checkpoint_every=100, log_every=1, tensorboard=False),
    )


def test_position_weights_are_kappa_powers_normalised_per_block():
    valid = jnp.asarray([[True, True, True, False], [False] * 4, [True] * 4])
    w = np.asarray(position_weights(valid, 0.5))
    np.testing.assert_allclose(w[0], np.array([1, 0.5, 0.25, 0]) / 1.75, rtol=1e-6)
    np.testing.assert_array_equal(w[1], 0.0)  # a block past the sequence's end weighs nothing
    np.testing.assert_allclose(w[2], np.array([8, 4, 2, 1]) / 15, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(position_weights(valid, 1.0))[2], 0.25)


def test_normalised_mse_by_hand_and_scale_free_across_taps():
    # One block of two positions, H = 1; kappa 1/2 -> weights 2/3, 1/3.
    w = position_weights(jnp.asarray([[[True, True]]]), 0.5)
    true = jnp.asarray([[[[[2.0], [2.0]]]], [[[[20.0], [20.0]]]]])  # [n=2, B, A, K, H]
    pred = jnp.asarray([[[[[1.0], [0.0]]]], [[[[10.0], [0.0]]]]])
    # tap 0: (2/3 * 1 + 1/3 * 4) / (2/3 * 4 + 1/3 * 4) = 2 / 4; tap 1 is tap 0 times 10.
    np.testing.assert_allclose(np.asarray(normalised_mse(pred, true, w)), [0.5, 0.5], rtol=1e-6)


def test_blocks_are_the_sequences_own_tokens_and_stop_at_its_end():
    tokens = jnp.asarray(np.arange(2 * 12).reshape(2, 12) + 1, jnp.int32)
    lengths = np.array([9, 12])
    mask = jnp.asarray((np.arange(12)[None] >= 4) & (np.arange(12)[None] < lengths[:, None]))
    blocks = sample_blocks(jax.random.key(0), tokens, mask, 4, 6)
    tok, pos, valid = (np.asarray(x) for x in (blocks.tokens, blocks.positions, blocks.valid))
    anchors = np.asarray(blocks.anchors)
    for b in range(2):
        np.testing.assert_array_equal(tok[b], np.asarray(tokens)[b][pos[b]])
        np.testing.assert_array_equal(pos[b][:, 0], anchors[b])
        # Real anchors are followed by a response token; row 0 has 5 such positions for 6 anchors.
        real = np.append(np.asarray(mask)[b][1:], False)[anchors[b]]
        assert real.sum() == min(6, lengths[b] - 4)
        raw = anchors[b][:, None] + np.arange(4)
        np.testing.assert_array_equal(valid[b], (raw < lengths[b]) & real[:, None])


def test_a_zero_adapter_is_the_stale_guess(target, draft, data_file):
    """With every residual branch zeroed, each module passes its input through: tap 0's
    prediction is the embedding, which is exactly the stale guess, so its gap closed is 0."""
    adapter = init_adapter(draft, layers_per_module=(1, 1), intermediate_size=32)
    params = jax.tree.map(jnp.zeros_like, adapter.params)
    records = [json.loads(x) for x in data_file.read_text().splitlines()]
    tokens = jnp.asarray([(r["prompt_ids"] + r["response_ids"])[:24] for r in records[:2]])
    mask = jnp.arange(24)[None] >= 12
    levels, taps = jax.jit(teacher_levels, static_argnums=(1, 2))(
        target.params, target.config, (0, 1), tokens
    )
    blocks = sample_blocks(jax.random.key(1), tokens, jnp.broadcast_to(mask, tokens.shape), 4, 5)
    emb = target.params["embed_tokens"]["embedding"]
    loss_fn = jax.jit(adapter_loss, static_argnums=(1, 6))  # op by op is slow on CPU
    loss, m = loss_fn(params, adapter.config, emb, levels, taps, blocks, 0.5)
    np.testing.assert_allclose(float(m["gap_closed"][0]), 0.0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(m["nmse"])[0], np.asarray(m["stale_nmse"])[0], 1e-6)
    np.testing.assert_allclose(float(loss), float(np.sum(np.asarray(m["nmse"]))), rtol=1e-6)


def test_the_adapter_loss_equals_a_reference_built_from_the_decode_path(target, draft):
    """nmse of tap m = sum w |pred - tap_m(a+j)|^2 / sum w |tap_m(a+j)|^2 over each block's
    positions a+j inside the sequence, w = kappa^j normalised per block; tap_m is the target's
    state at the draft's m-th tap layer (what decoding feeds the draft), and pred the adapter's
    decode-time prediction from the verified context up to the anchor and the block's tokens."""
    adapter = init_adapter(draft, layers_per_module=(1, 1), intermediate_size=32, init_std=0.2)
    k_len, anchors_per_row, kappa, length = 4, 6, 0.5, 24
    prompt, end = np.array([5, 8]), np.array([17, 24])
    positions = np.arange(length)[None]
    rng = np.random.default_rng(0)
    tokens = np.where(positions < end[:, None], rng.integers(1, 97, (2, length)), 0)
    mask = (positions >= prompt[:, None]) & (positions < end[:, None])
    batch = {"tokens": jnp.asarray(tokens, jnp.int32), "loss_mask": jnp.asarray(mask)}
    optim = OptimConfig(batch_size=2, anchors_per_sequence=anchors_per_row, compute_dtype="float32")
    config = AdapterStepConfig(target.config, adapter.config, optim, k_len, kappa)
    key = jax.random.key(7)
    got = adapter_eval_metrics(adapter.params, target.params, batch, key, config=config)

    anchors = np.asarray(
        sample_blocks(key, batch["tokens"], batch["loss_mask"], k_len, anchors_per_row).anchors
    )
    embedding = target.params["embed_tokens"]["embedding"]
    taps = forward(
        target.params, target.config, batch["tokens"], tap_layers=draft.config.target_layer_ids
    ).taps
    levels = adapter_model.context_levels(embedding, batch["tokens"], taps)
    taps = np.asarray(taps)
    predict = jax.jit(adapter_model.predict_states, static_argnums=1)
    error, norm, blocks = np.zeros(2), np.zeros(2), 0
    for b, j in np.ndindex(anchors.shape):
        a = anchors[b, j]
        if not mask[b, a + 1]:
            continue  # not an anchor: no response token follows
        blocks += 1
        cache = adapter_model.empty_cache(adapter.config, 1, 32, jnp.float32)
        cache = adapter_model.extend_context(
            adapter.params, adapter.config, cache, levels[:, b : b + 1], jnp.asarray([a])
        )
        block = np.minimum(a + np.arange(k_len), length - 1)
        block_tokens = batch["tokens"][b : b + 1, block]
        pred = np.asarray(predict(adapter.params, adapter.config, cache, embedding, block_tokens))
        weights = np.where(a + np.arange(k_len) < end[b], kappa ** np.arange(k_len), 0.0)
        weights /= weights.sum()
        true = taps[:, b, block]  # [n, K, H]
        error += np.sum(weights * np.sum((pred[:, 0] - true) ** 2, -1), -1)
        norm += np.sum(weights * np.sum(true**2, -1), -1)
    np.testing.assert_allclose(np.asarray(got["nmse"]), error / norm, rtol=2e-4)
    assert int(got["blocks"]) == blocks  # blocks, not positions


def _adapter_step_inputs(target, draft, compute_dtype="float32"):
    """`(state, batch, config)` of a small adapter's train step: a warmup of 2 steps, one batch
    of 2 random sequences whose first 4 tokens are the prompt."""
    adapter = init_adapter(draft, layers_per_module=(1, 1), intermediate_size=32)
    optim = OptimConfig(
        batch_size=2, anchors_per_sequence=4, steps=4, warmup_steps=2, compute_dtype=compute_dtype
    )
    config = AdapterStepConfig(target.config, adapter.config, optim, 4, 0.5)
    tokens = np.random.default_rng(0).integers(0, 97, (2, 24))
    batch = {
        "tokens": jnp.asarray(tokens, jnp.int32),
        "loss_mask": jnp.broadcast_to(jnp.arange(24) >= 4, (2, 24)),
    }
    return init_state(adapter.params, make_optimizer(optim)), batch, config


def test_state_metrics_average_the_batches_each_with_blocks_of_its_own(target, draft):
    """`adapter_state_metrics` is the mean over its batches of `adapter_eval_metrics`, batch i's
    blocks drawn from `fold_in(key(seed), i)`: the same batch twice draws other blocks."""
    _, batch, config = _adapter_step_inputs(target, draft)
    params = init_adapter(
        draft, layers_per_module=(1, 1), intermediate_size=32, init_std=0.2
    ).params
    got = adapter_state_metrics(params, target.params, [batch, batch], config=config, seed=3)
    each = [
        adapter_eval_metrics(
            params,
            target.params,
            batch,
            jax.random.fold_in(stream(3, EVAL_BATCH), i),
            config=config,
        )
        for i in range(2)
    ]
    assert float(each[0]["loss"]) != float(each[1]["loss"])  # other blocks
    for name in ("loss", "nmse", "stale_nmse", "gap_closed", "gap_closed_mean"):
        mean = (np.asarray(each[0][name], np.float64) + np.asarray(each[1][name])) / 2
        np.testing.assert_allclose(got[f"eval_{name}"], mean, rtol=1e-6, err_msg=name)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_the_adapter_runs_in_the_compute_dtype_and_keeps_float32_masters(
    target, draft, compute_dtype
):
    """The step casts the adapter's weights to `compute_dtype` for its forward (the frozen target
    is float32 here: any bfloat16 in the program is the adapter's); the updated masters stay
    float32."""
    state, batch, config = _adapter_step_inputs(target, draft, compute_dtype)
    program = adapter_train_step.lower(state, target.params, batch, config=config).as_text()
    assert ("bf16" in program) == (compute_dtype == "bfloat16")
    state, _ = adapter_train_step(state, target.params, batch, config=config)
    assert {leaf.dtype for leaf in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.float32)}


def test_each_adapter_step_draws_new_blocks(target, draft):
    """The same batch and weights at steps 0 and 1: the steps draw other blocks (their keys fold
    in the step), so their losses differ."""
    state, batch, config = _adapter_step_inputs(target, draft)
    after, first = adapter_train_step(state, target.params, batch, config=config)
    again = _adapter_step_inputs(target, draft)[0].replace(step=after.step)  # the same weights
    _, second = adapter_train_step(again, target.params, batch, config=config)
    assert float(first["loss"]) != float(second["loss"])


def test_an_adapter_step_under_x64_and_strict_promotion_equals_the_default_one(target, draft):
    """docs/DECODING.md: a process's `jax_enable_x64` and strict dtype promotion keep the losses
    and the outputs' dtypes; the `blocks` count was summed in x64's int64."""
    state, batch, config = _adapter_step_inputs(target, draft)
    want = adapter_train_step(state, target.params, batch, config=config)
    with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
        state = _adapter_step_inputs(target, draft)[0]  # the step donated the first one
        got = adapter_train_step(state, target.params, batch, config=config)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6)


@pytest.fixture(scope="module")
def workdir(checkpoints, target, data_file, tmp_path_factory):
    """A working directory laid out as configs/tiny_cpu.yaml expects, with a (random) draft at
    `<run.dir>/draft` where the draft stage exports it. The training test and the CLI test run
    the same config, so the second reuses the first's compiled steps."""
    work = tmp_path_factory.mktemp("tiny_adapter")
    tiny = work / "runs" / "tiny"
    shutil.copytree(checkpoints.get("qwen3")[0], tiny / "target")
    shutil.copy(data_file, tiny / "data.jsonl")
    jetspec_jax.init_draft(target, variant="jetspec++", block_size=4).save(tiny / "run" / "draft")
    shutil.copy(ROOT / "configs" / "tiny_cpu.yaml", work / "tiny_cpu.yaml")
    return work


def _tiny_config(run_dir: str) -> TrainConfig:
    config = load_train_config("tiny_cpu.yaml")
    return dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, eval_prompts=None),  # tau: the CLI test's
        run=dataclasses.replace(config.run, dir=run_dir),
    )


def test_training_lowers_the_loss_and_a_resumed_run_equals_a_straight_one(
    target, workdir, monkeypatch
):
    monkeypatch.chdir(workdir)
    draft = jetspec_jax.load_draft("runs/tiny/run/draft", target)
    config = _tiny_config("runs/tiny/straight")
    straight = train_adapter(config, target=target, draft=draft)
    assert straight.steps == 4
    # The trained adapter's evaluation metrics vs the same blocks at initialisation.
    mesh = make_mesh(config.mesh)
    records = read_regenerated(config.data.files, max_length=config.data.max_length)
    batches = _eval_batches(
        config, batch_sizes(4, mesh)[0], batch_sharding(mesh), target.config.vocab_size, records
    )
    step_config = AdapterStepConfig(
        target.config, straight.adapter.config, adapter_optim(config, 8), 4, 0.5
    )
    # Placed on the mesh as the run places them: the run's compiled evaluation serves this one.
    before = adapter_state_metrics(
        *(
            jax.device_put(tree, param_shardings(tree, mesh))
            for tree in (initial_adapter(config, draft).params, target.params)
        ),
        batches,
        config=step_config,
    )
    after = straight.evaluation
    assert after["eval_loss"] < 0.9 * before["eval_loss"], (before, after)
    assert after["eval_gap_closed"][0] > before["eval_gap_closed"][0], (before, after)
    lines = [json.loads(x) for x in open("runs/tiny/straight/adapter_run/metrics.jsonl")]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4]
    assert len(lines[0]["nmse"]) == len(lines[0]["gap_closed"]) == 1

    resumed_config = _tiny_config("runs/tiny/resumed")
    assert train_adapter(resumed_config, target=target, draft=draft, stop_after=2) is None
    with open("runs/tiny/resumed/adapter_run/metrics.jsonl", "a") as f:  # logged, not saved
        f.write('{"step": 3, "loss": 9.0}\n')
    resumed = train_adapter(resumed_config, target=target, draft=draft)
    assert resumed.steps == 4
    lines = [json.loads(x) for x in open("runs/tiny/resumed/adapter_run/metrics.jsonl")]
    assert [x["step"] for x in lines if "loss" in x] == [1, 2, 3, 4]  # step 3 once, the rerun's
    assert lines[2]["loss"] != 9.0
    for a, b in zip(
        jax.tree.leaves(straight.adapter.params),
        jax.tree.leaves(resumed.adapter.params),
        strict=True,
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    loaded = jetspec_jax.load_draft(resumed.export_dir, target).adapter  # the bundle loads back
    assert loaded.config == resumed.adapter.config


def test_the_bundle_is_exported_before_the_final_evaluation(target, workdir, monkeypatch):
    """A failing final evaluation (here the tau one) must not cost the trained adapter."""
    monkeypatch.chdir(workdir)
    draft = jetspec_jax.load_draft("runs/tiny/run/draft", target)
    config = _tiny_config("runs/tiny/failing_eval")
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_prompts="runs/tiny/data.jsonl")
    )

    def failing(*args, **kwargs):
        raise RuntimeError("evaluation failed")

    monkeypatch.setattr(adapter_trainer, "evaluate_refinement_tau", failing)
    with pytest.raises(RuntimeError, match="evaluation failed"):
        train_adapter(config, target=target, draft=draft)
    exported = jetspec_jax.load_draft("runs/tiny/failing_eval/jetspec_pp", target)
    assert exported.adapter.config.layers_per_module == (1,)
    # The rerun finds the run finished and exported, but not its evaluation: it evaluates.
    monkeypatch.undo()
    monkeypatch.chdir(workdir)
    result = train_adapter(config, target=target, draft=draft)
    assert result.already_finished and "tau_predicted" in result.evaluation
    log = pathlib.Path("runs/tiny/failing_eval/adapter_run/metrics.jsonl").read_text()
    rows = [json.loads(x) for x in log.splitlines()]
    assert [r["step"] for r in rows if "eval_loss" in r] == [result.steps]
    assert train_adapter(config, target=target, draft=draft).evaluation == {}  # logged: done


def test_no_device_keeps_the_loaded_target_while_the_steps_run(workdir, monkeypatch):
    """The steps read the target sharded over the mesh (fsdp here); the whole copy the run loaded
    must leave the device, and come back only while the tau evaluation decodes."""
    monkeypatch.chdir(workdir)
    loaded, seen = [], {}
    load_target, run_steps = adapter_trainer.load_target, adapter_trainer.run_steps
    evaluate = adapter_trainer.evaluate_refinement_tau

    def spy_load(*args, **kwargs):
        target = load_target(*args, **kwargs)
        loaded.append(weakref.ref(target.params["embed_tokens"]["embedding"]))
        return target

    def spy_steps(*args, **kwargs):
        gc.collect()
        seen["loaded copy alive"] = loaded[0]() is not None
        return run_steps(*args, **kwargs)

    def spy_evaluate(target, draft, *args, **kwargs):
        leaves = [target.params["embed_tokens"]["embedding"], *jax.tree.leaves(draft.params)]
        seen["evaluated on"] = {type(x) for x in leaves}
        return evaluate(target, draft, *args, **kwargs)

    monkeypatch.setattr(adapter_trainer, "load_target", spy_load)
    monkeypatch.setattr(adapter_trainer, "run_steps", spy_steps)
    monkeypatch.setattr(adapter_trainer, "evaluate_refinement_tau", spy_evaluate)
    config = _tiny_config("runs/tiny/fsdp")
    config = dataclasses.replace(
        config,
        data=dataclasses.replace(config.data, eval_prompts="runs/tiny/data.jsonl"),
        mesh=MeshConfig(data=1, fsdp=2),
    )
    result = train_adapter(config, draft="runs/tiny/run/draft")
    assert seen["loaded copy alive"] is False
    assert all(issubclass(t, jax.Array) for t in seen["evaluated on"]), seen
    assert result.evaluation["tau_predicted"] > 0


def test_a_rerun_of_a_finished_run_keeps_its_export_and_calibration(
    target, workdir, monkeypatch, caplog
):
    """`train.py calibrate` writes into the export; rerunning the finished stage (as the README's
    resumable commands invite) must not export again over it, nor evaluate again; and if the
    draft was retrained since, it says that the export holds the old one, and does not evaluate
    the adapter with the new draft even when a kill cut the final evaluation from the log."""
    from jetspec_jax.calibration import Calibration

    monkeypatch.chdir(workdir)
    shutil.copytree("runs/tiny/run/draft", "runs/tiny/rerun_draft")
    draft = jetspec_jax.load_draft("runs/tiny/rerun_draft", target)
    config = _tiny_config("runs/tiny/rerun")
    first = train_adapter(config, target=target, draft=draft)
    calibrated = jetspec_jax.load_draft(first.export_dir, target)
    calibration = Calibration(replacement_confidence=0.5)
    calibrated.with_adapter(calibrated.adapter, calibration).save(first.export_dir, overwrite=True)
    evaluations = []
    monkeypatch.setattr(
        adapter_trainer, "adapter_state_metrics", lambda *a, **k: evaluations.append(1) or {}
    )
    with caplog.at_level("WARNING", logger=adapter_trainer.__name__):
        again = train_adapter(config, target=target, draft=draft)
    assert again.steps == first.steps and again.evaluation == {} and not evaluations
    assert again.already_finished and "holds the draft" not in caplog.text
    assert jetspec_jax.load_draft(first.export_dir, target).calibration == calibration
    shutil.rmtree(first.export_dir)  # deleted, or a kill mid-export: exported again
    assert not train_adapter(config, target=target, draft=draft).already_finished
    jetspec_jax.load_draft(first.export_dir, target)  # a whole export again
    # An export of other adapter weights (an earlier end's: the run extended with more steps,
    # then killed while exporting its new end) is exported anew, not kept as this run's.
    stale = jetspec_jax.load_draft(first.export_dir, target)
    shifted = jax.tree.map(lambda x: x + 1e-3, stale.adapter.params)
    stale.with_adapter(dataclasses.replace(stale.adapter, params=shifted)).save(
        first.export_dir, overwrite=True
    )
    assert not train_adapter(config, target=target, draft=draft).already_finished
    exported = jetspec_jax.load_draft(first.export_dir, target).adapter.params
    pairs = zip(jax.tree.leaves(exported), jax.tree.leaves(first.adapter.params), strict=True)
    for a, b in pairs:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    evaluations.clear()
    retrained = dataclasses.replace(
        draft, params=jax.tree.map(lambda x: x + 1e-3, draft.params), path=None
    )
    retrained.save("runs/tiny/rerun_draft", overwrite=True)
    metrics = pathlib.Path("runs/tiny/rerun/adapter_run/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [row for row in rows if not (row["step"] == first.steps and "eval_loss" in row)]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in kept))  # killed after the export
    with caplog.at_level("WARNING", logger=adapter_trainer.__name__):
        again = train_adapter(
            config, target=target, draft=jetspec_jax.load_draft("runs/tiny/rerun_draft", target)
        )
    assert f"{first.export_dir} holds the draft this adapter was trained with" in caplog.text
    # The missing final evaluation is not run: the adapter was not trained for this draft.
    assert again.evaluation == {} and not evaluations


def test_a_run_resumed_with_a_retrained_draft_records_it(target, workdir, monkeypatch, caplog):
    """A run resumed (deliberately, after the warning) with a retrained draft trains and exports
    with it: its setup is recorded then, so a rerun of the finished run does not claim that the
    export holds another draft, and runs the final evaluation a kill cut from the log."""
    monkeypatch.chdir(workdir)
    shutil.copytree("runs/tiny/run/draft", "runs/tiny/retrained_draft")
    config = _tiny_config("runs/tiny/retrained")
    assert (
        train_adapter(config, target=target, draft="runs/tiny/retrained_draft", stop_after=1)
        is None
    )
    draft = jetspec_jax.load_draft("runs/tiny/retrained_draft", target)
    retrained = dataclasses.replace(
        draft, params=jax.tree.map(lambda x: x + 1e-3, draft.params), path=None
    )
    retrained.save("runs/tiny/retrained_draft", overwrite=True)
    with caplog.at_level("WARNING"):
        first = train_adapter(config, target=target, draft="runs/tiny/retrained_draft")
    assert "resuming with draft_digest" in caplog.text
    metrics = pathlib.Path("runs/tiny/retrained/adapter_run/metrics.jsonl")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    kept = [row for row in rows if not (row["step"] == first.steps and "eval_loss" in row)]
    assert len(kept) < len(rows)
    metrics.write_text("".join(json.dumps(row) + "\n" for row in kept))  # killed after the export
    caplog.clear()
    with caplog.at_level("WARNING"):
        again = train_adapter(config, target=target, draft="runs/tiny/retrained_draft")
    assert again.already_finished and "holds the draft" not in caplog.text
    assert "resuming with" not in caplog.text
    assert again.evaluation["eval_loss"] == pytest.approx(first.evaluation["eval_loss"])


def test_a_mask_input_draft_is_refused_before_training(target, data_file, tmp_path):
    dflash = jetspec_jax.init_draft(target, variant="dflash", block_size=4)
    with pytest.raises(ValueError, match="token-input .* this draft is 'dflash'"):
        train_adapter(_config(data_file, tmp_path / "run"), target=target, draft=dflash)
    assert not (tmp_path / "run").exists()  # no empty run directory left behind


def test_a_batch_the_mesh_does_not_split_is_refused_before_the_model_load(
    draft, data_file, tmp_path, monkeypatch
):
    """The adapter's own `optim` section sets its batch: the refusal names that key, not the
    draft's `optim.batch_size` (4 here, which the mesh splits), and comes before the load."""
    monkeypatch.setattr(adapter_trainer, "load_target", lambda *a, **k: pytest.fail("loaded"))
    config = _config(data_file, tmp_path / "run")
    config = dataclasses.replace(
        config,
        adapter=dataclasses.replace(
            config.adapter, optim=dataclasses.replace(config.optim, batch_size=3)
        ),
        mesh=MeshConfig(data=2, fsdp=1),
    )
    with pytest.raises(ValueError, match=r"^adapter\.optim\.batch_size=3 must be a multiple"):
        train_adapter(config, draft=draft)
    assert not (tmp_path / "run").exists()


def test_a_resume_with_another_process_count_is_refused_before_the_model_load(
    target, workdir, monkeypatch
):
    """Each process saved its own data position: a run moved to another process count is
    refused from its recorded setup, before the target's weights load (minutes for a large
    target)."""
    monkeypatch.chdir(workdir)
    config = _tiny_config("runs/tiny/moved")
    draft = "runs/tiny/run/draft"
    assert train_adapter(config, target=target, draft=draft, stop_after=1) is None
    setup = pathlib.Path("runs/tiny/moved/adapter_run/run_setup.json")
    setup.write_text(json.dumps({**json.loads(setup.read_text()), "process_count": 2}))
    monkeypatch.setattr(adapter_trainer, "load_target", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ValueError, match="written by 2 process\\(es\\), this run has 1"):
        train_adapter(config, draft=draft)


def test_a_bad_evaluation_prompt_file_fails_before_training(target, draft, data_file, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 5}\n')
    config = _config(data_file, tmp_path / "run")
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_prompts=str(bad))
    )
    with pytest.raises(ValueError, match="bad.jsonl:1 has neither"):
        train_adapter(config, target=target, draft=draft)
    assert not (tmp_path / "run" / "adapter_run" / "checkpoints").exists()


def test_the_eval_prompt_file_is_needed_only_when_tau_is_evaluated(
    target, draft, data_file, tmp_path
):
    missing = str(tmp_path / "missing_eval.jsonl")
    config = _config(data_file, tmp_path / "run", eval_tau=False)
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, eval_prompts=missing)
    )
    assert train_adapter(config, target=target, draft=draft, stop_after=1) is None
    evaluated = dataclasses.replace(
        config, adapter=dataclasses.replace(config.adapter, eval_tau=True)
    )
    with pytest.raises(FileNotFoundError, match="missing_eval.jsonl"):
        train_adapter(evaluated, target=target, draft=draft)


def test_without_tau_the_eval_prompts_are_not_checked_before_the_target_load(
    target, draft, data_file, tmp_path, monkeypatch
):
    """`adapter.eval_tau: false` reads no evaluation prompts: a file `data.eval_prompts` names
    that the run could not use is no refusal before the target load either."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 5}\n')
    config = _config(data_file, tmp_path / "run", eval_tau=False)
    config = dataclasses.replace(
        config,
        target=str(target.path),
        data=dataclasses.replace(config.data, eval_prompts=str(bad)),
    )

    def load_target(*args, **kwargs):
        raise RuntimeError("the target load")

    monkeypatch.setattr(adapter_trainer, "load_target", load_target)
    with pytest.raises(RuntimeError, match="the target load"):
        train_adapter(config, draft=draft)


def test_the_adapter_stage_reads_the_draft_in_the_export_dtype(target, draft, data_file, tmp_path):
    """With `export_dtype: float32` and a bfloat16 target, the draft stage's float32 export is
    read back in float32, and the adapter trained for it is exported in float32 too."""
    from jetspec_jax.checkpoint.bundle import read_manifest

    bf16_target = jetspec_jax.load_target(target.path, dtype="bfloat16")
    draft.save(tmp_path / "run" / "draft")  # the draft stage's export, float32
    config = _config(data_file, tmp_path / "run", eval_tau=False)
    config = dataclasses.replace(config, target_dtype="bfloat16", export_dtype="float32")
    result = train_adapter(config, target=bf16_target)
    assert result.adapter.dtype == "float32"
    assert read_manifest(result.export_dir)["dtype"] == "float32"


def test_a_run_starts_from_a_saved_adapter_of_its_architecture(target, draft, tmp_path):
    """`adapter.init_from`: the saved adapter's weights (from a JetSpec++ checkpoint or its
    `adapter/` directory), read in float32 for a bfloat16 draft too; another architecture or
    other taps are refused by field; a resumed run does not read it."""
    saved = init_adapter(draft, layers_per_module=(1, 2), intermediate_size=32, seed=5)
    bundle = draft.with_adapter(saved).save(tmp_path / "pp")
    bf16_draft = jetspec_jax.load_draft(bundle, target, dtype="bfloat16")
    for init_from, for_draft in ((bundle, draft), (bundle / "adapter", bf16_draft)):
        config = _config("unused.jsonl", tmp_path, init_from=str(init_from))
        start = initial_adapter(config, for_draft)
        assert start.config == saved.config
        leaves = zip(jax.tree.leaves(start.params), jax.tree.leaves(saved.params), strict=True)
        for got, want in leaves:
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got, want)

    config = _config("unused.jsonl", tmp_path, init_from=str(bundle), intermediate_size=16)
    with pytest.raises(ValueError, match="layers.intermediate_size 32 \\(configured 16\\)"):
        initial_adapter(config, draft)
    one_tap = jetspec_jax.init_draft(target, variant="jetspec++", target_layer_ids=(1,))
    config = _config("unused.jsonl", tmp_path, init_from=str(bundle), layers_per_module=(1,))
    with pytest.raises(CheckpointError, match="target_layer_ids \\[0, 1\\] != the draft's"):
        initial_adapter(config, one_tap)
    gone = _config("unused.jsonl", tmp_path, init_from=str(tmp_path / "gone"))
    assert initial_adapter(gone, draft, resuming=True).config == saved.config  # not read


def test_the_adapter_section_is_checked_against_the_draft_before_the_target_load(
    draft, data_file, tmp_path
):
    """As `train_adapter` says: `layers_per_module` without one entry per tap of the draft, and an
    `adapter.init_from` of another architecture, are refused before the target's weights (and
    here even its config: there is none) are read, not after minutes of loading."""
    saved = init_adapter(draft, layers_per_module=(1, 2), intermediate_size=32)
    bundle = draft.with_adapter(saved).save(tmp_path / "pp")
    cases = {
        (("layers_per_module", (1, 1, 1)),): r"one entry per tap layer of the draft \(2: ",
        (("layers_per_module", (1, 1)), ("init_from", str(bundle))): (
            r"layers_per_module \(1, 2\) \(configured \(1, 1\)\)"
        ),
    }
    for adapter, message in cases.items():
        config = _config(data_file, tmp_path / "run", eval_tau=False, **dict(adapter))
        with pytest.raises(ValueError, match=message):
            train_adapter(dataclasses.replace(config, target="no/such/target"), draft=draft)
    assert not (tmp_path / "run").exists()


def test_a_random_adapter_is_drawn_with_its_own_sections_seed(draft, tmp_path):
    """The adapter's `optim` section, when given, seeds its initialisation; else the top-level
    one does."""
    config = _config("unused.jsonl", tmp_path)
    own = dataclasses.replace(config.optim, seed=7)
    sections = {
        config.optim.seed: config,
        7: dataclasses.replace(config, adapter=dataclasses.replace(config.adapter, optim=own)),
    }
    for seed, section in sections.items():
        want = init_adapter(draft, layers_per_module=(1, 2), intermediate_size=32, seed=seed)
        got = initial_adapter(section, draft)
        for a, b in zip(jax.tree.leaves(got.params), jax.tree.leaves(want.params), strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_warm_started_run_trains_from_the_saved_adapter_and_resumes_without_it(
    target, draft, data_file, tmp_path, monkeypatch, caplog
):
    """The configured init (std 0.02) starts near the stale guess: gap closed ~0. A saved adapter
    of std 0.5 is far off it, so its step-1 metrics (those of the weights the step starts from)
    close a large negative gap, and so does the held-out evaluation of the start logged at step
    0, once even when the first attempt dies before its first checkpoint. The start is checked
    before the model load and a resume does not need it. A bfloat16 draft gets a bfloat16
    adapter in its export, the float32 start notwithstanding."""
    from jetspec_jax.checkpoint.bundle import read_manifest

    far = init_adapter(draft, layers_per_module=(1, 2), intermediate_size=32, init_std=0.5)
    bundle = draft.with_adapter(far).save(tmp_path / "far")
    draft.save(tmp_path / "a_draft")  # a config.json, but not an adapter's
    bf16_draft = jetspec_jax.load_draft(tmp_path / "a_draft", target, dtype="bfloat16")
    run = tmp_path / "run"
    config = _config(data_file, run, init_from=str(tmp_path / "gone"), eval_tau=False)
    no_target = dataclasses.replace(config, target="no/such/target")
    with pytest.raises(FileNotFoundError, match="gone/config.json does not exist"):
        train_adapter(no_target)
    no_target = _config(data_file, run, init_from=str(tmp_path / "a_draft"))
    with pytest.raises(CheckpointError, match="neither a JetSpec.. checkpoint nor an adapter"):
        train_adapter(dataclasses.replace(no_target, target="no/such/target"))
    assert not run.exists()

    config = _config(data_file, run, init_from=str(bundle), eval_tau=False)

    def dies(*args, **kwargs):
        raise RuntimeError("killed before the first checkpoint")

    with monkeypatch.context() as patch:
        patch.setattr(adapter_trainer, "run_steps", dies)
        with pytest.raises(RuntimeError, match="killed"):
            train_adapter(config, target=target, draft=bf16_draft)
    result = train_adapter(config, target=target, draft=bf16_draft)
    assert result.steps == 4 and result.adapter.dtype == "bfloat16"
    assert read_manifest(result.export_dir)["dtype"] == "bfloat16"
    lines = [json.loads(x) for x in (run / "adapter_run" / "metrics.jsonl").open()]
    # One step-0 row (the rerun did not log another); the end's evaluation after step 4's log.
    assert [x["step"] for x in lines] == [0, 1, 2, 3, 4, 4]
    assert lines[0]["eval_gap_closed"][0] < -1.0, lines[0]
    assert lines[1]["gap_closed"][0] < -1.0, lines[1]

    shutil.rmtree(bundle)
    with caplog.at_level("WARNING"):
        again = train_adapter(config, target=target, draft=bf16_draft)
        assert again.already_finished and again.steps == 4
        assert "resumes from its checkpoint: adapter.init_from is not read" in caplog.text
        dropped = dataclasses.replace(config.adapter, init_from=None)
        train_adapter(dataclasses.replace(config, adapter=dropped), target=target, draft=bf16_draft)
    assert "resuming with" not in caplog.text  # init_from is no setting of the run's steps


def test_eval_batches_pad_only_the_records_they_use(target, data_file, tmp_path, monkeypatch):
    calls = []

    def counting(record, max_length):
        calls.append(record)
        return to_example(record, max_length)

    monkeypatch.setattr(adapter_trainer, "to_example", counting)
    config = _config(data_file, tmp_path, eval_batches=1)
    records = read_regenerated([data_file])
    batches = _eval_batches(config, 2, _batch_sharding(config), target.config.vocab_size, records)
    assert len(batches) == 1 and len(calls) == 2  # of the file's 8 records
    # A seeded sample, not the file's first records (regenerated files put short prompts first).
    first = [r["prompt_ids"].tolist() for r in records[:2]]
    assert [r["prompt_ids"].tolist() for r in calls] != first


def test_fewer_eval_batches_than_configured_are_warned_about(target, data_file, tmp_path, caplog):
    config = _config(data_file, tmp_path, eval_batches=9)
    records = read_regenerated([data_file])
    with caplog.at_level("WARNING"):
        batches = _eval_batches(
            config, 2, _batch_sharding(config), target.config.vocab_size, records
        )
    assert len(batches) == 4  # the file's 8 records, 2 a batch
    assert "adapter.eval_batches 9: 8 records make only 4 batches of 2" in caplog.text


def _batch_sharding(config):
    return batch_sharding(make_mesh(config.mesh))


def test_held_out_records_that_repeat_training_prompts_are_warned_about(
    target, data_file, tmp_path, caplog
):
    records = read_regenerated([data_file])
    held_out = tmp_path / "held_out.jsonl"
    fresh = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6, 7]}
    repeated = [{k: v.tolist() for k, v in r.items()} for r in records[:3]]
    held_out.write_text("".join(json.dumps(r) + "\n" for r in [*repeated, fresh]))

    def warnings(eval_files, train_records):
        config = _config(data_file, tmp_path, eval_batches=1, eval_files=eval_files)
        sharding = _batch_sharding(config)
        caplog.clear()
        with caplog.at_level("WARNING"):
            _eval_batches(config, 2, sharding, target.config.vocab_size, train_records)
        return [r.getMessage() for r in caplog.records if r.name == adapter_trainer.__name__]

    assert warnings((str(held_out),), records) == [
        "3 of the 4 records of adapter.eval_files have a training prompt: the adapter's state "
        "metrics on them are not held out"
    ]
    assert warnings((str(held_out),), records[3:]) == []
    (empty,) = warnings((), records)
    assert "adapter.eval_files is empty" in empty


def _load_train_py():
    spec = importlib.util.spec_from_file_location("train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_trains_resumes_evaluates_tau_and_exports(target, workdir, monkeypatch, capsys):
    """`train.py adapter` on configs/tiny_cpu.yaml: stop after 2 steps, resume to the end, with
    the J1-R1 tau evaluation (predicted vs true states) and the export."""
    monkeypatch.chdir(workdir)
    cli = _load_train_py()
    args = ["adapter", "--config", "tiny_cpu.yaml"]
    assert cli.main([*args, "--stop-after", "2"]) == 0
    assert "stopped after 2 steps" in capsys.readouterr().out
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    assert "trained the adapter 4 steps" in out and "J1-R1 tau" in out, out
    evaluation = [json.loads(x) for x in open("runs/tiny/run/adapter_run/metrics.jsonl")][-1]
    draft = jetspec_jax.load_draft("runs/tiny/run/draft", target)
    adapter = load_adapter("runs/tiny/run/jetspec_pp/adapter", draft)
    assert adapter.config.layers_per_module == (1,)
    # The logged taus are J1-R1's with the target's true states and with the exported adapter's
    # predictions, on the config's 2 evaluation prompts of 16 new tokens (same shapes as the
    # CLI's run, so no new compiles).
    kwargs = dict(num_prompts=2, max_new_tokens=16, refine_passes=1, refreshes=1)
    prompts = "runs/tiny/data.jsonl"
    tau_true = evaluate_tau(target, TargetProxyDraft(draft), prompts, **kwargs)
    tau_predicted = evaluate_tau(target, draft.with_adapter(adapter), prompts, **kwargs)
    assert evaluation["tau_true"] == pytest.approx(tau_true)
    assert evaluation["tau_predicted"] == pytest.approx(tau_predicted)
    assert evaluation["tau_ratio"] == pytest.approx(tau_predicted / tau_true)
    # Rerunning the finished stage (the README's resumable pipeline) says so, and succeeds.
    assert cli.main(args) == 0
    assert "already trained the adapter 4 steps" in capsys.readouterr().out


def test_bad_adapter_configs_are_refused_with_clear_messages(tmp_path, capsys, draft):
    path = tmp_path / "c.yaml"
    cases = {
        "adapter: {kappa: 0}": "adapter.kappa",
        "adapter: {kapa: 0.5}": "unknown key.*adapter.kapa",
        "adapter: {layers_per_module: [1, 0]}": "adapter.layers_per_module",
        "adapter: {optim: {steps: 0}}": "adapter.optim.steps",
        "adapter: {init_from: ''}": "adapter.init_from",
        "draft: {init_from: ''}": "draft.init_from",
        "adapter: {optim: {anchors_per_sequence: 2000}}": (
            r"adapter.optim.anchors_per_sequence \(<= data.max_length 1024\)"
        ),
        "draft: {target_layer_ids: [0, 1]}\nadapter: {layers_per_module: [1]}": (
            "one entry per tap layer"
        ),
    }
    for text, message in cases.items():
        path.write_text("data: {files: [a.jsonl]}\n" + text + "\n")
        with pytest.raises(ValueError, match=message):
            load_train_config(path)
    # Taps known only from the loaded draft: refused before anything is trained.
    config = _config("unused.jsonl", tmp_path, layers_per_module=(1, 1, 1))
    with pytest.raises(ValueError, match=r"one entry per tap layer of the draft \(2: \[0, 1\]\)"):
        initial_adapter(config, draft)
    # The CLI: status 2 and an `error:` line, no traceback.
    path.write_text("data: {files: [a.jsonl]}\nadapter: {kappa: 1.5}\n")
    assert _load_train_py().main(["adapter", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "error: invalid value for adapter.kappa" in err and "Traceback" not in err
