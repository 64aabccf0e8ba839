"""Writing benchmark results into docs/BENCHMARKS.md, one replaceable section per benchmark."""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import shlex
import sys

from jetspec_jax.checkpoint.atomic import write_text_atomically

BENCHMARKS_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "BENCHMARKS.md"
_HEADER = (
    "# Benchmarks\n\n"
    "Figures written by the scripts in `benchmarks/`; rerun a script to refresh its section.\n"
)


def machine_line() -> str:
    """Date, platform, CPU count and library versions, for the record."""
    import jax

    versions = f"jax {jax.__version__}"
    try:
        import torch
        import transformers

        versions += f", torch {torch.__version__}, transformers {transformers.__version__}"
    except ImportError:
        pass
    today = datetime.date.today().isoformat()
    return (
        f"{today}; {platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores, "
        f"JAX backend {jax.default_backend()}; {versions}"
    )


def out_parser(description: str) -> argparse.ArgumentParser:
    """The command line of a benchmark whose only option is `--out` (the markdown file its
    section goes into; default: the project's BENCHMARKS.md)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS_MD, help="markdown file")
    return parser


def require_at_least(
    parser: argparse.ArgumentParser, args: argparse.Namespace, minimum: int, *flags: str
) -> None:
    """Refuses (`parser.error`, naming the flag) each of `flags` ("--num-prompts") whose value is
    below `minimum`: before any model load, not as an empty median or a zero division after it."""
    for flag in flags:
        value = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if value < minimum:
            parser.error(f"{flag} must be >= {minimum}, got {value}")


def int_list(
    parser: argparse.ArgumentParser,
    flag: str,
    text: str,
    minimum: int = 1,
    maximum: int | None = None,
    distinct: bool = True,
) -> list[int]:
    """`text`'s comma-separated integers, each in `[minimum, maximum]` and, when `distinct`, none
    given twice (`refuse_repeats`); else `parser.error` naming `flag`."""
    try:
        values = [int(value) for value in text.split(",")]
    except ValueError:
        parser.error(f"{flag} {text!r}: comma-separated integers")
    for value in values:
        if value < minimum or (maximum is not None and value > maximum):
            bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
            parser.error(f"{flag} {text!r}: each must be {bounds}, got {value}")
    if distinct:
        refuse_repeats(parser, flag, values)
    return values


def refuse_repeats(parser: argparse.ArgumentParser, flag: str, values: list) -> None:
    """`parser.error` naming `flag` and each of its `values` given twice: each names a row or
    column of a table, which a repeat would run and print twice."""
    twice = sorted({value for value in values if values.count(value) > 1})
    if twice:
        parser.error(f"{flag}: {', '.join(map(str, twice))} given twice")


def changed_flags(args: argparse.Namespace, parser: argparse.ArgumentParser) -> str:
    """` --flag value` for each option `args` holds away from its default (flags named after
    their destinations): what a section's command line needs to reproduce the run."""
    parts = []
    for dest, value in vars(args).items():
        if value == parser.get_default(dest):
            continue
        flag = "--" + dest.replace("_", "-")
        parts.append(flag if value is True else f"{flag} {shlex.quote(str(value))}")
    return "".join(" " + part for part in parts)


def write_section(name: str, body: str, path: pathlib.Path = BENCHMARKS_MD) -> None:
    """Replaces (or appends) the section between this benchmark's markers.

    Raises:
        ValueError: the file holds the markers other than once each, begin before end (a hand
            edit lost one): replacing would cut the sections in between, appending would
            duplicate.
    """
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    text = path.read_text() if path.exists() else _HEADER
    section = f"{begin}\n{body.rstrip()}\n{end}"
    counts = (text.count(begin), text.count(end))
    if counts == (0, 0):
        text = text.rstrip() + "\n\n" + section + "\n"
    elif counts == (1, 1) and text.index(begin) < text.index(end):
        text = text[: text.index(begin)] + section + text[text.index(end) + len(end) :]
    else:
        raise ValueError(
            f"{path}: section {name!r} has {counts[0]} begin and {counts[1]} end markers (or "
            "its end comes first); mend the file by hand, then rerun"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, text)  # a crash mid-write must not truncate the whole file


def publish(name: str, body: str, path: pathlib.Path, mismatches: list[str]) -> int:
    """Prints `body` and writes it as section `name` of `path`; returns the run's exit status:
    1, with an error line, when `mismatches` names outputs unlike AR's (a lossless method's
    benchmark fails then, its figures still written), else 0."""
    print(body)
    write_section(name, body, path)
    if mismatches:
        print(f"error: outputs unlike AR's: {', '.join(mismatches)}", file=sys.stderr)
        return 1
    return 0
