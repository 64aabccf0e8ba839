"""Continuous vs static batching in the server's scheduler, side by side on one workload.

The default target (SmolLM2-135M-Instruct, float32) behind a `Scheduler` (no HTTP: the figures are
the scheduler's), batches of up to `--batch` rows padded to one shape (see `--unpadded`), tokens
delivered every 8 target forwards. `--clients` closed-loop clients each send their next request as
soon as the previous one is answered, `--requests` in all: chat-templated GSM8K test prompts,
greedy, budgets alternating between a short and a long one (`--budgets`), so that static batches
hold rows idle after their short requests end. Each mode serves the same workload once to compile,
then `--repeats` times, the modes alternating; the figures are medians over the repeats. Every
request's tokens must be the same in every mode (each equals decoding it alone).

With `--reserve P,N` a third mode, *reserved*, is continuous batching with every batch's shapes
sized for prompts of P tokens and budgets of N (`Scheduler(reserve=...)`), so that a request the
running batch's first requests did not size it for joins it too; its figures go to a section of
their own (`continuous_batching_reserve`), on a workload whose first batch is all short budgets.

With `--unpadded` every mode decodes batches of as many rows as the requests they start with (the
server's default, without `--pad-batch`), and a fourth mode, *padded*, is continuous batching
padded as above (section `continuous_batching_unpadded`). `--stagger S` starts the clients S
seconds apart, so that the first batch starts with fewer requests than a full one:

    python benchmarks/bench_continuous_batching.py [--method jetspec++]
    python benchmarks/bench_continuous_batching.py --budgets 16,16,16,16,96,96 --reserve 256,96
    python benchmarks/bench_continuous_batching.py --unpadded --stagger 0.5
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    int_list,
    machine_line,
    out_parser,
    publish,
    require_at_least,
)
from jetspec_jax.data.prompts import read_prompts  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.prompting import encode_prompt  # noqa: E402
from jetspec_jax.sampling import SamplingParams  # noqa: E402
from jetspec_jax.serving.scheduler import Failed, Finished, Job, Scheduler, Tokens  # noqa: E402

EVAL = ROOT.parent / "shared" / "data" / "eval" / "gsm8k_test.jsonl"
JOINED = "jetspec_joined_requests_total"


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--method", default="ar", choices=("ar", "jetspec++"))
    parser.add_argument("--batch", type=int, default=4, help="max_batch_size (padded)")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument(
        "--stagger", type=float, default=0.0, help="seconds between the clients' first requests"
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--budgets", default="16,96", help="max_tokens, cycled over requests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--reserve", default=None, metavar="P,N", help="add the reserved mode (see above)"
    )
    parser.add_argument(
        "--unpadded",
        action="store_true",
        help="batches of as many rows as their requests (the server's default), and a padded "
        "continuous mode beside them",
    )
    return parser


def _sample(scheduler: Scheduler, name: str) -> float:
    return scheduler.metrics.registry.get_sample_value(name) or 0.0


def serve_workload(scheduler: Scheduler, jobs, clients: int, stagger: float = 0.0) -> dict:
    """Serves `jobs` (prompt, budget) from `clients` closed-loop clients, the i-th starting
    `i * stagger` seconds after the first; per request its tokens, latency and time to first
    token, the wall time of the whole workload, and the batches started and requests that joined
    one."""
    counts = [_sample(scheduler, n) for n in ("jetspec_batch_size_count", JOINED)]
    pending = list(enumerate(jobs))
    lock, finished = threading.Lock(), threading.Semaphore(0)
    tokens, latency, first = {}, {}, {}

    def send_next() -> None:
        with lock:
            if not pending:
                return
            index, (prompt, budget) = pending.pop(0)
        sent = time.perf_counter()
        tokens[index] = []

        def deliver(event) -> None:  # on the scheduler's thread: must not block
            if isinstance(event, Tokens):
                first.setdefault(index, time.perf_counter() - sent)
                tokens[index] += event.tokens
            elif isinstance(event, (Finished, Failed)):
                if isinstance(event, Failed):
                    tokens[index] = None
                latency[index] = time.perf_counter() - sent
                finished.release()
                send_next()  # the client's next request, as soon as this one is answered

        scheduler.submit(Job(prompt, budget, SamplingParams(), deliver))

    start = time.perf_counter()
    for i in range(clients):
        if i:
            time.sleep(stagger)
        send_next()
    for _ in jobs:
        if not finished.acquire(timeout=1800):
            raise TimeoutError("a request got no answer in 30 min")
    wall = time.perf_counter() - start
    batches, joined = (
        _sample(scheduler, n) - c
        for n, c in zip(("jetspec_batch_size_count", JOINED), counts, strict=True)
    )
    return dict(
        tokens=tokens, latency=latency, first=first, wall=wall, batches=batches, joined=joined
    )


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    # Before the model load: a bad value would fail after it, or (no clients) wait 30 minutes.
    require_at_least(parser, args, 1, "--batch", "--clients", "--requests", "--repeats")
    if args.stagger < 0:
        parser.error(f"--stagger must be >= 0, got {args.stagger}")
    budgets = int_list(parser, "--budgets", args.budgets, distinct=False)  # cycled: repeats too
    reserve = None
    if args.reserve:
        reserve = tuple(int_list(parser, "--reserve", args.reserve, minimum=0, distinct=False))
        if len(reserve) != 2:
            parser.error(f"--reserve {args.reserve!r}: two integers P,N")
    target = jetspec_jax.load_target()
    draft, options = None, DecodingOptions()
    if args.method != "ar":
        draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
        options = DecodingOptions(args.method)
    modes = {"static": dict(continuous=False), "continuous": dict(continuous=True)}
    if reserve:
        modes["reserved"] = dict(continuous=True, reserve=reserve)
    for settings in modes.values():
        settings["pad_batch"] = not args.unpadded
    if args.unpadded:
        modes["padded"] = dict(continuous=True, pad_batch=True)
    records = read_prompts(EVAL, limit=args.requests)
    jobs = [
        (encode_prompt(target.tokenizer, r["prompt"], chat=True), budgets[i % len(budgets)])
        for i, r in enumerate(records)
    ]
    schedulers = {
        mode: Scheduler(
            target,
            draft=draft,
            options=options,
            max_batch_size=args.batch,
            queue_size=len(jobs),
            chunk_steps=8,
            **settings,
        )
        for mode, settings in modes.items()
    }
    for scheduler in schedulers.values():
        scheduler.start()
    runs = {mode: [] for mode in modes}
    try:
        for repeat in range(args.repeats + 1):  # the first serves compile
            for mode, scheduler in schedulers.items():
                run = serve_workload(scheduler, jobs, args.clients, args.stagger)
                print(f"{mode} run {repeat}: {run['wall']:.1f} s", flush=True)
                if repeat:
                    runs[mode].append(run)
    finally:
        for scheduler in schedulers.values():
            scheduler.stop()
    reference = runs["static"][0]["tokens"]
    mismatches = [
        f"{mode} run {i} request {j}"
        for mode in modes
        for i, run in enumerate(runs[mode])
        for j in range(len(jobs))
        if run["tokens"][j] != reference[j] or reference[j] is None
    ]
    generated = sum(len(t) for t in reference.values() if t)
    figures = {}
    for mode in modes:
        walls = [run["wall"] for run in runs[mode]]
        latencies = [list(run["latency"].values()) for run in runs[mode]]
        firsts = [list(run["first"].values()) for run in runs[mode]]
        figures[mode] = dict(
            wall=statistics.median(walls),
            tokens_per_second=statistics.median(generated / w for w in walls),
            p50=statistics.median(np.percentile(x, 50) for x in latencies),
            p99=statistics.median(np.percentile(x, 99) for x in latencies),
            ttft50=statistics.median(np.percentile(x, 50) for x in firsts),
            ttft99=statistics.median(np.percentile(x, 99) for x in firsts),
            batches=statistics.median(run["batches"] for run in runs[mode]),
            joined=statistics.median(run["joined"] for run in runs[mode]),
        )
    title = "Continuous vs static batching" + (", and a reserve" if reserve else "")
    title += ", unpadded batches" if args.unpadded else ""
    lines = [
        f"## {title} (`benchmarks/bench_continuous_batching.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_continuous_batching.py{changed_flags(args, parser)}`",
        f"- Setup: default target (SmolLM2-135M-Instruct, float32), method {args.method}"
        + (" (the shipped draft, J0)" if args.method != "ar" else "")
        + f", greedy; a `Scheduler` with max_batch_size {args.batch} "
        + (
            "(unpadded: a batch has as many rows as the requests it starts with, rounded up to "
            "a power of two; *padded*: continuous, every batch of max_batch_size rows)"
            if args.unpadded
            else "(padded)"
        )
        + ", chunk_steps 8; "
        f"{args.clients} closed-loop clients"
        + (f" starting {args.stagger:g} s apart" if args.stagger else "")
        + f", {len(jobs)} chat-templated GSM8K test prompts "
        f"with budgets cycling {budgets} (a request ends at its budget or its end-of-turn "
        f"token: {generated} tokens in all). Median of "
        f"{args.repeats} serves of the workload per mode, the modes alternating, after one "
        "serve each that compiled. *batches*: batches started per serve; *joined*: requests "
        "that joined a running batch"
        + (
            f"; *reserved*: continuous, every batch sized for prompts of {reserve[0]} tokens "
            f"and budgets of {reserve[1]} at least"
            if reserve
            else ""
        )
        + ". Every request's tokens equal in every mode: "
        + ("yes" if not mismatches else f"**no** ({len(mismatches)} differ)")
        + ".",
        "",
        "| mode | batches | joined | wall s | tokens/s | p50 latency s | p99 latency s | "
        "p50 TTFT s | p99 TTFT s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode, f in figures.items():
        lines.append(
            f"| {mode} | {f['batches']:.0f} | {f['joined']:.0f} | {f['wall']:.1f} | "
            f"{f['tokens_per_second']:.1f} | {f['p50']:.2f} | {f['p99']:.2f} | "
            f"{f['ttft50']:.2f} | {f['ttft99']:.2f} |"
        )
    static, continuous = figures["static"], figures["continuous"]
    lines += [
        "",
        f"Continuous over static: {static['wall'] / continuous['wall']:.2f}x the throughput, "
        f"p50 latency {static['p50'] / continuous['p50']:.2f}x lower, p50 time to first token "
        f"{static['ttft50'] / continuous['ttft50']:.2f}x lower.",
    ]
    if args.unpadded:
        padded = figures["padded"]
        lines.append(
            f"Padded over unpadded continuous: {continuous['wall'] / padded['wall']:.2f}x the "
            f"throughput, p50 latency {continuous['p50'] / padded['p50']:.2f}x lower, p50 time "
            f"to first token {continuous['ttft50'] / padded['ttft50']:.2f}x lower."
        )
    if reserve:
        reserved = figures["reserved"]
        lines.append(
            f"Reserved over continuous: {continuous['wall'] / reserved['wall']:.2f}x the "
            f"throughput, p50 latency {continuous['p50'] / reserved['p50']:.2f}x lower, p50 time "
            f"to first token {continuous['ttft50'] / reserved['ttft50']:.2f}x lower."
        )
    section = "continuous_batching" + ("_reserve" if reserve else "")
    section += "_unpadded" if args.unpadded else ""
    return publish(section, "\n".join(lines) + "\n", args.out, mismatches)


if __name__ == "__main__":
    sys.exit(main())
