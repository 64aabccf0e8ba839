"""Host time at a chunk boundary of continuous batching: what the host spends between two device
loops, while a GPU would wait for it.

The default target (SmolLM2-135M-Instruct, float32), a batch of 8 rows decoded to their end, then
`--boundaries` boundaries as the server's scheduler makes them (`ContinuousBatch.poll`, `running`,
`take_finished`, `free_rows`, and `advance(chunk_steps)`). Every row is done, so each device loop
exits at its first check: the time is the host's (the compiled-program lookup, the loop's
arguments, the done flags' transfer) plus one dispatch. AR and JetSpec++ J0 (the shipped draft);
the median over `--repeats` runs of the boundaries.

    python benchmarks/bench_chunk_boundary.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    machine_line,
    out_parser,
    require_at_least,
    write_section,
)
from jetspec_jax.decoding.continuous import ContinuousBatch  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402

ROWS = 8
CHUNK_STEPS = 8


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--boundaries", type=int, default=200, help="boundaries per repeat")
    parser.add_argument("--repeats", type=int, default=9)
    return parser


def boundary_microseconds(
    target, draft, method: str, boundaries: int, repeats: int
) -> tuple[float, int]:
    """The median host time of one boundary over `repeats` runs, and the decode loop call's
    argument leaves."""
    rng = np.random.default_rng(0)
    kwargs = dict(draft=draft) if method != "ar" else {}
    prompts = [rng.integers(0, 1000, 20 + 5 * i).tolist() for i in range(ROWS)]
    session = DecodeSession(
        target,
        prompts,
        options=DecodingOptions(method),
        max_new_tokens=16,
        stop_token_ids=[],
        **kwargs,
    )
    batch = ContinuousBatch(session, list(range(ROWS)))
    batch.start()
    batch.advance(16)  # every row to its end
    batch.poll()
    assert len(batch.take_finished()) == ROWS

    def boundary():
        batch.poll()
        batch.running()
        batch.take_finished()
        _ = batch.free_rows
        batch.advance(CHUNK_STEPS)

    for _ in range(20):  # compiles the loop at this count, warms the caches
        boundary()
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(boundaries):
            boundary()
        runs.append((time.perf_counter() - start) / boundaries)
    # The decode loop's arguments (private: the session's): the weights, the carry, the
    # requests and the step count, every one a leaf of the compiled-program cache's key.
    arguments = (target.params, session._proposer_params, session._state, session._requests, 0)
    return 1e6 * statistics.median(runs), len(jax.tree_util.tree_leaves(arguments))


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--boundaries", "--repeats")
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    rows = []
    for method in ("ar", "jetspec++"):
        micros, leaves = boundary_microseconds(target, draft, method, args.boundaries, args.repeats)
        rows.append((method, leaves, micros))
        print(f"{method}: {micros:.0f} us per boundary ({leaves} argument leaves)", flush=True)
    lines = [
        "## Host time at a chunk boundary (`benchmarks/bench_chunk_boundary.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_chunk_boundary.py{changed_flags(args, parser)}`",
        f"- Setup: default target (SmolLM2-135M-Instruct, float32), {ROWS} rows decoded to their "
        f"end, then boundaries as the scheduler makes them (poll, running, take_finished, "
        f"free_rows, advance({CHUNK_STEPS})): the device loop exits at its first check, so the "
        f"time is the host's plus one dispatch. Median over {args.repeats} runs of "
        f"{args.boundaries} boundaries. JetSpec++ is J0 with the shipped draft.",
        "",
        "| method | the loop's argument leaves | µs per boundary |",
        "|---|---:|---:|",
    ]
    lines += [f"| {method} | {leaves} | {micros:.0f} |" for method, leaves, micros in rows]
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("chunk_boundary", body, args.out)


if __name__ == "__main__":
    main()
