"""`python -m jetspec_jax.bench`: methods side by side on prompt files (see the package doc)."""

from __future__ import annotations

import argparse
import logging
import pathlib
import sys


def main(argv: list[str] | None = None) -> int:
    """`python -m jetspec_jax.bench`: parses the flags, runs the harness; the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.random_draft_block is not None and args.random_draft is None:
        parser.error("--random-draft-block sizes the --random-draft, which is not given")
    for name in ("limit", "max_new_tokens", "random_draft_block"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    import jetspec_jax  # deferred so that --help answers at once
    from jetspec_jax.bench.datasets import load_dataset
    from jetspec_jax.bench.methods import parse_methods
    from jetspec_jax.bench.report import (
        PARTIAL_SAMPLES,
        check_out_dir,
        log_sample,
        markdown_table,
        write_report,
    )
    from jetspec_jax.bench.runner import run_benchmark
    from jetspec_jax.compile_cache import enable_compile_cache
    from jetspec_jax.console import (
        configure_logging,
        escape_what_stdout_cannot_encode,
        log_lines_clear_of_bars,
        reader_may_leave,
    )
    from jetspec_jax.flag_paths import require_paths
    from jetspec_jax.interrupts import raise_interrupts_outside_gc_callbacks
    from jetspec_jax.prompting import has_chat_template, require_chat_template
    from jetspec_jax.target import require_tokenizer

    configure_logging(logging.INFO if args.verbose else logging.WARNING)
    escape_what_stdout_cannot_encode()  # not a UnicodeEncodeError mid-output
    enable_compile_cache()
    raise_interrupts_outside_gc_callbacks()  # else a Ctrl-C in JAX's gc callback is lost

    out = pathlib.Path(args.out)
    replaced = False  # whether this run has replaced an interrupted run's samples with its own
    try:
        with log_lines_clear_of_bars():  # `-v`'s lines, logged while the bar is drawn
            check_out_dir(out)  # not after hours of runs
            methods = parse_methods(args.methods)
            variants = {m.method for m in methods}
            temperatures = _temperatures(args.temperatures)
            require_paths("--target", [args.target], directory=True)  # nor after the model load
            require_paths("--draft", args.draft or [], directory=True)
            require_paths("--prompts", args.prompts)
            _check_prompt_files(args.prompts, args.limit)  # their contents too
            _check_drafts_given(args, methods)
            require_tokenizer(args.target, f"--target {args.target}", "the prompt files are text")
            target = jetspec_jax.load_target(args.target, dtype=args.dtype)
            drafts = _drafts(args, target, variants)
            if args.chat:
                require_chat_template(target.tokenizer, target.path, "drop --chat (raw prompts)")
            chat = args.chat if args.chat is not None else has_chat_template(target.tokenizer)
            datasets = [
                load_dataset(p, target.tokenizer, limit=args.limit, chat=chat) for p in args.prompts
            ]

            def keep(sample) -> None:
                # An interrupted run's samples are replaced once this run measures, not before: a
                # run that `run_benchmark`'s checks refuse keeps them.
                nonlocal replaced
                if not replaced:
                    (out / PARTIAL_SAMPLES).unlink(missing_ok=True)
                    replaced = True
                log_sample(out, sample)

            samples, summaries = run_benchmark(
                target,
                datasets,
                methods,
                drafts,
                temperatures=temperatures,
                max_new_tokens=args.max_new_tokens,
                warmup=args.warmup,
                on_sample=keep,
            )
    except (ValueError, ImportError, OSError) as e:  # OSError: paths, permissions
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        finished = f"the runs that finished are in {out / PARTIAL_SAMPLES}"
        print(f"interrupted: {finished if replaced else 'no run had finished'}", file=sys.stderr)
        return 130
    with reader_may_leave():  # first: a failing write must not cost the figures
        print(markdown_table(summaries), end="", flush=True)
    try:
        paths = write_report(out, samples, summaries)
    except OSError as e:
        print(f"error: the report could not be written to {args.out}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # while plotting, say: the partial log goes only once all is written
        print(
            f"interrupted: the runs that finished are in {out / PARTIAL_SAMPLES}", file=sys.stderr
        )
        return 130
    print(f"wrote {', '.join(str(p) for p in paths.values())}", file=sys.stderr)
    return _report_mismatches(summaries, args.dtype)


def _report_mismatches(summaries, dtype: str) -> int:
    """Names the rows whose outputs differ from AR's; the exit status. In float32 such an output
    is a bug: the run fails (its report kept for the diff). In bfloat16 a block forward and a
    one-token step may round a near-tie apart: a warning."""
    mismatches = [s for s in summaries if s.matches_ar not in (None, s.prompts)]
    level = "error" if dtype == "float32" else "warning"
    for s in mismatches:
        print(
            f"{level}: {s.method} on {s.dataset} at T={s.temperature:g}: the output differs from "
            f"AR's (same seed) on {s.prompts - s.matches_ar} of {s.prompts} prompts",
            file=sys.stderr,
        )
    return 1 if mismatches and level == "error" else 0


def _drafts(args: argparse.Namespace, target, variants: set[str]) -> dict:
    """variant -> draft: the `--draft` checkpoints and the `--random-draft`, or the shipped draft
    when neither is given and a jetspec++ method runs on the default target.

    Raises:
        ValueError: two drafts of one variant, or a draft no method in `variants` uses.
    """
    import jetspec_jax
    from jetspec_jax.default_model import default_draft_dir

    drafts, sources = {}, {}  # variant -> draft, and where it came from (for errors)
    shipped = _shipped_draft_serves(args) and "jetspec++" in variants
    for path in [default_draft_dir()] if shipped else args.draft:
        draft = jetspec_jax.load_draft(path, target)
        _add_draft(drafts, sources, draft.config.variant, draft, f"--draft {path}")
    if args.random_draft:
        draft = jetspec_jax.init_draft(
            target, variant=args.random_draft, block_size=args.random_draft_block or 16
        )
        source = f"--random-draft {args.random_draft}"
        _add_draft(drafts, sources, args.random_draft, draft, source)
    unused = [source for variant, source in sources.items() if variant not in variants]
    if unused:
        raise ValueError(
            f"no method of --methods {args.methods!r} uses {' or '.join(unused)} (a draft "
            "serves the methods of its variant)"
        )
    return drafts


def _add_draft(drafts: dict, sources: dict, variant: str, draft, source: str) -> None:
    """Each draft serves its own variant, so two of one variant would leave one unused."""
    if variant in drafts:
        raise ValueError(
            f"{sources[variant]} and {source} are both {variant!r} drafts; a variant is served by "
            "one draft per run (benchmark the other in a second run)"
        )
    drafts[variant] = draft
    sources[variant] = source


def _check_prompt_files(paths: list[str], limit: int | None) -> None:
    """Refuses, before the model load, a prompt file that `load_dataset` would refuse after it
    (malformed, empty, repeated ids), and two files of one dataset (named by their records'
    `source`), whose rows would merge. The files are read again once the tokenizer is loaded."""
    from jetspec_jax.bench.datasets import read_dataset

    files = {}  # dataset name -> the file that gave it
    for path in paths:
        try:
            name = read_dataset(path, limit=limit)[0]
        except ValueError as e:
            raise ValueError(f"--prompts {e}") from None
        if name in files:
            raise ValueError(
                f"--prompts {files[name]} and {path} are both dataset {name!r} (named by their "
                "records' source): their rows would merge; benchmark them in two runs"
            )
        files[name] = path


def _shipped_draft_serves(args: argparse.Namespace) -> bool:
    """Whether the shipped draft serves the run's jetspec++ methods: the default target, and no
    `--draft` or `--random-draft`."""
    return args.target is None and not args.draft and not args.random_draft


def _check_drafts_given(args: argparse.Namespace, methods) -> None:
    """Without `--draft`, which variants the run's drafts serve is known before any load (the
    `--random-draft`'s, or the shipped draft's: `_drafts`): a speculative method of another
    variant is refused now, not after the model load."""
    if args.draft:
        return  # their variants are read from the checkpoints
    if args.random_draft:
        served = {args.random_draft}
    else:
        served = {"jetspec++"} if _shipped_draft_serves(args) else set()
    unserved = [m.name for m in methods if m.speculative and m.method not in served]
    if unserved:
        raise ValueError(
            f"--methods {args.methods!r}: no draft serves {', '.join(unserved)}; pass a --draft "
            "of its variant (or --random-draft VARIANT)"
        )


def _temperatures(text: str) -> list[float]:
    """The comma-separated temperatures, each checked as a request would check it, so that a bad
    one fails now rather than after the runs before it (nor after the model load: a repeated
    one, whose rows would merge)."""
    from jetspec_jax.sampling import SamplingParams

    try:
        temperatures = [float(t) for t in text.split(",") if t.strip()]
        if not temperatures:
            raise ValueError("no value")
        repeated = sorted({t for t in temperatures if temperatures.count(t) > 1})
        if repeated:
            twice = ", ".join(f"{t:g}" for t in repeated)
            raise ValueError(f"{twice} given twice (their rows would merge)")
        for t in temperatures:
            SamplingParams(temperature=t)
    except ValueError as e:
        raise ValueError(f"--temperatures {text!r}: {e}") from None
    return temperatures


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jetspec_jax.bench", description="Benchmark decoding methods side by side."
    )
    parser.add_argument(
        "--prompts",
        nargs="+",
        action="extend",
        required=True,
        help="JSONL prompt files (several after one flag, or the flag repeated)",
    )
    parser.add_argument("--limit", type=int, default=None, help="first N prompts per file")
    parser.add_argument(
        "--methods",
        default="ar",
        help="comma-separated (default: ar alone): ar, dflash, jetspec[-K<k>], "
        "jetspec++[-K<k>][-J<j>][-R<r>][-C<c>][-F<b>][-spmd|-mpmd] (a shorter block than "
        "trained, refinement passes, refreshes, replacement confidence, foresight candidates, "
        "pipeline form; ar is always run: it is the baseline)",
    )
    parser.add_argument("--target", default=None, help="HF directory (default: the default model)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="target and drafts compute in it (default %(default)s); an output unlike AR's fails "
        "the run in float32 and is a warning in bfloat16",
    )
    parser.add_argument(
        "--draft",
        action="append",
        default=[],
        help="draft directory (repeatable); serves its own variant, one draft per variant "
        "(default with the default target: its shipped JetSpec++ draft)",
    )
    parser.add_argument(
        "--random-draft",
        default=None,
        choices=["dflash", "jetspec", "jetspec++"],
        help="a randomly initialised draft of this variant (measures overheads, tau ~ 1)",
    )
    parser.add_argument(
        "--random-draft-block", type=int, default=None, help="block size of the --random-draft (16)"
    )
    parser.add_argument("--temperatures", default="0", help="comma-separated, e.g. 0,1")
    parser.add_argument(
        "--max-new-tokens",
        type=int,
        default=256,
        help="new tokens per prompt at most (default %(default)s)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per method")
    parser.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="chat template, thinking off (default: when the tokenizer has one)",
    )
    parser.add_argument(
        "--out", default="runs/bench", help="output directory (a previous run's files replaced)"
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="log at info level (loading, compiling, progress)",
    )
    return parser


if __name__ == "__main__":
    sys.exit(main())
