"""What `select_tokens` costs with top-k on, with and without the optimization barrier that keeps
`lax.top_k` a TopK (not a full vocabulary sort) in the compiled program.

Without the barrier XLA folded the cut-off's read of the last candidate into the sort `top_k`
decomposes into, the TopK rewrite no longer matched, and the "cheap" path sorted the whole
vocabulary. Each variant runs in its own process (the barrier is switched off by replacing
`jax.lax.optimization_barrier` with the identity there), alternating, at the vocabularies of
SmolLM2 (49152) and Qwen3 (151936), over a verification round's 16 positions, batch 1.

    python benchmarks/bench_top_k_sort.py [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.report import machine_line, require_at_least, write_section  # noqa: E402

VOCABS = (49152, 151936)
TOP_K = 20
POSITIONS = 16


def _measure(vocab: int, barrier: bool, repeats: int) -> dict:
    """Median ms per `select_tokens` call and the sorts in its compiled program (this process)."""
    import jax
    import jax.numpy as jnp

    if not barrier:
        jax.lax.optimization_barrier = lambda x: x
    from jetspec_jax.sampling import RowSampling, SamplingParams, select_tokens

    logits = 3.0 * jax.random.normal(jax.random.key(0), (1, POSITIONS, vocab), jnp.float32)
    sampling = RowSampling.from_params([SamplingParams(1.0, top_k=TOP_K)])
    positions = jnp.arange(POSITIONS)[None] + 100
    select = jax.jit(lambda x: select_tokens(x, sampling, positions))
    compiled = select.lower(logits).compile().as_text()
    jax.block_until_ready(select(logits))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(select(logits))
        times.append(time.perf_counter() - start)
    sorts = len(re.findall(r"= \S+ sort\(", compiled))
    return {"ms": 1e3 * statistics.median(times), "sorts": sorts}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed calls per variant")
    parser.add_argument("--child", nargs=2, metavar=("VOCAB", "BARRIER"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    require_at_least(parser, args, 1, "--repeats")
    if args.child:
        vocab, barrier = int(args.child[0]), args.child[1] == "1"
        print(json.dumps(_measure(vocab, barrier, args.repeats)))
        return 0
    rows = []
    for vocab in VOCABS:
        result = {}
        for barrier in (False, True):  # side by side: one after the other, same shapes
            child = [sys.executable, __file__, "--repeats", str(args.repeats)]
            out = subprocess.run(  # its stderr passes through: a failure shows its cause
                [*child, "--child", str(vocab), str(int(barrier))],
                check=True,
                stdout=subprocess.PIPE,
                text=True,
            ).stdout
            result[barrier] = json.loads(out.strip().splitlines()[-1])
        before, after = result[False], result[True]
        rows.append(
            f"| {vocab} | {before['sorts']} | {before['ms']:.1f} | {after['sorts']} | "
            f"{after['ms']:.1f} | {before['ms'] / after['ms']:.1f}x |"
        )
        print(rows[-1], flush=True)
    body = "\n".join(
        [
            "## Sampling: top-k without a vocabulary sort (`benchmarks/bench_top_k_sort.py`)",
            "",
            f"- Machine: {machine_line()}",
            f"- Command: `python benchmarks/bench_top_k_sort.py --repeats {args.repeats}`",
            f"- Setup: `select_tokens` at temperature 1, top-k {TOP_K}, over [1, {POSITIONS}, V] "
            "random logits (a verification round, batch 1); each variant in its own process; "
            f"median of {args.repeats} calls. The fallback's sort (rows whose kept set reaches "
            "past the 256 candidates) is in both programs; without the barrier `top_k` became a "
            "second one.",
            "",
            "| V | sorts without the barrier | ms | sorts with it | ms | ratio |",
            "|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )
    write_section("bench_top_k_sort", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
