"""Draft-training throughput: tokens/s of the jitted train step for a config's target and draft.

Synthetic sequences (speed does not depend on their content) of the config's `max_length`, the
config's batch, anchors, draft and dtypes; compile excluded; median over steps.

    python benchmarks/bench_training.py [--config configs/smollm2_135m.yaml] [--steps 10]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import changed_flags, machine_line, require_at_least, write_section  # noqa: E402
from jetspec_jax.training.config import load_train_config  # noqa: E402
from jetspec_jax.training.sharding import batch_sharding, make_mesh, param_shardings  # noqa: E402
from jetspec_jax.training.step import StepConfig, init_state, make_optimizer, train_step  # noqa: E402
from jetspec_jax.training.trainer import initial_draft  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.yaml"))
    parser.add_argument("--steps", type=int, default=10)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--steps")
    config = load_train_config(args.config)
    target = jetspec_jax.load_target(config.target, dtype=config.target_dtype)
    draft = initial_draft(config, target)
    mesh = make_mesh(config.mesh)
    state = init_state(draft.params, make_optimizer(config.optim))
    state = jax.device_put(state, param_shardings(state, mesh))
    target_params = jax.device_put(target.params, param_shardings(target.params, mesh))
    step_config = StepConfig(target=target.config, draft=draft.config, optim=config.optim)
    rng = np.random.default_rng(0)
    shape = (config.optim.batch_size, config.data.max_length)
    prompt = config.data.max_length // 4
    batch = {
        "tokens": rng.integers(0, target.config.vocab_size, shape).astype(np.int32),
        "loss_mask": np.broadcast_to(np.arange(shape[1]) >= prompt, shape).copy(),
    }
    batch = jax.device_put(batch, batch_sharding(mesh))

    start = time.perf_counter()
    state, metrics = train_step(state, target_params, batch, config=step_config, mesh=mesh)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        state, metrics = train_step(state, target_params, batch, config=step_config, mesh=mesh)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
    step_s = statistics.median(times)
    tokens = shape[0] * shape[1]
    supervised_rows = float(metrics["supervised"])
    name = pathlib.Path(args.config).name
    body = "\n".join(
        [
            f"## Draft training throughput ({name})",
            "",
            f"- Machine: {machine_line()}; {len(jax.devices())} device(s), mesh {dict(mesh.shape)}",
            f"- Command: `python benchmarks/bench_training.py{changed_flags(args, _parser())}`",
            f"- Setup: batch {shape[0]} x {shape[1]} tokens, {config.optim.anchors_per_sequence} "
            f"anchors/sequence, block {config.draft.block_size}, {config.draft.num_layers} draft "
            f"layer(s), target {config.target_dtype}, draft compute {config.optim.compute_dtype}; "
            f"first step (compile) {compile_s:.1f} s; median of {args.steps} steps.",
            "",
            "| step time (s) | sequence tokens/s | supervised block rows/s |",
            "|---:|---:|---:|",
            f"| {step_s:.3f} | {tokens / step_s:.0f} | {supervised_rows / step_s:.0f} |",
        ]
    )
    print(body)
    write_section(f"bench_training_{name}", body)


if __name__ == "__main__":
    main()
