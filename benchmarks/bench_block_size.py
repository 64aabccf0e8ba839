"""Shorter drafted blocks (`block_size`): decode speed at batch 1 and batched, same tokens.

A causal draft's first drafts do not depend on the later ones, so it can draft blocks shorter
than it was trained on: fewer positions to verify per round, and tau capped at the block size.
On the first N prompts of an eval set, greedy, side by side in one run: AR, then JetSpec++ J0 at
each block size, with the shipped SmolLM2-135M-Instruct draft (trained block 16) by default:

  - batch 1: each prompt decoded by every setting in turn (AR first), so that load drifting on a
    shared machine falls on all alike; the median of per-prompt decode tokens/s;
  - batched: all N prompts in one decode loop per setting.

Decode time excludes compilation (`Timing.decode_seconds`). Every output is checked against
AR's; a mismatch fails the run (status 1) after the section is written.

    python benchmarks/bench_block_size.py [--num-prompts 8] [--max-new-tokens 64] \\
        [--block-sizes 16,8,4] [--draft DIR --target DIR]
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EVAL_DIR = ROOT.parent / "shared" / "data" / "eval"

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BENCHMARKS_MD,
    changed_flags,
    int_list,
    machine_line,
    publish,
)
from jetspec_jax.bench.datasets import load_dataset  # noqa: E402
from jetspec_jax.default_model import default_draft_dir  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="HF target (default: the embedded one)")
    parser.add_argument("--draft", default=None, help="a causal draft (default: the shipped one)")
    parser.add_argument("--prompts", type=pathlib.Path, default=EVAL_DIR / "gsm8k_test.jsonl")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--block-sizes", default="16,8,4", help="comma-separated, each >= 2")
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS_MD)
    parser.add_argument("--section", default="block_size")
    return parser


def _shown(path) -> str:
    """`path` relative to the repository when it lies inside it (the shipped draft), else as is."""
    resolved = pathlib.Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def _decode_rate(results) -> float:
    """Tokens per second of decode time over `results` (one batch: their timing is shared)."""
    tokens = sum(len(r.tokens) - 1 for r in results)  # the prefill's token is not decoded
    return tokens / results[0].timing.decode_seconds


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    # Each >= 2 now; the draft's trained block, the upper bound, is read after its load.
    sizes = int_list(parser, "--block-sizes", args.block_sizes, minimum=2)
    if args.num_prompts < 1 or args.max_new_tokens < 2:
        parser.error("need --num-prompts >= 1 and --max-new-tokens >= 2")
    # Before the model load: what needs no model.
    if not args.prompts.is_file():
        parser.error(f"--prompts {args.prompts}: no such file")
    draft_dir = args.draft or (default_draft_dir() if args.target is None else None)
    if draft_dir is None:
        parser.error("--target needs a --draft for it")
    target = jetspec_jax.load_target(args.target)
    draft = jetspec_jax.load_draft(draft_dir, target)
    for k in sizes:
        try:
            draft.config.with_block_size(k)
        except ValueError as e:
            parser.error(f"--block-sizes: {e}")
    prompts = load_dataset(args.prompts, target.tokenizer, limit=args.num_prompts).prompts
    settings = {"AR": dict(method="ar")} | {
        f"K={k}": dict(method=draft.config.variant, draft=draft, block_size=k) for k in sizes
    }

    def run(batch, options):
        return jetspec_jax.generate_batch(
            target, batch, max_new_tokens=args.max_new_tokens, stop_token_ids=None, **options
        )

    for options in settings.values():  # compile every shape first: the timed runs reuse them
        run(prompts[:1], options)
        run(prompts, options)
    single = {label: [] for label in settings}
    outputs = {label: [] for label in settings}
    taus = {label: [] for label in settings}
    for prompt in prompts:
        for label, options in settings.items():
            (result,) = run([prompt], options)
            single[label].append(_decode_rate([result]))
            outputs[label].append(result.tokens)
            taus[label].append(result.tau)
        print(f"prompt {len(outputs['AR'])}/{len(prompts)}", flush=True)
    # Batched rows are compared with AR's batch (another batch shape may round a near-tie apart).
    batched_outputs, batched, mismatches = {}, {}, []
    for label, options in settings.items():
        results = run(prompts, options)
        batched[label] = _decode_rate(results)
        batched_outputs[label] = [r.tokens for r in results]

    def agreeing(got, want) -> int:
        return sum(g == w for g, w in zip(got, want, strict=True))

    for label in settings:
        same_single = agreeing(outputs[label], outputs["AR"])
        same = agreeing(batched_outputs[label], batched_outputs["AR"])
        if min(same, same_single) < len(prompts):
            mismatches.append(f"{label} {same_single}/{len(prompts)}, batched {same}")

    ar_single, ar_batched = statistics.median(single["AR"]), batched["AR"]
    lines = [
        "## Shorter drafted blocks: decode speed at batch 1 and batched "
        "(`benchmarks/bench_block_size.py`)",
        "",
        f"Machine: {machine_line()}. Draft `{_shown(draft_dir)}` (trained block "
        f"{draft.config.block_size}), J0, greedy; the first {len(prompts)} prompts of "
        f"`{args.prompts.name}`, {args.max_new_tokens} new tokens; decode time without "
        "compilation; "
        + (
            "every output token-identical to AR's, at batch 1 and batched."
            if not mismatches
            else "outputs unlike AR's: " + ", ".join(mismatches) + "."
        ),
        "",
        f"Command: `python benchmarks/bench_block_size.py{changed_flags(args, parser)}`",
        "",
        f"| setting | tau | batch 1: tokens/s (median) | vs AR | batch {len(prompts)}: "
        "tokens/s | vs AR |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for label in settings:
        rate = statistics.median(single[label])
        lines.append(
            f"| {label} | {statistics.mean(taus[label]):.2f} | {rate:.1f} | "
            f"{rate / ar_single:.2f}x | {batched[label]:.1f} | {batched[label] / ar_batched:.2f}x |"
        )
    return publish(args.section, "\n".join(lines), args.out, mismatches)


if __name__ == "__main__":
    sys.exit(main())
