"""Offline generation of many prompts: batches run to their end vs continuous batching.

The default target (SmolLM2-135M-Instruct, float32), greedy, `--prompts` chat-templated GSM8K
train prompts (the regeneration step's data) with `--max-new-tokens` each, `--batch` rows:

    static        prompts sorted by length, `generate_batch` on each batch of `--batch` in turn
                  (how `train.py regenerate` ran before): a batch runs until its longest
                  response ends, its finished rows idle
    continuous    `generate_as_completed(max_batch_size=--batch)`: a finished row takes the next
                  prompt at the next chunk boundary

Each mode runs twice, alternating; the second run (every shape compiled) is timed. Every
prompt's tokens must be the same in both modes.

    python benchmarks/bench_generate_as_completed.py
"""

from __future__ import annotations

import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    machine_line,
    out_parser,
    publish,
    require_at_least,
)
from jetspec_jax.data.prompts import read_prompts  # noqa: E402
from jetspec_jax.prompting import encode_prompt  # noqa: E402

TRAIN = ROOT.parent / "shared" / "data" / "train" / "gsm8k_train.jsonl"


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=512, help="regenerate's default")
    parser.add_argument("--batch", type=int, default=8)
    return parser


def static(target, prompts, budget: int, batch: int) -> dict[int, list[int]]:
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    tokens = {}
    for begin in range(0, len(order), batch):
        rows = order[begin : begin + batch]
        results = jetspec_jax.generate_batch(
            target, [prompts[i] for i in rows], max_new_tokens=budget
        )
        tokens.update((i, r.tokens) for i, r in zip(rows, results, strict=True))
    return tokens


def continuous(target, prompts, budget: int, batch: int) -> dict[int, list[int]]:
    results = jetspec_jax.generate_as_completed(
        target, prompts, max_new_tokens=budget, max_batch_size=batch
    )
    return {i: r.tokens for i, r in results}


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--prompts", "--max-new-tokens", "--batch")
    target = jetspec_jax.load_target()
    records = read_prompts(TRAIN, limit=args.prompts)
    prompts = [encode_prompt(target.tokenizer, r["prompt"], chat=True) for r in records]
    modes = {"static": static, "continuous": continuous}
    seconds, tokens = {}, {}
    for run in range(2):  # the first run of each mode compiles its shapes
        for name, mode in modes.items():
            start = time.perf_counter()
            tokens[name] = mode(target, prompts, args.max_new_tokens, args.batch)
            seconds[name] = time.perf_counter() - start
            print(f"{name} run {run}: {seconds[name]:.1f} s", flush=True)
    mismatches = [
        f"prompt {i}" for i in range(len(prompts)) if tokens["static"][i] != tokens["continuous"][i]
    ]
    generated = sum(map(len, tokens["static"].values()))
    lines = [
        "## Offline generation: static batches vs continuous batching "
        "(`benchmarks/bench_generate_as_completed.py`)",
        "",
        f"- Machine: {machine_line()}",
        "- Command: `python benchmarks/bench_generate_as_completed.py"
        f"{changed_flags(args, parser)}`",
        f"- Setup: default target (SmolLM2-135M-Instruct, float32), greedy AR; the first "
        f"{len(prompts)} GSM8K train prompts, chat-templated, max_new_tokens "
        f"{args.max_new_tokens} ({generated} tokens generated, each response to its budget or "
        f"its end-of-turn token), {args.batch} rows. *static*: prompts sorted by length, "
        "`generate_batch` per batch (the regeneration step before); *continuous*: "
        "`generate_as_completed`. Each mode run twice, alternating; the second runs timed. "
        "Every prompt's tokens equal in both modes: "
        + ("yes" if not mismatches else f"**no** ({len(mismatches)} differ)")
        + ".",
        "",
        "| mode | seconds | tokens/s |",
        "|---|---:|---:|",
    ]
    for name in modes:
        lines.append(f"| {name} | {seconds[name]:.1f} | {generated / seconds[name]:.1f} |")
    lines += [
        "",
        f"Continuous over static: {seconds['static'] / seconds['continuous']:.2f}x the throughput.",
    ]
    return publish("generate_as_completed", "\n".join(lines) + "\n", args.out, mismatches)


if __name__ == "__main__":
    sys.exit(main())
