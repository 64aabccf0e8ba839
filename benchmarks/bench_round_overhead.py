"""Does the jitted speculative loop add host overhead? Per-round time vs the sum of its parts.

On a tiny random Qwen3 target (made with transformers, as in the tests) and a random JetSpec++
draft (block 16), batch 1, greedy:
  - loop: `decode_speculative` running R rounds in one call, wall time / R;
  - parts: the same round's pieces as separately jitted calls, each timed to completion: draft
    (propose), verify (target forward over the block + acceptance), observe (draft context extend).
If the loop adds no host round trips, loop / sum(parts) <= 1 (it also saves the parts' dispatches).

    python benchmarks/bench_round_overhead.py     # needs the test extra (torch, transformers)
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jetspec_jax  # noqa: E402
from benchmarks.report import machine_line, out_parser, write_section  # noqa: E402
from jetspec_jax.decoding.speculative import decode_speculative, prefill_speculative  # noqa: E402
from jetspec_jax.decoding.state import Requests  # noqa: E402
from jetspec_jax.decoding.verify import verify_chain  # noqa: E402
from jetspec_jax.models.transformer import forward, unembed  # noqa: E402
from jetspec_jax.sampling import RowSampling, SamplingParams  # noqa: E402
from tests.tiny_models import CheckpointFactory  # noqa: E402

ROUNDS, REPEATS, BLOCK = 64, 7, 16


def _parser() -> argparse.ArgumentParser:
    return out_parser(__doc__.split("\n\n")[0])


def main() -> None:
    args = _parser().parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target = jetspec_jax.load_target(CheckpointFactory(pathlib.Path(tmp)).get("qwen3")[0])
    draft = jetspec_jax.init_draft(target, variant="jetspec++", block_size=BLOCK, seed=0)
    proposer, dparams = draft.proposer(target, method="jetspec++")
    cfg, tparams = target.config, target.params
    requests = Requests(
        max_new_tokens=jnp.asarray([4 * ROUNDS]),
        stop_token_ids=jnp.asarray([[-1]]),
        sampling=RowSampling.from_params([SamplingParams()]),
    )
    prompt = jnp.arange(32, dtype=jnp.int32)[None] % cfg.vocab_size
    static = dict(config=cfg, proposer=proposer, capacity=512, max_output=256)
    fresh = lambda: prefill_speculative(  # noqa: E731
        tparams, dparams, prompt, jnp.asarray([32]), requests, **static
    )

    loop_times = []
    for _ in range(REPEATS):
        state = jax.block_until_ready(fresh())
        start = time.perf_counter()
        state = jax.block_until_ready(
            decode_speculative(
                tparams, dparams, state, requests, jnp.int32(ROUNDS), config=cfg, proposer=proposer
            )
        )
        rounds = int(state.num_verify_rounds[0])
        loop_times.append((time.perf_counter() - start) / rounds)
    # (The first repeat includes compilation; the median discards it.)

    state = jax.block_until_ready(fresh())
    d = state.decode

    @jax.jit
    def draft_part(pstate, anchor, pos, sequence):
        return proposer.propose(dparams, tparams, pstate, anchor, pos, sequence)[0]

    @jax.jit
    def verify_part(cache, anchor, drafts):
        block = jnp.concatenate([anchor[:, None], drafts], axis=1)
        out = forward(tparams, cfg, block, cache, tap_layers=proposer.tap_layers)
        accepted, tokens = verify_chain(
            unembed(tparams, cfg, out.hidden), drafts, requests.sampling, cache.lengths
        )
        return accepted, tokens, out.taps, out.cache

    @jax.jit
    def observe_part(pstate, block, taps, n):
        return proposer.observe(dparams, tparams, pstate, block, taps, n)

    def timed(fn, *args):
        times = []
        for _ in range(REPEATS * 4):
            start = time.perf_counter()
            out = jax.block_until_ready(fn(*args))
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:]), out

    t_draft, drafts = timed(
        draft_part, state.proposer, d.last_token, d.cache.lengths, state.sequence
    )
    t_verify, (accepted, _, taps, _) = timed(verify_part, d.cache, d.last_token, drafts)
    block = jnp.concatenate([d.last_token[:, None], drafts], axis=1)
    t_observe, _ = timed(observe_part, state.proposer, block, taps, accepted + 1)
    loop = statistics.median(loop_times)
    parts = t_draft + t_verify + t_observe
    body = "\n".join(
        [
            "## Speculative round: jitted loop vs the sum of its parts",
            "",
            f"- Machine: {machine_line()}",
            "- Command: `python benchmarks/bench_round_overhead.py`",
            f"- Setup: tiny random Qwen3 target (3 layers, hidden 64), random JetSpec++ draft "
            f"(1 layer, block {BLOCK}), batch 1, greedy; loop = {ROUNDS} rounds in one "
            f"`decode_speculative` call (median of {REPEATS}); parts = separately jitted calls, "
            "each timed to completion (medians).",
            "",
            "| | ms per round |",
            "|---|---:|",
            f"| draft (propose) | {1e3 * t_draft:.3f} |",
            f"| verify (block forward + acceptance) | {1e3 * t_verify:.3f} |",
            f"| observe (draft context extend) | {1e3 * t_observe:.3f} |",
            f"| **sum of parts** | **{1e3 * parts:.3f}** |",
            f"| **jitted loop, per round** | **{1e3 * loop:.3f}** |",
            f"| ratio loop / parts | {loop / parts:.2f} |",
        ]
    )
    print(body)
    write_section("bench_round_overhead", body, args.out)


if __name__ == "__main__":
    main()
