"""Draft-training step memory against the loss's anchor chunk: XLA's buffer assignment, no run.

The jitted train step of a config's target and draft is compiled (not run) with the loss in one
piece (a chunk of all anchors: the baseline) and for each value of `optim.anchors_per_loss_chunk`
asked for; its temporary buffers (`memory_analysis().temp_size_in_bytes`:
everything but the arguments and outputs) and the compile time are reported. The anchor count
and batch can be raised beyond what the machine could run: only the compiler sees the shapes.

    python benchmarks/bench_loss_memory.py [--config configs/smollm2_135m.yaml] \\
        [--anchors 512] [--batch 4] [--chunks 64,32,16]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import int_list, machine_line, require_at_least, write_section  # noqa: E402
from jetspec_jax.training.config import load_train_config  # noqa: E402
from jetspec_jax.training.step import StepConfig, init_state, make_optimizer, train_step  # noqa: E402
from jetspec_jax.training.trainer import initial_draft  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2_135m.yaml"))
    parser.add_argument("--anchors", type=int, default=512, help="anchors per sequence")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step")
    parser.add_argument(
        "--chunks", default="64,32,16", help="comma-separated anchors_per_loss_chunk values"
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--anchors", "--batch")
    asked = int_list(parser, "--chunks", args.chunks)
    config = load_train_config(args.config)
    target = jetspec_jax.load_target(config.target, dtype=config.target_dtype)
    draft = initial_draft(config, target)
    state = init_state(draft.params, make_optimizer(config.optim))
    shape = (args.batch, config.data.max_length)
    batch = {
        "tokens": jax.ShapeDtypeStruct(shape, jnp.int32),
        "loss_mask": jax.ShapeDtypeStruct(shape, jnp.bool_),
    }
    vocab, block = target.config.vocab_size, draft.config.block_size
    rows = [
        "## Draft-training memory: the loss's anchor chunk (`benchmarks/bench_loss_memory.py`)",
        "",
        f"{machine_line()}. Config `{pathlib.Path(args.config).name}` (vocabulary {vocab}, "
        f"block {block}, max_length {config.data.max_length}); batch {args.batch}, "
        f"{args.anchors} anchors per "
        f"sequence; one `[B, A, K, V]` float32 array would be "
        f"{args.batch * args.anchors * block * vocab * 4 / 2**30:.2f} GiB.",
        "",
        "| anchors per loss chunk | step temporaries (GiB) | vs one piece | compile (s) |",
        "|---:|---:|---:|---:|",
    ]
    baseline = None
    chunks = [c for c in asked if c < args.anchors]
    for chunk in [args.anchors, *chunks]:
        optim = dataclasses.replace(
            config.optim, anchors_per_sequence=args.anchors, anchors_per_loss_chunk=chunk
        )
        step_config = StepConfig(target=target.config, draft=draft.config, optim=optim)
        start = time.perf_counter()
        compiled = train_step.lower(state, target.params, batch, config=step_config).compile()
        seconds = time.perf_counter() - start
        temp = compiled.memory_analysis().temp_size_in_bytes / 2**30
        baseline = temp if baseline is None else baseline
        rows.append(f"| {chunk} | {temp:.2f} | {temp / baseline:.2f}x | {seconds:.0f} |")
        print(rows[-1], flush=True)
    print("\n".join(rows))
    write_section("bench_loss_memory", "\n".join(rows))


if __name__ == "__main__":
    main()
