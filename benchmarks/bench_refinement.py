"""tau of a trained draft per eval set: JetSpec++'s refinement ablation and foresight hit rates,
or the one-pass baselines (DFlash, JetSpec) at the same size.

For each eval prompt set and each setting, greedy decoding of the first N prompts (chat template,
math suffix for math sets) with the same checkpoint:

    DFlash, JetSpec               one pass of a DFlash / JetSpec draft (the baselines)
    J0, J1-R0, J1-R1, J3-R3       a JetSpec++ checkpoint, with the adapter + decoder proxy (the
                                  served path)
    J1-R1*, J3-R3*                the same with the target itself as the proxy (true states)
    foresight B                   hit rate of drafting ahead for B outcomes (J1-R1 fallback), per
                                  selection rule (JetSpec++ only)

and writes the table into docs/BENCHMARKS.md. By default every setting the checkpoint's variant
runs (a DFlash draft: DFlash; a JetSpec++ checkpoint: J0 to J3-R3*). Every setting is checked
token-identical to AR: greedy, and with `--temperature` > 0 too, where prompt i is sampled with
seed i by every method (randomness is keyed by position, so a lossless method draws exactly AR's
tokens). A mismatch is counted and reported, not raised, so that a long run still writes its
table; the run then exits with status 1 (all of it runs in float32, where a lossless method has
no excuse to differ).

    python benchmarks/bench_refinement.py --draft runs/smollm2_135m_cpu_budget/jetspec_pp \
        --sets gsm8k_test,math500 --num-prompts 8 --max-new-tokens 64

`--settings J0,J3-R3 --foresight ""` runs a subset (e.g. at the full size, 50 prompts x 256
tokens, where every setting costs minutes per set on a CPU); a baseline draft runs with
`--foresight ""`:

    python benchmarks/bench_refinement.py --draft runs/smollm2_135m_cpu_budget_dflash/draft \
        --foresight "" --num-prompts 50 --max-new-tokens 256 --results rows.jsonl

`--section` names the docs/BENCHMARKS.md section written (default: refinement_ablation).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EVAL_DIR = ROOT.parent / "shared" / "data" / "eval"

import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BENCHMARKS_MD,
    changed_flags,
    machine_line,
    publish,
    refuse_repeats,
)
from jetspec_jax.bench.datasets import load_dataset  # noqa: E402
from jetspec_jax.data.jsonl import trim_partial_last_line  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.results import pooled_hit_rate  # noqa: E402
from jetspec_jax.decoding.target_proxy import TargetProxyDraft  # noqa: E402
from jetspec_jax.flag_paths import require_paths  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Setting:
    """One way of decoding with the checkpoint: `method` (the draft's variant), JetSpec++'s
    `Jj-Rr`, and `true_states`: the target itself as the refinement proxy."""

    method: str
    refine_passes: int = 0
    refreshes: int = 0
    true_states: bool = False


# Table order: the baselines, then JetSpec++ from one pass to the most refinement.
SETTINGS = {
    "DFlash": Setting("dflash"),
    "JetSpec": Setting("jetspec"),
    "J0": Setting("jetspec++"),
    "J1-R0": Setting("jetspec++", 1, 0),
    "J1-R1": Setting("jetspec++", 1, 1),
    "J3-R3": Setting("jetspec++", 3, 3),
    "J1-R1*": Setting("jetspec++", 1, 1, true_states=True),
    "J3-R3*": Setting("jetspec++", 3, 3, true_states=True),
}


def settings_of(variant: str) -> list[str]:
    """The settings a draft of `variant` runs, in table order."""
    return [label for label, s in SETTINGS.items() if s.method == variant]


def check_runs(draft, labels: list[str], budgets: list[int], rules: list[str]) -> str | None:
    """Why `draft` cannot run these settings and foresight budgets (None: it can). Checked before
    the first set: a mismatch must fail now, not an hour in with the table unwritten."""
    variant = draft.config.variant
    wrong = [x for x in labels if SETTINGS[x].method != variant]
    if wrong:
        runs = ", ".join(settings_of(variant))
        return f"--settings {','.join(wrong)}: not for a {variant} draft (it runs {runs})"
    if budgets and variant != "jetspec++":
        return f'--foresight: JetSpec++ only, not for a {variant} draft (pass --foresight "")'
    refreshing = [x for x in labels if SETTINGS[x].refreshes and not SETTINGS[x].true_states]
    if draft.adapter is None and (refreshing or budgets):
        what = ",".join(refreshing) or "--foresight"
        return f"{what}: needs a draft with an adapter (a JetSpec++ checkpoint with one)"
    if budgets and "calibrated" in rules and draft.calibration is None:
        return "--rules calibrated: the checkpoint has no calibration (train.py calibrate)"
    return None


def _run(target, prompts, max_new_tokens, temperature, *, draft=None, **options):
    sampling = [jetspec_jax.SamplingParams(temperature, seed=i) for i in range(len(prompts))]
    return jetspec_jax.generate_batch(
        target,
        prompts,
        draft=draft,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        stop_token_ids=None,
        show_progress=None,
        **options,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--draft", required=True, help="a JetSpec++ checkpoint, or a DFlash / JetSpec draft"
    )
    parser.add_argument("--target", default=None, help="HF target (default: the embedded one)")
    parser.add_argument(
        "--sets",
        default="gsm8k_test",
        help="comma-separated names of files NAME.jsonl in --eval-dir",
    )
    parser.add_argument("--eval-dir", type=pathlib.Path, default=EVAL_DIR)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; > 0: prompt i uses seed i"
    )
    parser.add_argument(
        "--settings",
        default="",
        help=f"comma-separated settings to run ({', '.join(SETTINGS)}); default: every one of "
        "the draft's variant",
    )
    parser.add_argument(
        "--foresight", default="4,16", help='comma-separated B values ("": no foresight)'
    )
    parser.add_argument(
        "--rules", default="calibrated,uncalibrated,geometric", help="foresight selection rules"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=BENCHMARKS_MD, help="markdown file to write"
    )
    parser.add_argument("--section", default="refinement_ablation", help="section name to write")
    parser.add_argument(
        "--results",
        type=pathlib.Path,
        default=None,
        help="JSONL file to append one row per set and setting to (benchmarks/full_size_table.py "
        "tabulates and plots such rows across runs)",
    )
    return parser


def _append_row(path: pathlib.Path, row: dict) -> None:
    """Appends one JSONL row to `path`, after a last line a kill cut (which the row would run on
    from) if there is one."""
    if path.exists():
        trim_partial_last_line(path)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    labels = [label for label in args.settings.split(",") if label]
    if any(label not in SETTINGS for label in labels):
        parser.error(f"--settings {args.settings!r}: use some of {', '.join(SETTINGS)}")
    if args.temperature < 0:
        parser.error(f"--temperature {args.temperature}: must be >= 0")
    for flag in ("num_prompts", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    sets = args.sets.split(",")
    rules = args.rules.split(",")
    budget_texts = [b for b in args.foresight.split(",") if b]
    for flag, values in (
        ("--settings", labels),
        ("--sets", sets),
        ("--rules", rules),
        ("--foresight", budget_texts),
    ):
        refuse_repeats(parser, flag, values)
    set_paths = {name: args.eval_dir / f"{name}.jsonl" for name in sets}
    for name, path in set_paths.items():
        if not path.is_file():
            parser.error(f"--sets {name}: no such file {path}")
    try:
        budgets = [int(b) for b in budget_texts]
        for b in budgets:
            for rule in rules:
                options = dict(refine_passes=1, refreshes=1, foresight=b, foresight_rule=rule)
                DecodingOptions("jetspec++", **options)
    except ValueError as e:
        parser.error(f"--foresight {args.foresight!r} --rules {args.rules!r}: {e}")

    try:  # not after the target's load
        require_paths("--target", [args.target], directory=True)
        require_paths("--draft", [args.draft], directory=True)
    except FileNotFoundError as e:
        parser.error(str(e))

    target = jetspec_jax.load_target(args.target)
    draft = jetspec_jax.load_draft(args.draft, target)
    if not labels:
        labels = settings_of(draft.config.variant)
    problem = check_runs(draft, labels, budgets, rules)
    if problem:
        parser.error(f"{args.draft}: {problem}")
    rows, hit_rows, mismatches, times = [], [], [], []
    run = functools.partial(
        _run, target, max_new_tokens=args.max_new_tokens, temperature=args.temperature
    )

    def check(results, want, what) -> int:
        same = sum(r.tokens == w for r, w in zip(results, want, strict=True))
        if same < len(want):
            mismatches.append(f"{what} {same}/{len(want)}")
            print(f"{what}: only {same}/{len(want)} outputs equal AR's", flush=True)
        return same

    for name, path in set_paths.items():
        prompts = load_dataset(path, target.tokenizer, limit=args.num_prompts).prompts
        start = time.perf_counter()
        ar = run(prompts)
        want = [r.tokens for r in ar]
        taus, seconds = {}, {"AR": time.perf_counter() - start}
        print(f"{name} AR: {seconds['AR']:.0f} s", flush=True)
        for label in labels:
            setting = SETTINGS[label]
            setting_start = time.perf_counter()
            results = run(
                prompts,
                draft=TargetProxyDraft(draft) if setting.true_states else draft,
                method=setting.method,
                refine_passes=setting.refine_passes,
                refreshes=setting.refreshes,
            )
            same = check(results, want, f"{name} {label}")
            taus[label] = float(np.mean([r.tau for r in results]))
            seconds[label] = time.perf_counter() - setting_start
            print(f"{name} {label}: tau {taus[label]:.2f} ({seconds[label]:.0f} s)", flush=True)
            if args.results is not None:
                row = dict(
                    date=datetime.date.today().isoformat(),
                    draft=str(args.draft),
                    set=name,
                    setting=label,
                    temperature=args.temperature,
                    prompts=len(prompts),
                    max_new_tokens=args.max_new_tokens,
                    tau=taus[label],
                    new_tokens=sum(len(r.tokens) for r in results),
                    seconds=seconds[label],
                    ar_seconds=seconds["AR"],
                    identical_to_ar=same,
                )
                _append_row(args.results, row)
        rows.append((name, taus))
        times.append((name, seconds))
        for b in budgets:
            hits = {}
            for rule in rules:
                results = run(
                    prompts,
                    draft=draft,
                    method="jetspec++",
                    refine_passes=1,
                    refreshes=1,
                    foresight=b,
                    foresight_rule=rule,
                )
                check(results, want, f"{name} B={b} {rule}")
                hits[rule] = pooled_hit_rate(results)  # rounds after each prompt's first
                print(f"{name} B={b} {rule}: hit rate {hits[rule]:.2f}", flush=True)
            hit_rows.append((name, b, hits))
        print(f"{name}: {taus} ({time.perf_counter() - start:.0f} s)", flush=True)

    decoding = (
        f"temperature {args.temperature:g} (seed i for prompt i)" if args.temperature else "greedy"
    )
    identical = (
        "every setting token-identical to AR"
        if not mismatches
        else "token-identical to AR except (outputs equal / all): " + ", ".join(mismatches)
    )
    lines = [
        "## Refinement ablation and foresight hit rates (`benchmarks/bench_refinement.py`)",
        "",
        f"Machine: {machine_line()}. Checkpoint `{args.draft}`; {decoding}, first "
        f"{args.num_prompts} prompts per set, {args.max_new_tokens} new tokens; {identical}. "
        "tau: the mean of per-prompt tau. `*`: the target itself as the proxy (true tap "
        "states).",
        "",
        f"Command: `python benchmarks/bench_refinement.py{changed_flags(args, _parser())}`",
        "",
    ]
    ratio = "J1-R1" in labels and "J1-R1*" in labels
    lines += [
        "| set | " + " | ".join(labels) + (" | J1-R1 / J1-R1* |" if ratio else " |"),
        "|---|" + "---:|" * (len(labels) + ratio),
    ]
    for name, taus in rows:
        cells = " | ".join(f"{taus[x]:.2f}" for x in labels)
        tail = f" | {taus['J1-R1'] / taus['J1-R1*']:.2f} |" if ratio else " |"
        lines.append(f"| {name} | {cells}{tail}")
    lines += [
        "",
        "Wall time of each batch (all prompts in one decode loop, compile included) and AR's time "
        "over it, measured one after the other in this run (a wall-time ratio, not a side-by-side "
        "speedup: `python -m jetspec_jax.bench` measures that):",
        "",
        "| set | AR | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * (len(labels) + 1),
    ]
    for name, seconds in times:
        ar = seconds["AR"]
        cells = " | ".join(f"{seconds[x]:.0f} s ({ar / seconds[x]:.2f}x)" for x in labels)
        lines.append(f"| {name} | {ar:.0f} s | {cells} |")
    if hit_rows:
        lines += ["", "Foresight hit rate (J1-R1 fallback; rounds after the first):", ""]
        lines += ["| set | B | " + " | ".join(rules) + " |", "|---|---:|" + "---:|" * len(rules)]
        for name, b, hits in hit_rows:
            cells = " | ".join(f"{hits[r]:.2f}" for r in rules)
            lines.append(f"| {name} | {b} | {cells} |")
    return publish(args.section, "\n".join(lines), args.out, mismatches)


if __name__ == "__main__":
    sys.exit(main())
