"""Load test of a running server: requests/s and latency percentiles at several concurrencies.

    python -m jetspec_jax.bench.load --url http://127.0.0.1:8000 --model NAME \\
        --concurrency 1,4,16 --requests 32 --max-tokens 64 [--prompts FILE] [--api-key KEY]

Each level sends a fixed number of streamed chat (or `--completions`) requests from that many
client threads, greedy, and measures per request the latency (send → last byte) and the time to
first token; totals give requests/s and generated tokens/s. The loop is bounded: exactly
`--requests` requests per level, each with a timeout.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import itertools
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

from jetspec_jax.console import escape_what_stdout_cannot_encode, reader_may_leave


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """One concurrency level. Latencies in seconds; `errors` counts failed requests (a non-200
    answer, an error event in the stream, or a network error: timeout, refused, dropped)."""

    concurrency: int
    requests: int
    errors: int
    seconds: float
    requests_per_second: float
    tokens_per_second: float
    latency_p50: float
    latency_p99: float
    ttft_p50: float
    ttft_p99: float


def run_load(
    url: str,
    model: str,
    prompts: Sequence[str],
    *,
    concurrency: int,
    requests: int,
    max_tokens: int = 64,
    api_key: str | None = None,
    chat: bool = True,
    timeout: float = 600.0,
    warmup: int = 0,
) -> LoadResult:
    """Sends `requests` streamed requests (prompts in turn) from `concurrency` threads, after
    `warmup` untimed ones at the same concurrency (they compile the server's shape buckets).
    Time to first token runs to the first event with text (the request's whole time if none)."""
    import httpx

    if concurrency < 1 or requests < 1:
        raise ValueError("concurrency and requests must be >= 1")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if not prompts:
        raise ValueError("no prompts to send")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    path = "/v1/chat/completions" if chat else "/v1/completions"
    bodies = []  # the timed requests' and the warm-up's, which may be more
    for prompt in itertools.islice(itertools.cycle(prompts), max(requests, warmup)):
        body = dict(model=model, max_tokens=max_tokens, temperature=0, stream=True)
        body["stream_options"] = {"include_usage": True}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        bodies.append(body)
    limits = httpx.Limits(max_connections=concurrency)
    with httpx.Client(base_url=url, headers=headers, timeout=timeout, limits=limits) as client:
        if warmup:
            with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(lambda b: _one(client, path, b), bodies[:warmup]))
        start = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
            outcomes = list(pool.map(lambda b: _one(client, path, b), bodies[:requests]))
        seconds = time.perf_counter() - start
    ok = [o for o in outcomes if not isinstance(o, str)]
    failures = collections.Counter(o for o in outcomes if isinstance(o, str))
    for reason, count in failures.most_common():
        print(
            f"warning: {count} of {requests} requests at concurrency {concurrency} failed: "
            f"{reason}",
            file=sys.stderr,
        )
    latency = [o[0] for o in ok] or [float("nan")]
    ttft = [o[1] for o in ok] or [float("nan")]
    tokens = sum(o[2] for o in ok)
    return LoadResult(
        concurrency=concurrency,
        requests=requests,
        errors=requests - len(ok),
        seconds=seconds,
        requests_per_second=len(ok) / seconds,
        tokens_per_second=tokens / seconds,
        latency_p50=float(np.percentile(latency, 50)),
        latency_p99=float(np.percentile(latency, 99)),
        ttft_p50=float(np.percentile(ttft, 50)),
        ttft_p99=float(np.percentile(ttft, 99)),
    )


def _one(client, path: str, body: dict) -> tuple[float, float, int] | str:
    """`(latency, time to first token, completion tokens)`, or why the request failed.

    A network error or a malformed event is a failed request like an error answer: one timeout or
    cut stream under load must not abort the level (and lose its other measurements).
    """
    import httpx

    sent = time.perf_counter()
    first = None
    tokens = 0
    try:
        with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                response.read()
                return f"HTTP {response.status_code}"
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return "an error event in the stream"
                if first is None and _has_text(event):
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    except (ValueError, KeyError, TypeError) as e:  # not JSON, or no usage.completion_tokens
        return f"a malformed event in the stream ({type(e).__name__}: {e})"
    done = time.perf_counter()
    return done - sent, (first or done) - sent, tokens


def _has_text(event: dict) -> bool:
    """Whether a stream event carries generated text. Not the chat stream's first chunk: the
    server sends that (the role, no content) with its first keep-alive while a request still
    waits, so timing it would take a queued request's wait out of its time to first token."""
    for choice in event.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


def markdown(results: Sequence[LoadResult]) -> str:
    """The results as a markdown table, one row per concurrency."""
    lines = [
        "| clients | requests | errors | req/s | tokens/s | p50 latency s | p99 latency s "
        "| p50 TTFT s | p99 TTFT s |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.concurrency} | {r.requests} | {r.errors} | {r.requests_per_second:.2f} "
            f"| {r.tokens_per_second:.1f} | {r.latency_p50:.3f} | {r.latency_p99:.3f} "
            f"| {r.ttft_p50:.3f} | {r.ttft_p99:.3f} |"
        )
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m jetspec_jax.bench.load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the served model id (GET /v1/models)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts")
    parser.add_argument("--requests", type=int, default=32, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default=None, help="JSONL prompt file (default: built in)")
    parser.add_argument("--limit", type=int, default=64, help="prompts read from --prompts")
    parser.add_argument("--completions", action="store_true", help="raw /v1/completions")
    parser.add_argument(
        "--warmup", type=int, default=0, help="untimed requests per level first (compilation)"
    )
    parser.add_argument("--out", default=None, help="also append the results to this JSONL file")
    return parser


def main(argv: list[str] | None = None) -> int:
    """The load test's command line; returns the exit status."""
    escape_what_stdout_cannot_encode()  # not a UnicodeEncodeError mid-output
    args = _parser().parse_args(argv)
    from jetspec_jax.data.prompts import read_prompts

    try:
        import httpx  # noqa: F401  (the load test's client, not a core dependency)
    except ImportError as e:
        print(f'error: the load test needs httpx ({e}); pip install -e ".[bench]"', file=sys.stderr)
        return 2

    try:
        try:
            levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
        except ValueError:  # int()'s own message would name no flag
            levels = []
        if not levels or min(levels) < 1:  # all checked before the first level runs
            raise ValueError(f"--concurrency {args.concurrency!r}: levels must be integers >= 1")
        for flag, value, least in (
            ("--requests", args.requests, 1),
            ("--max-tokens", args.max_tokens, 1),
            ("--limit", args.limit, 1),
            ("--warmup", args.warmup, 0),
        ):
            if value < least:
                raise ValueError(f"{flag} must be >= {least}, got {value}")
        # Found now, not after the whole load test.
        if args.out and (
            os.path.isdir(args.out) or not os.path.isdir(os.path.dirname(args.out) or ".")
        ):
            raise ValueError(f"--out {args.out}: not a file path in an existing directory")
        if args.out:  # and what only opening it tells (a dangling symlink, no permission)
            try:
                open(args.out, "a", encoding="utf-8").close()
            except OSError as e:
                raise ValueError(
                    f"--out {args.out}: cannot append to it ({e.strerror or e})"
                ) from e
        prompts = (
            [r["prompt"] for r in read_prompts(args.prompts, limit=args.limit)]
            if args.prompts
            else ["Explain speculative decoding.", "What is 2 + 2?", "Write a haiku about JAX."]
        )
        if not prompts:
            raise ValueError(f"--prompts {args.prompts} holds no prompts")
        results = [
            run_load(
                args.url,
                args.model,
                prompts,
                concurrency=level,
                requests=args.requests,
                max_tokens=args.max_tokens,
                api_key=args.api_key,
                chat=not args.completions,
                warmup=args.warmup,
            )
            for level in levels
        ]
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with reader_may_leave():  # `| head`: --out is written all the same
        print(markdown(results), end="", flush=True)
    if args.out:
        try:
            with open(args.out, "a", encoding="utf-8") as f:
                for r in results:
                    f.write(json.dumps(dataclasses.asdict(r)) + "\n")
        except OSError as e:  # a full disk, say: the table above still holds the results
            print(f"error: --out {args.out}: not written ({e.strerror or e})", file=sys.stderr)
            return 2
    return 0 if not any(r.errors for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
