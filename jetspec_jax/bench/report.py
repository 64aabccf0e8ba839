"""Benchmark results on disk: JSONL, a markdown table and PNG plots (tau and speedup)."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from collections.abc import Sequence

from jetspec_jax.bench.runner import Sample, Summary


def write_jsonl(path: pathlib.Path, rows: Sequence) -> None:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dataclasses.asdict(row)) + "\n")


def markdown_table(summaries: Sequence[Summary]) -> str:
    """One row per (dataset, temperature, method); foresight hits = the fraction of rounds after
    each prompt's first whose block was drafted ahead (blank without foresight)."""
    lines = [
        "| dataset | T | method | prompts | tokens | tau | decode tok/s | speedup vs AR "
        "| prefill ms | ms / round | foresight hits | greedy = AR |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for s in summaries:
        check = "" if s.greedy_matches_ar is None else f"{s.greedy_matches_ar}/{s.prompts}"
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
    """Writes results.jsonl, samples.jsonl, results.md, tau.png and speedup.png into `out_dir`.

    The plots need matplotlib (the `bench` extra); without it they are skipped, with a note on
    stderr. Returns the paths written, by kind.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {
        "results": out_dir / "results.jsonl",
        "samples": out_dir / "samples.jsonl",
        "table": out_dir / "results.md",
    }
    write_jsonl(paths["results"], summaries)
    write_jsonl(paths["samples"], samples)
    paths["table"].write_text(markdown_table(summaries), encoding="utf-8")
    try:
        import matplotlib  # noqa: F401  (the plots' only optional dependency)
    except ImportError as e:
        print(
            f"note: no plots (tau.png, speedup.png): matplotlib is not importable ({e}); "
            'pip install -e ".[bench]"',
            file=sys.stderr,
        )
        return paths
    for metric in ("tau", "speedup"):
        paths[metric] = out_dir / f"{metric}.png"
        plot(summaries, metric, paths[metric])
    return paths
