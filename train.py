"""Train a draft for a target with jetspec_jax; for now, the data step.

    # The target's own responses to training prompts (resumable: rerun the same command).
    python train.py regenerate --prompts /work/shared/data/train/gsm8k_train.jsonl \\
        --out data/regen/smollm2.jsonl
    python train.py regenerate --prompts A.jsonl B.jsonl --out OUT.jsonl --target DIR \\
        --dtype bfloat16 --batch-size 16 --max-new-tokens 1024 --temperature 0.7 --seed 1

Prints a summary of what was written. The draft-training subcommands come with the draft model.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(name)s: %(message)s"
    )
    from jetspec_jax.checkpoint.errors import CheckpointError  # deferred: --help answers at once

    try:
        summary = _regenerate(args)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"regenerated {summary.written} responses into {args.out} in {summary.seconds:.1f} s "
        f"({summary.total} prompts: {summary.skipped_existing} already there, "
        f"{summary.skipped_too_long} too long for the context)"
    )
    return 0


def _regenerate(args: argparse.Namespace):
    """Validates the request, loads the target, and runs `regenerate`."""
    import jetspec_jax
    from jetspec_jax.data.regenerate import read_records, regenerate

    # Validate everything cheap (arguments, prompt files) before the slow model load.
    sampling = jetspec_jax.SamplingParams(temperature=args.temperature, seed=args.seed)
    for name in ("batch_size", "max_new_tokens"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag} must be >= 1, got {getattr(args, name)}")
    if args.limit is not None and args.limit < 0:
        raise ValueError(f"--limit must be >= 0, got {args.limit}")
    if args.system is not None and not args.chat:
        raise ValueError("--system needs the chat template; drop --no-chat")
    if pathlib.Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a directory; give a file path")
    read_records(args.prompts)
    target = jetspec_jax.load_target(args.target, dtype=args.dtype)
    return regenerate(
        target,
        args.prompts,
        args.out,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        chat=args.chat,
        system=args.system,
        thinking=args.thinking,
        limit=args.limit,
        sampling=sampling,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    regen = commands.add_parser(
        "regenerate", help="write the target's responses to prompt files (resumable JSONL)"
    )
    regen.add_argument(
        "--prompts", nargs="+", required=True, metavar="FILE", help="JSONL prompt files"
    )
    regen.add_argument(
        "--out", required=True, metavar="FILE", help="output JSONL (resumed if it exists)"
    )
    regen.add_argument(
        "--target",
        default=None,
        help="HF checkpoint directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    regen.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    regen.add_argument("--batch-size", type=int, default=8)
    regen.add_argument("--max-new-tokens", type=int, default=512)
    regen.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    regen.add_argument(
        "--no-chat", dest="chat", action="store_false", help="raw prompts, no chat template"
    )
    regen.add_argument("--system", default=None, help="system message (chat only)")
    regen.add_argument(
        "--thinking", action="store_true", help="the chat template's enable_thinking (Qwen3)"
    )
    regen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    regen.add_argument("--seed", type=int, default=0, help="base of the per-prompt sampling seeds")
    regen.add_argument(
        "-v", "--verbose", action="store_true", help="log loading, compilation and counts"
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
