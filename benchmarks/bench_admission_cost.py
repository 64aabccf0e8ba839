"""What one admission into a running batch costs (continuous batching): `DecodeSession.admit`
whole, and its `write_rows` part (the one-row state written into the batch's carry).

The default target (SmolLM2-135M-Instruct, float32), a batch of 4 rows, a 60-token first prompt,
and `--admissions` requests of a 50-token prompt admitted one after another into row 0, with 16
target forwards between them; AR and JetSpec++ J0 (the shipped draft). The first two admissions
compile (the one-row prefill, then `write_rows`'s per-leaf programs); the median of the others is
reported.

    python benchmarks/bench_admission_cost.py
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
import jetspec_jax.decoding.session as session_module  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    machine_line,
    out_parser,
    require_at_least,
    write_section,
)
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402

WARM = 2  # admissions that compile


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--admissions", type=int, default=8)
    return parser


def admission_costs(target, draft, method: str, admissions: int) -> tuple[list, list, int]:
    """Seconds per admission and per `write_rows` of the state, and the carry's leaf count."""
    rng = np.random.default_rng(0)
    options = DecodingOptions(method)
    kwargs = dict(draft=draft, options=options) if method != "ar" else {}
    session = DecodeSession(
        target,
        [rng.integers(0, 1000, 60).tolist()] * 2,
        max_new_tokens=[1, 512],
        pad_batch_to=4,
        stop_token_ids=[],
        **kwargs,
    )
    session.start()
    session.poll()
    writes, totals = [], []
    write_rows = session_module.write_rows

    def timed(full, part, rows, batch_size):
        start = time.perf_counter()
        out = jax.block_until_ready(write_rows(full, part, rows, batch_size))
        writes.append(time.perf_counter() - start)
        return out

    session_module.write_rows = timed  # the session's own name for it
    try:
        for _ in range(admissions):
            start = time.perf_counter()
            session.admit(0, rng.integers(0, 1000, 50).tolist(), max_new_tokens=8)
            jax.block_until_ready(session._state)  # private: what admit wrote
            totals.append(time.perf_counter() - start)
            session.advance(16)
            session.poll()
    finally:
        session_module.write_rows = write_rows
    leaves = len(jax.tree_util.tree_leaves(session._state))
    return totals, writes[0::2], leaves  # each admission writes the state, then the requests


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, WARM + 1, "--admissions")  # a median past the compiling ones
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    rows = []
    for method in ("ar", "jetspec++"):
        totals, writes, leaves = admission_costs(target, draft, method, args.admissions)
        rows.append(
            (method, leaves, statistics.median(totals[WARM:]), statistics.median(writes[WARM:]))
        )
        print(method, [round(1e3 * t) for t in totals], flush=True)
    lines = [
        "## The cost of one admission (`benchmarks/bench_admission_cost.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_admission_cost.py{changed_flags(args, parser)}`",
        "- Setup: default target (SmolLM2-135M-Instruct, float32), a batch of 4 rows; 50-token "
        f"prompts admitted into row 0 one after another, 16 forwards apart; median of the last "
        f"{args.admissions - WARM} of {args.admissions} admissions (the first {WARM} compile). "
        "JetSpec++ is J0 with the shipped draft.",
        "",
        "| method | carry leaves | admit ms | of which write_rows ms |",
        "|---|---:|---:|---:|",
    ]
    for method, leaves, total, write in rows:
        lines.append(f"| {method} | {leaves} | {1e3 * total:.1f} | {1e3 * write:.1f} |")
    lines += [
        "",
        "The rest of an admission is the request's one-row prefill.",
    ]
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("admission_cost", body, args.out)


if __name__ == "__main__":
    main()
