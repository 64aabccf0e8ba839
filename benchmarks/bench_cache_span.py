"""Decode speed against the cache's capacity at equal fill: attention over every preallocated slot
vs over the filled span only.

The default target (SmolLM2-135M-Instruct, float32) on this CPU, batch 1, a 300-token prompt,
greedy. A session's cache holds prompt bucket + `max_new_tokens` + block slots, so a long budget
makes a mostly empty cache for most of the generation. For each budget, AR and JetSpec++ J0 (the
shipped draft) run their first `ROUNDS` target forwards (timed after a compiled warm-up; median of
`REPEATS` sessions, ms per target forward), with the cached attention as

    whole cache   one softmax over every slot (`cache_chunk` above the capacity), target and draft
    target span   the target's over the filled span, the draft's over every slot (JetSpec++ only)
    filled span   chunks of `cache_chunk` slots (the default), only as many as the latest position
                  needs, target and draft

Both forms run in this one process, side by side.

    python benchmarks/bench_cache_span.py
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dataclasses  # noqa: E402

import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import machine_line, out_parser, write_section  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402

BUDGETS = (64, 7800)  # 300 + 7800 tokens fit the 8192-token context
ROUNDS, REPEATS, PROMPT = 32, 5, 300
FORMS = ("whole cache", "target span", "filled span")


def _parser() -> argparse.ArgumentParser:
    return out_parser(__doc__.split("\n")[0])


def ms_per_forward(target, draft, prompt, budget: int, method: str) -> tuple[float, int]:
    """One session's ms per target forward over its first `ROUNDS`, and its cache's capacity."""
    session = DecodeSession(
        target,
        [prompt],
        draft=draft if method != "ar" else None,
        options=DecodingOptions(method=method),
        max_new_tokens=budget,
        stop_token_ids=[],
    )
    session.start()
    session.advance(1)
    session.poll()
    start = time.perf_counter()
    session.advance(ROUNDS)
    session.poll()  # waits for the device
    capacity = session._capacity  # private: the figure this benchmark is about
    return 1e3 * (time.perf_counter() - start) / ROUNDS, capacity


def main() -> None:
    args = _parser().parse_args()
    spans = jetspec_jax.load_target()
    chunk = spans.config.cache_chunk
    whole = dataclasses.replace(
        spans, config=dataclasses.replace(spans.config, cache_chunk=1 << 30)
    )
    targets = dict(zip(FORMS, (whole, spans, spans), strict=True))
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), spans)
    whole_draft = draft.with_cache_chunk(1 << 30)
    drafts = dict(zip(FORMS, (whole_draft, whole_draft, draft), strict=True))
    prompt = np.random.default_rng(0).integers(0, spans.config.vocab_size, PROMPT).tolist()
    rows = []
    for method in ("ar", "jetspec++"):
        for budget in BUDGETS:
            forms = FORMS if method != "ar" else ("whole cache", "filled span")
            samples = {form: [] for form in forms}
            for _ in range(REPEATS + 1):  # the forms alternate; each one's first run compiles
                for form in forms:
                    target = targets[form]
                    ms, capacity = ms_per_forward(target, drafts[form], prompt, budget, method)
                    samples[form].append(ms)
            times = {form: statistics.median(ms[1:]) for form, ms in samples.items()}
            rows.append((method, budget, capacity, times))
            print(method, budget, capacity, times, flush=True)
    lines = [
        "## Cached attention over the filled span (`benchmarks/bench_cache_span.py`)",
        "",
        f"{machine_line()}. Default target (SmolLM2-135M-Instruct, float32), batch 1, a "
        f"{PROMPT}-token prompt, greedy; ms per target forward over the first {ROUNDS} forwards "
        f"(median of {REPEATS} sessions after a compiled one). *whole cache*: one softmax over "
        f"every preallocated slot, in the target and the draft; *target span*: the target's "
        f"attention in chunks of {chunk} slots, only as many as the latest position needs, the "
        "draft's over every slot; *filled span*: both in chunks (the default). JetSpec++ is J0 "
        "with the shipped draft. The forms side by side in one run, alternating session by "
        f"session. Up to {chunk} slots every column runs the same program: their ratios there "
        "are this run's noise.",
        "",
        "| method | max_new_tokens | cache slots | whole cache | target span | filled span | "
        "speedup (whole / filled) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for method, budget, capacity, times in rows:
        whole, span = times["whole cache"], times["filled span"]
        target_span = f"{times['target span']:.2f}" if "target span" in times else "-"
        lines.append(
            f"| {method} | {budget} | {capacity} | {whole:.2f} | {target_span} | {span:.2f} | "
            f"{whole / span:.2f}x |"
        )
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("bench_cache_span", body, args.out)


if __name__ == "__main__":
    main()
