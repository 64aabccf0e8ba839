"""What the kernel benchmarks (`bench_draft_attention`, `bench_delta_rule`) share: the command line
(`--smoke`, `--check`, `--out`), the correctness-first run that writes a `docs/BENCHMARKS.md`
section, the report's correctness and failure lists, and the timing and error helpers."""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp

from benchmarks.report import BENCHMARKS_MD, machine_line, write_section

ITERS, REPEATS = 20, 5


def parser(description: str) -> argparse.ArgumentParser:
    """`--smoke` (CPU, tiny shapes, interpreted kernel), `--check` (correctness only), `--out`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, interpreter")
    parser.add_argument("--check", action="store_true", help="correctness only")
    parser.add_argument("--out", type=pathlib.Path, default=None, help="markdown file to write")
    return parser


def parse_args(parser: argparse.ArgumentParser, platforms: tuple[str, ...]) -> argparse.Namespace:
    """The command line of `parser`; a full run is refused off `platforms`. `.kernel_impl` is the
    impl the run times."""
    args = parser.parse_args()
    if not args.smoke and jax.default_backend() not in platforms:
        needs = " or ".join(p.upper() for p in platforms)
        parser.error(f"the full benchmark needs a {needs}; use --smoke on CPU")
    args.kernel_impl = "pallas_interpret" if args.smoke else "pallas"
    return args


def run(
    args: argparse.Namespace,
    section: str,
    check: Callable[[], list[str]],
    measure: Callable[[list[str]], Iterable[str]],
) -> int:
    """Correctness first (`check()` lines, printed as they come by `record`; one starting with
    FAIL fails the run), then, unless `--check`, the markdown bodies `measure(check_lines)`
    yields (one per measured shape, each with every row so far) into `section` of `--out`
    (default: the project's BENCHMARKS.md; a temporary file for `--smoke`), so a run cut off at
    a device's time limit keeps what it measured. Returns the exit status."""
    print(machine_line(), flush=True)
    check_lines = check()
    failed = int(any(line.startswith("FAIL") for line in check_lines))
    if args.check:
        return failed
    out = args.out
    if out is None:
        out = pathlib.Path(tempfile.mkdtemp()) / "BENCHMARKS.md" if args.smoke else BENCHMARKS_MD
    body = ""
    for body in measure(check_lines):
        write_section(section, body, out)
    print(body)
    print(f"wrote section {section!r} of {out}")
    return failed


def record(lines: list[str], line: str) -> None:
    """Appends a correctness or failure line and prints it at once (a device run may be cut)."""
    print(line, flush=True)
    lines.append(line)


def report_lists(check_title: str, check_lines: list[str], notes: list[str]) -> list[str]:
    """The report's tail: the correctness lines under `check_title`, then any timing failures."""
    lines = ["", check_title, ""] + [f"- {line}" for line in check_lines]
    if notes:
        lines += ["", "Failures while timing:", ""] + [f"- {n}" for n in notes]
    return lines


def seconds(fn, args) -> float:
    """Median over `REPEATS` of the mean time of `ITERS` back-to-back calls, after one warm-up
    call (compilation). Launch overhead is included, as in a decode step."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(ITERS):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / ITERS)
    return statistics.median(times)


def max_err(a, b) -> float:
    """Largest absolute difference, in float32."""
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


def first_line(e: Exception) -> str:
    """`Type: first line of the message`, at most 300 characters (for a report's failure list)."""
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]
