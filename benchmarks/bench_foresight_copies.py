"""The single-device foresight loop as it is (`decode_foresight`) against as it was, in whole-cache
copies and time per round.

As it was, each round observed its verified block at its own end: drafting ahead reads the draft's,
the adapter's and the decoder's caches, which the observation then writes, with nothing it writes
depending on what was read, so XLA copied each of the six caches (keys and values) twice per round.
And a miss round's fallback ran in a `lax.cond`, whose branch wrote its refreshes' rows into copies
of the draft's and the decoder's caches. Now the loop observes a round's block at the start of the
next round, where the loop's own order puts the reads first, and the fallback runs in a loop of
zero or one trip, which updates its carry in place. The loop as it was is rebuilt here from the
same pieces (`foresight_round`, `observe`, the fallback in a `lax.cond`); both must give the same
tokens, outcomes and hits (checked).

The default target (SmolLM2-135M-Instruct, float32) with the shipped draft, adapter and
calibration, on this CPU: J0 and J3-R3 with foresight B = 4 (rule "calibrated"), batch 1 and 4,
a 300-token prompt and a budget that makes a cache of about 4.5k slots (the copies are of whole
caches; the attention reads only the filled span). Per setting: whole-cache copies in each compiled
loop, and ms per round over `ROUNDS` rounds after the prefill (median of `REPEATS` runs from one
prefilled state, the two loops alternating, compilation excluded).

    python benchmarks/bench_foresight_copies.py
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
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
from benchmarks.report import machine_line, out_parser, write_section  # noqa: E402
from jetspec_jax.decoding.foresight import (  # noqa: E402
    ForesightProposer,
    decode_foresight,
    foresight_round,
)
from jetspec_jax.decoding.options import DecodingOptions  # noqa: E402
from jetspec_jax.decoding.session import DecodeSession  # noqa: E402
from jetspec_jax.decoding.speculative import run_rounds  # noqa: E402
from tests.compiled_hlo import copies_shaped_like  # noqa: E402

SETTINGS = ((0, 0), (3, 3))  # (J, R)
BATCHES, BUDGET = (1, 4), 3700
FORESIGHT, PROMPT, ROUNDS, REPEATS = 4, 300, 16, 5


@dataclasses.dataclass(frozen=True)
class CondFallback(ForesightProposer):
    """The fallback as it was: in a `lax.cond`."""

    def propose_with_hits(
        self, params, target_params, state, anchor, anchor_positions, sequence, active=None
    ):
        hit, cached = self.lookup(state, anchor)
        need = ~hit if active is None else (~hit & active)

        def fallback():
            drafts, refiner = self.refiner.propose(
                params, target_params, state.refiner, anchor, anchor_positions, sequence
            )
            return jnp.where(hit[:, None], cached, drafts), refiner

        drafts, refiner = jax.lax.cond(jnp.any(need), fallback, lambda: (cached, state.refiner))
        return drafts, hit, state.replace(refiner=refiner)


@functools.partial(jax.jit, static_argnames=("config", "proposer"), donate_argnames=("state",))
def loop_as_it_was(params, proposer_params, state, requests, max_rounds, *, config, proposer):
    """Every round observes its own block at its end; the fallback in a `lax.cond`."""
    proposer = CondFallback(**vars(proposer))

    def one_round(s):
        s, seen = foresight_round(params, proposer_params, s, requests, config, proposer)
        return s.replace(proposer=proposer.observe(proposer_params, params, s.proposer, *seen))

    return run_rounds(one_round, state, max_rounds)


LOOPS = {"before": loop_as_it_was, "now": decode_foresight}


def _parser() -> argparse.ArgumentParser:
    return out_parser(__doc__.split("\n")[0])


def measure(target, draft, passes, refreshes, batch) -> dict:
    """Per loop: copies, ms per round, and the results (tokens, hits) of its timed rounds."""
    rng = np.random.default_rng(batch)
    prompts = [rng.integers(0, target.config.vocab_size, PROMPT).tolist() for _ in range(batch)]
    options = DecodingOptions("jetspec++", passes, refreshes, foresight=FORESIGHT)
    session = DecodeSession(
        target, prompts, draft=draft, options=options, max_new_tokens=BUDGET, stop_token_ids=[]
    )
    session.start()
    start_state = session._state  # private: the loop's carry is what this benchmark is about
    static = dict(config=target.config, proposer=session._proposer)
    args = (target.params, session._proposer_params)
    refiner = start_state.proposer.refiner
    shapes = {x.shape for x in jax.tree.leaves(refiner) if session._capacity in x.shape}
    rounds = jnp.int32(ROUNDS)
    compiled, samples, results = {}, {name: [] for name in LOOPS}, {}
    for name, fn in LOOPS.items():  # lowering reads shapes only: no buffer is donated
        compiled[name] = fn.lower(*args, start_state, session._requests, rounds, **static).compile()
    for _ in range(REPEATS):
        for name, run in compiled.items():
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, start_state))
            begin = time.perf_counter()
            state = jax.block_until_ready(run(*args, fresh, session._requests, rounds))
            samples[name].append(1e3 * (time.perf_counter() - begin) / ROUNDS)
            results[name] = jax.device_get(
                (state.decode.output, state.accepted, state.proposer.hits)
            )
    first, *rest = results.values()
    for other in rest:  # the same tokens, outcomes and hits, either loop
        assert all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))
    return {
        name: (
            len(copies_shaped_like(compiled[name].as_text(), shapes)),
            statistics.median(samples[name]),
        )
        for name in LOOPS
    } | {"capacity": session._capacity}


def main() -> None:
    args = _parser().parse_args()
    target = jetspec_jax.load_target()
    draft = jetspec_jax.load_draft(jetspec_jax.default_draft_dir(), target)
    before, now = LOOPS
    lines = [
        "## Foresight's single-device loop: whole-cache copies and time per round "
        "(`benchmarks/bench_foresight_copies.py`)",
        "",
        "*Before*: each round observes its own block at its end, and a miss round's fallback "
        "runs in a `lax.cond`; *now* (`decode_foresight`): each round's block is observed at the "
        "start of the next round, and the fallback runs in a loop of zero or one trip. "
        f"{machine_line()}. Default target (SmolLM2-135M-Instruct, float32) with the shipped "
        f"draft, adapter and calibration, foresight B = {FORESIGHT} (rule calibrated), "
        f"{PROMPT}-token random prompts, greedy. Copies: `copy` ops in the compiled loop shaped "
        f"as a whole draft, adapter or decoder cache. ms per round over {ROUNDS} rounds from one "
        f"prefilled state (median of {REPEATS} runs, the two loops alternating; compilation "
        "excluded); the two loops gave the same tokens, outcomes and hits (checked). A copy "
        "costs the same whatever the round computes, so next to this CPU's slow forwards the "
        "copies are close to the run-to-run noise; what they cost where forwards are fast (a "
        "GPU) is not measured here.",
        "",
        "| setting | batch | cache slots | copies before | copies now | ms/round before | "
        "ms/round now | speedup |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for passes, refreshes in SETTINGS:
        for batch in BATCHES:
            got = measure(target, draft, passes, refreshes, batch)
            (copies_b, ms_b), (copies_n, ms_n) = got[before], got[now]
            line = (
                f"| J{passes}-R{refreshes} F{FORESIGHT} | {batch} | {got['capacity']} | "
                f"{copies_b} | {copies_n} | {ms_b:.1f} | {ms_n:.1f} | {ms_b / ms_n:.2f}x |"
            )
            print(line, flush=True)
            lines.append(line)
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("bench_foresight_copies", body, args.out)


if __name__ == "__main__":
    main()
