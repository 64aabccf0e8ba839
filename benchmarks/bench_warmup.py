"""A server's first requests with and without warming up (`serve.py --warmup`), side by side.

The default target (SmolLM2-135M-Instruct, float32) served in-process (`BackgroundServer`) with
batches padded to `--batch` rows and a reserve of `--reserve-prompt` prompt tokens and
`--reserve-new` new tokens, by `--method` (JetSpec++ with the shipped draft, J0, by default:
the server's default). Each mode starts from empty compilation caches (the in-memory ones
cleared, the persistent one off), waits for /health to answer 200, then sends `--requests`
chat requests one after another (GSM8K test prompts of different lengths, greedy,
`--max-tokens` each). *ready*: seconds from the start to /health's 200; *first*: the first
request's latency; *later*: the median latency of the others. The completions must be the same
in both modes.

    python benchmarks/bench_warmup.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import jax  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import (  # noqa: E402
    changed_flags,
    machine_line,
    out_parser,
    publish,
    require_at_least,
)
from jetspec_jax.data.prompts import read_prompts  # noqa: E402
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import COMPILED  # noqa: E402
from jetspec_jax.serving import BackgroundServer, ServerConfig  # noqa: E402

EVAL = ROOT.parent / "shared" / "data" / "eval" / "gsm8k_test.jsonl"
MODES = ("cold", "warmed up")
POOL = 40  # the first test prompts, of which `--requests` are picked by length


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--method", default="jetspec++", choices=("ar", "jetspec++"))
    parser.add_argument("--batch", type=int, default=4, help="max_batch_size (padded)")
    parser.add_argument("--reserve-prompt", type=int, default=256)
    parser.add_argument("--reserve-new", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    return parser


def serve_requests(target, draft, config: ServerConfig, prompts: list[str], max_tokens: int):
    """`(ready seconds, [latency per request], [completion per request])` of a fresh server."""
    COMPILED.clear()
    jax.clear_caches()
    start = time.perf_counter()
    with BackgroundServer(target, draft, config) as server:
        while httpx.get(server.url + "/health").status_code != 200:
            time.sleep(0.05)
        ready = time.perf_counter() - start
        latencies, texts = [], []
        for prompt in prompts:
            body = dict(
                model=config.model_name or "SmolLM2-135M-Instruct",
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                temperature=0,
            )
            sent = time.perf_counter()
            reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=1800)
            reply.raise_for_status()
            latencies.append(time.perf_counter() - sent)
            texts.append(reply.json()["choices"][0]["message"]["content"])
    return ready, latencies, texts


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--batch", "--requests", "--max-tokens")
    if args.requests > POOL:
        parser.error(f"--requests must be <= {POOL}, got {args.requests}")
    jax.config.update("jax_enable_compilation_cache", False)  # every mode compiles from scratch
    target = jetspec_jax.load_target()
    draft = None
    if args.method != "ar":
        draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    # Prompts of growing length: the requests fall into different prompt buckets.
    records = sorted(read_prompts(EVAL, limit=POOL), key=lambda r: len(r["prompt"]))
    step = max(len(records) // args.requests, 1)
    prompts = [records[i * step]["prompt"] for i in range(args.requests)]
    figures, completions = {}, {}
    for mode in MODES:
        config = ServerConfig(
            decoding=DecodingOptions(args.method),
            max_batch_size=args.batch,
            pad_batch=True,
            reserve_prompt_tokens=args.reserve_prompt,
            reserve_new_tokens=args.reserve_new,
            warmup=mode != "cold",
        )
        ready, latencies, completions[mode] = serve_requests(
            target, draft, config, prompts, args.max_tokens
        )
        figures[mode] = (ready, latencies[0], statistics.median(latencies[1:] or latencies))
        print(f"{mode}: ready {ready:.1f} s, latencies {[round(x, 2) for x in latencies]}")
    mismatches = [
        f"request {i}" for i, (a, b) in enumerate(zip(*completions.values(), strict=True)) if a != b
    ]
    lines = [
        "## Warming a server up (`benchmarks/bench_warmup.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_warmup.py{changed_flags(args, parser)}`",
        f"- Setup: default target (SmolLM2-135M-Instruct, float32), method {args.method}"
        + (" (the shipped draft, J0)" if args.method != "ar" else "")
        + f"; `BackgroundServer` with max_batch_size {args.batch} (padded), reserve "
        f"{args.reserve_prompt} prompt / {args.reserve_new} new tokens; compilation caches "
        f"empty at each start (persistent cache off); {len(prompts)} chat requests (GSM8K test "
        f"prompts of growing length), one after another, greedy, {args.max_tokens} tokens each. "
        "*ready*: start to /health 200; *first*: the first request's latency; *later*: median "
        "latency of the others. Completions equal in both modes: "
        + ("yes" if not mismatches else f"**no** ({len(mismatches)} differ)")
        + ".",
        "",
        "| mode | ready s | first request s | later requests s |",
        "|---|---:|---:|---:|",
    ]
    for mode, (ready, first, later) in figures.items():
        lines.append(f"| {mode} | {ready:.1f} | {first:.2f} | {later:.2f} |")
    (cold_ready, cold_first, _), (warm_ready, warm_first, _) = figures.values()
    lines += [
        "",
        f"Warmed up, the first request answered {cold_first / warm_first:.1f}x faster, after a "
        f"start {warm_ready - cold_ready:.1f} s longer.",
    ]
    return publish("warmup", "\n".join(lines) + "\n", args.out, mismatches)


if __name__ == "__main__":
    sys.exit(main())
