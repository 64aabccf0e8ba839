"""Prompt-length buckets: a prompt's prefill at its length bucket (`buckets.length_bucket`:
powers of two and three quarters of them) against the power-of-two bucket it had before.

The default target (SmolLM2-135M-Instruct, float32), one prompt per session; for each length n,
the session of an n-token prompt (shape `length_bucket(n)`) and that of a `bucket(n)`-token
prompt, whose shapes (prompt width, cache capacity) are exactly the ones an n-token prompt had
under power-of-two buckets: XLA's work depends on the shapes, not on how many positions are
real. Both run side by side, alternating, `--repeats` times each after a first run that
compiles; AR and JetSpec++ (J0, the shipped draft, whose prefill also runs the draft's).

    python benchmarks/bench_length_buckets.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

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
from jetspec_jax.decoding.buckets import (  # noqa: E402
    bucket,
    buckets_up_to,
    length_bucket,
    length_buckets_up_to,
)
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--lengths", default="40,90,180,300,700", help="prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def prefill(target, prompt: list[int], kwargs: dict) -> tuple[float, float]:
    """`(prefill seconds, compile seconds)` of one session of `prompt` (one new token)."""
    session = DecodeSession(target, [prompt], max_new_tokens=1, stop_token_ids=[], **kwargs)
    session.start()
    return session.timing.prefill_seconds, session.timing.compile_seconds


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    lengths = int_list(parser, "--lengths", args.lengths)
    require_at_least(parser, args, 1, "--repeats")
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    rng = np.random.default_rng(0)
    rows = []
    for method in ("ar", "jetspec++"):
        kwargs = {} if method == "ar" else dict(draft=draft, options=DecodingOptions(method))
        for n in lengths:
            new_width, old_width = length_bucket(n), bucket(n)
            prompts = {w: rng.integers(0, 40000, w).tolist() for w in (n, old_width)}
            compiles = {w: prefill(target, p, kwargs)[1] for w, p in prompts.items()}
            times: dict[int, list[float]] = {n: [], old_width: []}
            for _ in range(args.repeats):
                for w, p in prompts.items():
                    times[w].append(prefill(target, p, kwargs)[0])
            new, old = statistics.median(times[n]), statistics.median(times[old_width])
            rows.append((method, n, old_width, new_width, old, new, compiles[n]))
            print(method, n, old_width, new_width, f"{old:.3f} {new:.3f} {old / new:.2f}x")
    lines = [
        "## Prompt-length buckets: prefill at 3/4-power buckets "
        "(`benchmarks/bench_length_buckets.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_length_buckets.py{changed_flags(args, parser)}`",
        "- Setup: default target (SmolLM2-135M-Instruct, float32), one prompt, prefill only "
        "(the first token); JetSpec++ is J0 with the shipped draft (its prefill also runs the "
        "draft's). Before: the session of a prompt as long as the power-of-two bucket, whose "
        "shapes (prompt width, cache capacity) are those an n-token prompt had under "
        "power-of-two buckets. Median of "
        f"{args.repeats} runs each, side by side, alternating; compilation excluded and shown "
        "apart (the new bucket's program, compiled once per process or loaded from the "
        "persistent cache).",
        "",
        "| method | prompt tokens | bucket before | now | prefill before ms | now ms | "
        "speedup | compile s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for method, n, old_width, new_width, old, new, compile_s in rows:
        lines.append(
            f"| {method} | {n} | {old_width} | {new_width} | {1e3 * old:.0f} | {1e3 * new:.0f} "
            f"| {old / new:.2f}x | {compile_s:.1f} |"
        )
    longest = max(lengths)
    compile_median = statistics.median(row[-1] for row in rows)
    lines += [
        "",
        f"The price: prompts of up to {longest} tokens fall into "
        f"{len(length_buckets_up_to(longest))} prompt buckets instead of "
        f"{len(buckets_up_to(longest))}, each a prefill program compiled on its first use (a "
        f"server's `--warmup` compiles them all, per batch shape: {compile_median:.1f} s each "
        "here, median).",
    ]
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("length_buckets", body, args.out)


if __name__ == "__main__":
    main()
