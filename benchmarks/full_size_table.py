"""Tables and a plot of the refinement settings at one size, from rows gathered across runs.

At the issue's size (50 prompts x 256 tokens per eval set) one setting on one set costs 20-50
minutes on a CPU, so the table is filled by many `bench_refinement.py --results FILE` runs. This
script reads their rows, keeps the latest row per (temperature, set, setting) at the chosen size,
and writes tau per set and setting (with the mean over the five sets where a setting has them
all), wall time and AR's time over it (a ratio of batch times measured one after the other,
compile included) where a row timed them, and a grouped bar plot:

    python benchmarks/full_size_table.py                 # docs/data/full_size_results.jsonl
    python benchmarks/full_size_table.py --results rows.jsonl --num-prompts 8 --max-new-tokens 64
    python benchmarks/full_size_table.py --results docs/data/equal_budget_results.jsonl \
        --plot docs/img/equal_budget_tau.png --section equal_budget_table \
        --title "The equal-budget drafts: tau by set and setting"

Rows (JSON objects, one per line): set, setting, temperature, prompts, max_new_tokens, tau, and
optionally seconds, ar_seconds, new_tokens, identical_to_ar, date, draft, note.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.bench_refinement import SETTINGS  # noqa: E402
from benchmarks.report import BENCHMARKS_MD, write_section  # noqa: E402

SETS = ("gsm8k_test", "math500", "humaneval", "mbpp_test", "mtbench")
ORDER = list(SETTINGS)
REQUIRED = ("set", "setting", "temperature", "prompts", "max_new_tokens", "tau")


def read_rows(path: pathlib.Path, prompts: int, max_new_tokens: int) -> dict[tuple, dict]:
    """`{(temperature, set, setting): row}` of the rows at this size; a later row replaces an
    earlier one (a rerun supersedes).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a line (named by number) that is not a JSON object with the required keys, or
            names a setting `bench_refinement.py` does not run.
    """
    latest = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
        missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"{path}:{number}: missing {', '.join(missing)}")
        if row["setting"] not in ORDER:
            raise ValueError(
                f"{path}:{number}: unknown setting {row['setting']!r}; known: {', '.join(ORDER)}"
            )
        if row["prompts"] == prompts and row["max_new_tokens"] == max_new_tokens:
            latest[(float(row["temperature"]), row["set"], row["setting"])] = row
    return latest


def drafts_line(rows: dict[tuple, dict]) -> str:
    """Which draft each setting's column measured, e.g. "Drafts: `a` (DFlash); `b` (J0, J1-R1)".

    Raises:
        ValueError: a setting's rows come from several drafts (a column would mix them).
    """
    by_setting: dict[str, set] = {}
    for (_, _, setting), row in rows.items():
        by_setting.setdefault(setting, set()).add(row.get("draft", "unnamed"))
    mixed = {x: sorted(d) for x, d in by_setting.items() if len(d) > 1}
    if mixed:
        raise ValueError(
            "a setting's column would mix drafts: "
            + "; ".join(f"{x}: {', '.join(d)}" for x, d in mixed.items())
            + " (keep one draft's rows per file)"
        )
    settings_of: dict[str, list[str]] = {}
    for setting in ORDER:
        if setting in by_setting:
            settings_of.setdefault(next(iter(by_setting[setting])), []).append(setting)
    return "Drafts: " + "; ".join(f"`{d}` ({', '.join(x)})" for d, x in settings_of.items()) + "."


def differs_from_ar(row: dict) -> bool:
    """Whether the row counted outputs unlike AR's (rows that did not check count as equal)."""
    return row.get("identical_to_ar", row["prompts"]) != row["prompts"]


def tau_table(rows: dict[tuple, dict], temperature: float) -> list[str]:
    """Markdown: sets down, settings across, and the mean of each complete column; a tau whose
    run had outputs unlike AR's is marked `(≠AR n/N)`."""
    at = {(s, x): r for (t, s, x), r in rows.items() if t == temperature}
    sets = [s for s in SETS if any(k[0] == s for k in at)]
    sets += sorted({k[0] for k in at} - set(sets))
    labels = [x for x in ORDER if any(k[1] == x for k in at)]
    lines = ["| set | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for name in sets:
        cells = [_tau_cell(at[name, x]) if (name, x) in at else "" for x in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    if set(SETS) <= set(sets):
        means = [
            f"{sum(at[s, x]['tau'] for s in SETS) / len(SETS):.2f}"
            if all((s, x) in at for s in SETS)
            else ""
            for x in labels
        ]
        lines.append("| mean of the five | " + " | ".join(means) + " |")
    return lines


def _tau_cell(row: dict) -> str:
    cell = f"{row['tau']:.2f}"
    if differs_from_ar(row):
        cell += f" (≠AR {row['prompts'] - row['identical_to_ar']}/{row['prompts']})"
    return cell


def time_table(rows: dict[tuple, dict], temperature: float) -> list[str]:
    """Markdown: every timed row's wall time, AR's in the same run, and their ratio."""
    timed = [
        r
        for (t, s, x), r in sorted(rows.items(), key=lambda kv: _sort_key(kv[0]))
        if t == temperature and r.get("seconds") and r.get("ar_seconds")
    ]
    if not timed:
        return []
    lines = [
        "| set | setting | AR | setting | AR time / setting time | setting tokens/s | run |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in timed:
        rate = f"{r['new_tokens'] / r['seconds']:.1f}" if r.get("new_tokens") else ""
        lines.append(
            f"| {r['set']} | {r['setting']} | {r['ar_seconds']:.0f} s | {r['seconds']:.0f} s "
            f"| {r['ar_seconds'] / r['seconds']:.2f}x | {rate} | {r.get('note', '')} |"
        )
    return lines


def _sort_key(key: tuple) -> tuple:
    t, name, label = key
    return (t, SETS.index(name) if name in SETS else len(SETS), name, ORDER.index(label))


def plot_tau(rows: dict[tuple, dict], path: pathlib.Path) -> None:
    """Grouped bars: sets on x, one bar per setting, one panel per temperature."""
    from jetspec_jax.bench.report import plot

    summaries = [
        types.SimpleNamespace(dataset=s, temperature=t, method=x, tau=r["tau"])
        for (t, s, x), r in sorted(rows.items(), key=lambda kv: _sort_key(kv[0]))
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    # Drawn aside, then renamed: a plot cut short (a full disk) must not replace the previous one.
    partial = path.with_name(f".{path.name}.tmp.png")  # the suffix tells savefig the format
    try:
        plot(summaries, "tau", partial)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--results", type=pathlib.Path, default=ROOT / "docs" / "data" / "full_size_results.jsonl"
    )
    parser.add_argument("--num-prompts", type=int, default=50)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument(
        "--plot",
        type=pathlib.Path,
        default=None,
        help="the PNG to draw (default: img/full_size_tau.png beside --out for the default "
        "--section, else img/SECTION_tau.png)",
    )
    parser.add_argument("--out", type=pathlib.Path, default=BENCHMARKS_MD)
    parser.add_argument("--section", default="full_size_table")
    parser.add_argument(
        "--title", default="tau by set and setting", help="the section heading's first words"
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if not args.results.is_file():
        parser.error(f"--results {args.results}: no such file")
    try:
        rows = read_rows(args.results, args.num_prompts, args.max_new_tokens)
        drafts_line(rows)
    except ValueError as e:
        parser.error(str(e))
    if not rows:
        size = f"{args.num_prompts} prompts x {args.max_new_tokens} tokens"
        parser.error(f"{args.results} has no rows of {size}")
    lines = [
        f"## {args.title}, {args.num_prompts} prompts x {args.max_new_tokens} tokens "
        "(`benchmarks/full_size_table.py`)",
        "",
        f"Generated from `{os.path.relpath(args.results, ROOT)}` "
        "(one row per `bench_refinement.py --results` run and setting; the latest row of a set "
        "and setting counts). Mean of per-prompt tau; every output equal to AR's unless a cell "
        "says `≠AR`.",
        "",
        drafts_line(rows),
    ]
    for temperature in sorted({k[0] for k in rows}):
        decoding = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        lines += ["", f"tau, {decoding}:", "", *tau_table(rows, temperature)]
        timed = time_table(rows, temperature)
        if timed:
            lines += [
                "",
                f"Wall time, {decoding}: each batch of all prompts in one decode loop (compile "
                "included), and AR's in the same run before it:",
                "",
                *timed,
            ]
    if args.plot is None:  # beside --out: a run written elsewhere leaves the docs' plots alone
        name = "full_size_tau" if args.section == "full_size_table" else f"{args.section}_tau"
        args.plot = args.out.parent / "img" / f"{name}.png"
    plot_tau(rows, args.plot)
    lines += ["", f"![tau by set and setting]({os.path.relpath(args.plot, args.out.parent)})"]
    body = "\n".join(lines)
    print(body)
    write_section(args.section, body, args.out)


if __name__ == "__main__":
    main()
