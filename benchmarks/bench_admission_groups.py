"""Requests that join a running batch at once: prefilled one by one (`admit` each) or together
(`DecodeSession.admit_many`, groups of up to half the batch).

The default target (SmolLM2-135M-Instruct, float32), a batch of 8 rows whose first request is
done at its prefill; G requests (`--groups`) of `--prompt-tokens`-token prompts then join rows 0
to G-1, both ways, alternating, `--repeats` times after a first round that compiles; the time
is the admission's wall clock to the written state. Every joined request then decodes to its
budget, and its tokens must be equal both ways. AR and JetSpec++ (J0, the shipped draft).

    python benchmarks/bench_admission_groups.py
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
    int_list,
    machine_line,
    out_parser,
    require_at_least,
    write_section,
)
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402

BATCH, BUDGET = 8, 8


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--groups", default="2,4", help="requests joining at once")
    parser.add_argument("--prompt-tokens", default="50,200", help="their prompt lengths")
    parser.add_argument("--repeats", type=int, default=5)
    return parser


def admit(target, kwargs: dict, prompts: list[list[int]], together: bool):
    """`(seconds, tokens per joined request)`: the admission of `prompts` into a running batch,
    then their decoding to the end."""
    session = DecodeSession(
        target,
        [[1, 2, 3]],
        max_new_tokens=1,
        pad_batch_to=BATCH,
        stop_token_ids=[],
        reserve_prompt_tokens=max(map(len, prompts)),  # room for the joining prompts
        reserve_new_tokens=BUDGET,
        **kwargs,
    )
    session.start()
    session.poll()  # row 0 is done; the others are padding
    rows, budgets = list(range(len(prompts))), [BUDGET] * len(prompts)
    start = time.perf_counter()
    if together:
        session.admit_many(rows, prompts, max_new_tokens=budgets)
    else:
        for row, prompt in zip(rows, prompts, strict=True):
            session.admit(row, prompt, max_new_tokens=BUDGET)
    jax.block_until_ready(session._state)  # private: what the admissions wrote
    seconds = time.perf_counter() - start
    session.advance()
    session.poll()
    return seconds, [session.result(row).tokens for row in rows]


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    groups = int_list(parser, "--groups", args.groups, maximum=BATCH)  # rows 0 to G-1
    lengths = int_list(parser, "--prompt-tokens", args.prompt_tokens)
    require_at_least(parser, args, 1, "--repeats")
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    rng = np.random.default_rng(0)
    rows, all_equal = [], True
    for method in ("ar", "jetspec++"):
        kwargs = {} if method == "ar" else dict(draft=draft, options=DecodingOptions(method))
        for length in lengths:
            for group in groups:
                prompts = [rng.integers(0, 40000, length).tolist() for _ in range(group)]
                times, tokens = {False: [], True: []}, {}
                for repeat in range(args.repeats + 1):  # the first compiles
                    for together in (False, True):
                        seconds, tokens[together] = admit(target, kwargs, prompts, together)
                        if repeat:
                            times[together].append(seconds)
                    all_equal &= tokens[False] == tokens[True]
                one_by_one, together = (statistics.median(times[k]) for k in (False, True))
                rows.append((method, length, group, one_by_one, together))
                print(method, length, group, f"{one_by_one:.3f} {together:.3f}", flush=True)
    lines = [
        "## Requests joining at once: prefilled one by one or together "
        "(`benchmarks/bench_admission_groups.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_admission_groups.py{changed_flags(args, parser)}`",
        f"- Setup: default target (SmolLM2-135M-Instruct, float32), a batch of {BATCH} rows; G "
        "requests join it at once, one by one (`admit` each: G one-row prefills) or together "
        f"(`admit_many`: groups of up to {BATCH // 2}, each one prefill padded to a power of two "
        "of rows); wall clock to the written state, median of "
        f"{args.repeats} each, side by side, alternating (compilation excluded). JetSpec++ is J0 "
        "with the shipped draft.",
        f"- Every joined request's tokens ({BUDGET} each, greedy) equal both ways: "
        f"{'yes' if all_equal else 'NO'}.",
        "",
        "| method | prompt tokens | G | one by one ms | together ms | speedup |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, length, group, one_by_one, together in rows:
        lines.append(
            f"| {method} | {length} | {group} | {1e3 * one_by_one:.0f} | {1e3 * together:.0f} "
            f"| {one_by_one / together:.2f}x |"
        )
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("admission_groups", body, args.out)


if __name__ == "__main__":
    main()
