"""What top-k / top-p filtering costs per decode step, and what sampling costs end to end.

On the default model (SmolLM2-135M-Instruct, vocabulary 49152), with its logits at the positions
of greedy continuations of GSM8K test prompts:
  - how often the cut-off lies among the 256 largest logits (`sampling.CUT_CANDIDATES`), so that
    `filter_logits` needs no sort of the vocabulary;
  - the filter's time per call at the shapes of an AR step `[1, 1, V]` and of a verification round
    `[1, 16, V]`, cut-off among the candidates (the default) vs the full sort (`candidates=V`,
    the only path before the candidates existed);
  - decode tokens/s, greedy vs sampled (temperature 0.8, top-p 0.95), for AR and the shipped
    JetSpec++ draft (J0), side by side in one run.

    python benchmarks/bench_sampling.py [--num-prompts 4] [--max-new-tokens 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import machine_line, require_at_least, write_section  # noqa: E402
from jetspec_jax.bench.datasets import load_dataset  # noqa: E402
from jetspec_jax.sampling import CUT_CANDIDATES, filter_logits  # noqa: E402

SETTINGS = [(0.8, 0, 0.95), (1.0, 0, 0.9), (1.0, 50, 1.0), (1.0, 0, 0.99)]
REPEATS = 15


def _median_ms(fn, *args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def _complete_fraction(logits: jax.Array, temperature: float, top_k: int, top_p: float) -> float:
    """The share of positions whose kept set lies among the CUT_CANDIDATES largest logits."""
    everything = filter_logits(
        logits[None],
        jnp.asarray([temperature]),
        jnp.asarray([top_k]),
        jnp.asarray([top_p]),
        candidates=logits.shape[-1],
    )[0]
    kept = np.isfinite(np.asarray(everything)).sum(-1)
    return float(np.mean(kept <= CUT_CANDIDATES))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    require_at_least(parser, args, 1, "--num-prompts", "--max-new-tokens")

    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    path = ROOT.parent / "shared" / "data" / "eval" / "gsm8k_test.jsonl"
    prompts = load_dataset(path, target.tokenizer, limit=args.num_prompts).prompts

    # Real logits: the target's at every position of its own greedy continuations.
    greedy = jetspec_jax.generate_batch(target, prompts, max_new_tokens=args.max_new_tokens)
    logits = jnp.concatenate(
        [
            target.logits([p + r.tokens])[0, len(p) - 1 : -1]
            for p, r in zip(prompts, greedy, strict=True)
        ]
    )  # [positions, V]
    vocab = logits.shape[-1]
    shares = {s: _complete_fraction(logits, *s) for s in SETTINGS}

    t, k, p = SETTINGS[0]
    params = (jnp.asarray([t]), jnp.asarray([k]), jnp.asarray([p]))
    filter_ms = {}
    for rows in (1, 16):
        x = logits[None, :rows]
        for label, candidates in (("candidates", CUT_CANDIDATES), ("sort", vocab)):
            fn = jax.jit(lambda x, c=candidates: filter_logits(x, *params, candidates=c))
            filter_ms[rows, label] = _median_ms(fn, x)

    sampled = jetspec_jax.SamplingParams(temperature=t, top_p=p, seed=0)
    speed, tau = {}, {}
    for method, used in (("ar", None), ("jetspec++", draft)):
        for label, sampling in (("greedy", jetspec_jax.SamplingParams()), ("sampled", sampled)):
            for _ in range(2):  # the first run compiles; keep the second
                results = [
                    jetspec_jax.generate_batch(
                        target,
                        [prompt],
                        draft=used,
                        method=method,
                        max_new_tokens=args.max_new_tokens,
                        # prompt i draws with seed i: one seed would give every prompt the same
                        # draws at each position
                        sampling=dataclasses.replace(sampling, seed=i),
                    )[0]
                    for i, prompt in enumerate(prompts)
                ]
            rates = [r.decode_tokens_per_second for r in results]
            speed[method, label] = statistics.median(rates)
            tau[method, label] = float(np.mean([r.tau for r in results]))
            print(method, label, f"{speed[method, label]:.1f} tok/s", flush=True)

    lines = [
        "## Sampling: top-k / top-p cut-off among 256 candidates instead of a vocabulary sort",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_sampling.py --num-prompts {args.num_prompts} "
        f"--max-new-tokens {args.max_new_tokens}`",
        f"- Setup: the default model (V = {vocab}); logits at the {logits.shape[0]} positions of "
        f"its greedy continuations of the first {args.num_prompts} GSM8K test prompts; medians "
        f"of {REPEATS} calls.",
        "",
        "Positions whose kept set lies among the 256 largest logits (no sort needed):",
        "",
        "| temperature | top-k | top-p | share |",
        "|---:|---:|---:|---:|",
        *(f"| {t_} | {k_} | {p_} | {shares[t_, k_, p_]:.3f} |" for t_, k_, p_ in SETTINGS),
        "",
        f"`filter_logits` per call (temperature {t}, top-p {p}), ms:",
        "",
        "| shape | cut-off among candidates | full sort (before) | ratio |",
        "|---|---:|---:|---:|",
    ]
    for rows, what in ((1, "AR step"), (16, "verification round")):
        fast, slow = filter_ms[rows, "candidates"], filter_ms[rows, "sort"]
        lines.append(f"| [1, {rows}, V] ({what}) | {fast:.2f} | {slow:.2f} | {slow / fast:.0f}x |")
    lines += [
        "",
        f"Decode tokens/s, median over the prompts, {args.max_new_tokens} new tokens, batch 1 "
        f"(sampled: temperature {t}, top-p {p}; J0 = the shipped draft; tau: mean of per-prompt "
        "tau):",
        "",
        "| method | greedy | sampled | sampled / greedy | tau greedy | tau sampled |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for method, name in (("ar", "AR"), ("jetspec++", "JetSpec++ J0")):
        g, s = speed[method, "greedy"], speed[method, "sampled"]
        taus = f"{tau[method, 'greedy']:.2f} | {tau[method, 'sampled']:.2f}"
        lines.append(f"| {name} | {g:.1f} | {s:.1f} | {s / g:.2f} | {taus} |")
    body = "\n".join(lines)
    print(body)
    write_section("bench_sampling", body)


if __name__ == "__main__":
    main()
