"""The MPMD pipeline's chunked prefill: what each device's program holds, by prompt length.

The default target (SmolLM2-135M-Instruct, float32), JetSpec++ J1-R1 F4 with the shipped draft,
one prompt, `--chunk` positions per chunk. `TwoProgramPipeline.prefill` runs the target over a
chunk on device 0 (`target_prefill_chunk`), sends the chunk's tap states to device 1, and extends
the proposer there (`extend_proposer`) while device 0 runs the next chunk. For each length, the two
programs are compiled at a session's shapes (width and cache capacity as `DecodeSession` sizes
them) and their temporary buffers read (XLA's `memory_analysis`: activations and scratch; the
weights, caches and proposer state are arguments, held either way). Also the tap states one chunk
sends against the whole prompt's, which each device held before the prefill went by chunks.
Compile only: nothing runs, so one CPU device serves (the placement does not change a program's
buffers).

    python benchmarks/bench_mpmd_prefill.py
"""

from __future__ import annotations

import functools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    int_list,
    machine_line,
    out_parser,
    require_at_least,
    write_section,
)
from jetspec_jax.decoding.buckets import length_bucket, uses_chunks  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.pipeline_mpmd import (  # noqa: E402
    draft_stage_target_params,
    empty_proposer,
    extend_proposer,
    start_target_prefill,
    target_prefill_chunk,
)
from jetspec_jax.decoding.prompt_chunks import even_chunk  # noqa: E402
from jetspec_jax.decoding.session import resolve_proposer  # noqa: E402

# The foresight proposer `pipeline="mpmd"` splits (built without the pipeline, which would ask for
# two devices: only compiled here).
OPTIONS = DecodingOptions("jetspec++", refine_passes=1, refreshes=1, foresight=4)
MAX_OUTPUT = 16  # a budget of 1, bucketed


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="700,1500,3000,6000", help="prompt lengths")
    parser.add_argument("--chunk", type=int, default=512, help="the prefill chunk")
    return parser


def program_bytes(target, proposer, params, length: int, chunk: int) -> dict[str, float]:
    """MiB: each device's chunk program's temporaries, one chunk's and the whole prompt's taps."""
    width = length_bucket(length)
    capacity = width + MAX_OUTPUT + proposer.block_size
    chunk = even_chunk(width, chunk if uses_chunks(width, chunk) else width)
    padded = jax.ShapeDtypeStruct((1, -(-width // chunk) * chunk), jnp.int32)
    lengths = jax.ShapeDtypeStruct((1,), jnp.int32)
    index = np.int32(0)
    config = target.config
    cache, last = jax.eval_shape(
        functools.partial(start_target_prefill, config=config, capacity=capacity, chunk=chunk),
        target.params,
        padded,
    )
    sizes = dict(config=config, chunk=chunk, tap_layers=proposer.tap_layers)
    target_chunk = target_prefill_chunk.lower(
        target.params, padded, lengths, cache, last, index, **sizes
    )
    taps = target_chunk.out_info[2]  # [n_taps, 1, chunk, H]
    draft_target = draft_stage_target_params(target.params, proposer.first_target_layer)
    state = jax.eval_shape(
        functools.partial(empty_proposer, proposer=proposer, batch=1, capacity=capacity),
        params,
        draft_target,
    )
    draft_chunk = extend_proposer.lower(
        params, draft_target, state, padded, lengths, taps, index, proposer=proposer, chunk=chunk
    )
    mib = 1 / 2**20
    taps_bytes = np.prod(taps.shape) * taps.dtype.itemsize
    return {
        "chunk": chunk,
        "device 0": target_chunk.compile().memory_analysis().temp_size_in_bytes * mib,
        "device 1": draft_chunk.compile().memory_analysis().temp_size_in_bytes * mib,
        "taps per chunk": taps_bytes * mib,
        "whole prompt": taps_bytes * length / chunk * mib,
    }


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    lengths = int_list(parser, "--lengths", args.lengths)
    require_at_least(parser, args, 1, "--chunk")
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    proposer, params = resolve_proposer(target, draft, OPTIONS)
    rows = []
    for n in lengths:
        figures = program_bytes(target, proposer, params, n, args.chunk)
        rows.append((n, figures))
        print(n, figures)
    lines = [
        "## The MPMD pipeline's chunked prefill, per device (`benchmarks/bench_mpmd_prefill.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_mpmd_prefill.py{changed_flags(args, parser)}`",
        "- Setup: default target (SmolLM2-135M-Instruct, float32), JetSpec++ J1-R1 F4 "
        f'`pipeline="mpmd"` with the shipped draft, one prompt, `prefill_chunk={args.chunk}`. '
        "Each device's chunk program compiled at a session's shapes; temporary memory: "
        "`memory_analysis().temp_size_in_bytes` (the weights, caches and proposer state are "
        "arguments, held either way). Compile only: no timing (on this CPU the two devices "
        "would be virtual ones sharing its cores).",
        "",
        "| prompt tokens | chunk | device 0 temp MiB (target chunk) | device 1 temp MiB (extend) "
        "| taps sent per chunk MiB | whole prompt's taps MiB |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for n, f in rows:
        lines.append(
            f"| {n} | {f['chunk']} | {f['device 0']:.0f} | {f['device 1']:.0f} | "
            f"{f['taps per chunk']:.1f} | {f['whole prompt']:.1f} |"
        )
    lines += [
        "",
        "Both devices' programs see one chunk at a time, so their temporaries do not grow with "
        "the prompt. Before the MPMD prefill went by chunks, device 0's prefill returned the "
        "whole prompt's tap states (last column) and device 1 received them, each holding that "
        "buffer on top; now each transfer carries one chunk's.",
    ]
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("mpmd_prefill", body, args.out)


if __name__ == "__main__":
    main()
