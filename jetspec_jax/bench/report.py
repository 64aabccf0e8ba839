"""Benchmark results on disk: JSONL, a markdown table and PNG plots (tau and speedup)."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Sequence

from jetspec_jax.bench.runner import Sample, Summary
from jetspec_jax.checkpoint.atomic import write_text_atomically


def write_jsonl(path: pathlib.Path, rows: Sequence) -> None:
    """One JSON object per dataclass row, written atomically."""
    write_text_atomically(path, "".join(json.dumps(dataclasses.asdict(row)) + "\n" for row in rows))


# What a run has measured so far, one sample per line: kept when it is interrupted or fails.
PARTIAL_SAMPLES = "samples.partial.jsonl"

# The report's files by kind (the keys of `write_report`'s answer).
REPORT_FILES = {
    "results": "results.jsonl",
    "samples": "samples.jsonl",
    "table": "results.md",
    "tau": "tau.png",
    "speedup": "speedup.png",
}


def check_out_dir(out_dir: pathlib.Path) -> None:
    """Refuses an `out_dir` the report could not be written into, before any run. Creates
    nothing: a probe file is written and removed in `out_dir`, or if it does not exist yet, in
    its nearest existing parent (where it would be created).

    Raises:
        ValueError: `out_dir` (or a parent) is a file or a symlink to nowhere, it cannot be
            created or written into, or a report file's name there is taken by a directory.
    """
    existing = next(p for p in (out_dir, *out_dir.parents) if os.path.lexists(p) or p == p.parent)
    if not existing.exists():  # `mkdir` would say only "File exists", after the first run
        raise ValueError(
            f"--out {out_dir}: {existing} is a symlink to {os.readlink(existing)}, which does "
            "not exist"
        )
    if not existing.is_dir():
        raise ValueError(f"--out {out_dir}: {existing} is a file, not a directory")
    try:
        with tempfile.NamedTemporaryFile(dir=existing, prefix=".write_probe"):
            pass
    except OSError as e:
        raise ValueError(f"--out {out_dir} cannot be written into: {e}") from e
    taken = [
        name for name in (*REPORT_FILES.values(), PARTIAL_SAMPLES) if (out_dir / name).is_dir()
    ]
    if taken:
        raise ValueError(f"--out {out_dir}: {', '.join(taken)} would be written over directories")


def log_sample(out_dir: pathlib.Path, sample) -> None:
    """Appends `sample` to `out_dir/PARTIAL_SAMPLES` (created with `out_dir` if missing), so an
    interrupted run keeps what it measured; `write_report` removes the file."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with (out_dir / PARTIAL_SAMPLES).open("a", encoding="utf-8") as f:
        f.write(json.dumps(dataclasses.asdict(sample)) + "\n")


def markdown_table(summaries: Sequence[Summary]) -> str:
    """One row per (dataset, temperature, method); foresight hits = the fraction of rounds after
    each prompt's first whose block was drafted ahead (blank without foresight)."""
    lines = [
        "| dataset | T | method | prompts | tokens | tau | decode tok/s | speedup vs AR "
        "| prefill ms | ms / round | foresight hits | = AR |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summaries:
        check = "" if s.matches_ar is None else f"{s.matches_ar}/{s.prompts}"
        hits = "" if s.foresight_hit_rate is None else f"{s.foresight_hit_rate:.2f}"
        lines.append(
            f"| {s.dataset} | {s.temperature:g} | {s.method} | {s.prompts} | {s.new_tokens} "
            f"| {s.tau:.2f} | {s.decode_tokens_per_second:.1f} | {s.speedup:.2f}x "
            f"| {s.prefill_ms:.1f} | {s.round_ms:.2f} | {hits} | {check} |"
        )
    return "\n".join(lines) + "\n"


def plot(summaries: Sequence[Summary], metric: str, path: pathlib.Path) -> None:
    """Grouped bars of `metric` ("tau" or "speedup"): datasets on x, one bar per method, one
    panel per temperature."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    temperatures = sorted({s.temperature for s in summaries})
    datasets = list(dict.fromkeys(s.dataset for s in summaries))
    methods = list(dict.fromkeys(s.method for s in summaries))
    value = {(s.dataset, s.temperature, s.method): getattr(s, metric) for s in summaries}
    fig, axes = plt.subplots(
        1,
        len(temperatures),
        figsize=(2 + 1.6 * len(datasets) * len(temperatures), 3.6),
        squeeze=False,
    )
    width = 0.8 / len(methods)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        for j, method in enumerate(methods):
            xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(datasets))]
            ys = [value.get((d, temperature, method), 0.0) for d in datasets]
            ax.bar(xs, ys, width, label=method)
        ax.set_xticks(range(len(datasets)), datasets)
        ax.set_title(f"temperature {temperature:g}")
        ax.set_ylabel({"tau": "tau (tokens / target forward)", "speedup": "speedup vs AR"}[metric])
        ax.axhline(1.0, color="gray", linewidth=0.8)
    axes[0][-1].legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(
    out_dir: pathlib.Path, samples: Sequence[Sample], summaries: Sequence[Summary]
) -> dict[str, pathlib.Path]:
    """Writes results.jsonl, samples.jsonl, results.md, tau.png and speedup.png into `out_dir`
    (each file atomically; a previous run's files there are replaced), then removes the partial
    log (`log_sample`).

    The three tables are written aside first and renamed into place together, so a write that
    fails (a full disk) leaves the previous run's report whole, never its tables beside some of
    this run's. A previous run's plots are removed before those renames, so they never sit beside
    this run's tables (should plotting fail). The plots need matplotlib (the `bench` extra);
    without it they are skipped, with a note on stderr. Returns the paths written, by kind.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = {metric: out_dir / REPORT_FILES[metric] for metric in ("tau", "speedup")}
    paths = {kind: out_dir / REPORT_FILES[kind] for kind in ("results", "samples", "table")}
    staged = {kind: path.with_name(f".{path.name}.staged") for kind, path in paths.items()}
    try:
        write_jsonl(staged["results"], summaries)
        write_jsonl(staged["samples"], samples)
        write_text_atomically(staged["table"], markdown_table(summaries))
        for stale in plots.values():  # a failure below never leaves old plots by new tables
            stale.unlink(missing_ok=True)
        for kind, path in paths.items():
            staged[kind].replace(path)
    finally:
        for path in staged.values():
            path.unlink(missing_ok=True)
    try:
        import matplotlib  # noqa: F401  (the plots' only optional dependency)
    except ImportError as e:
        print(
            f"note: no plots (tau.png, speedup.png): matplotlib is not importable ({e}); "
            'pip install -e ".[bench]"',
            file=sys.stderr,
        )
    else:
        for metric, path in plots.items():
            partial = path.with_name(f".{path.name}.tmp.png")  # the suffix tells savefig the format
            try:
                plot(summaries, metric, partial)
                partial.replace(path)
            finally:
                partial.unlink(missing_ok=True)
            paths[metric] = path
    (out_dir / PARTIAL_SAMPLES).unlink(missing_ok=True)
    return paths
