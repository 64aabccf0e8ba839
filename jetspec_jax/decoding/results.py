"""What a decoded prompt gives back: `GenerationResult` (tokens, acceptance lengths, finish reason,
foresight statistics) and `Timing`, and how they are read from a batch's decode state."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import jax
import numpy as np

from jetspec_jax.decoding.foresight import ForesightState
from jetspec_jax.decoding.speculative import SpecState


@dataclasses.dataclass(frozen=True)
class Timing:
    """Wall-clock seconds of one batch (shared by its rows); compilation is counted apart.

    Attributes:
        prefill_seconds: the prompts' forward and the first token.
        decode_seconds: the decode loop, first token excluded (all chunks together).
        compile_seconds: compiling executables for new shape buckets (0 when all were cached).
    """

    prefill_seconds: float
    decode_seconds: float
    compile_seconds: float


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """The outcome of one prompt.

    Attributes:
        tokens: the generated token ids (a final stop token included).
        acceptance_lengths: tokens committed by each target forward that produced tokens for this
            prompt, the prefill's first token included; sums to `len(tokens)`. All 1 for "ar".
        finish_reason: "stop" (a stop token was generated), "length" (max_new_tokens reached),
            "cancelled" (`DecodeSession.cancel` stopped it early), or None while the row is still
            decoding (`DecodeSession.results` read before it finished).
        prompt_length: number of prompt tokens.
        timing: wall-clock times of the batch this prompt ran in.
        outcomes: speculative methods: `(k, a)` of every verification round (k drafts accepted,
            bonus token a); empty for "ar". The last round's, when a stop token or the budget cut
            it, may name more tokens than were committed.
        foresight_hits: with foresight, whether each verification round's block came from the
            foresight cache (the first round never does); empty without foresight.
        foresight_occupancy: with foresight, the candidate blocks cached when each round began.
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    finish_reason: str | None
    prompt_length: int
    timing: Timing
    outcomes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    foresight_hits: list[bool] = dataclasses.field(default_factory=list)
    foresight_occupancy: list[int] = dataclasses.field(default_factory=list)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verification round (the prefill's first token excluded;
        1.0 when that token is the only one, 0.0 with none). A last round cut by a stop token or
        the budget counts what it committed, so this reads slightly below the paper's mean of
        accepted + 1 (`outcomes` holds each round's k)."""
        rounds = self.acceptance_lengths[1:] or self.acceptance_lengths
        return float(np.mean(rounds)) if rounds else 0.0

    @property
    def foresight_hit_rate(self) -> float:
        """The fraction of verification rounds after the first whose block was a foresight hit
        (the first round has nothing drafted ahead; 0 without foresight)."""
        return pooled_hit_rate([self])

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens after the first, per second of the decode loop."""
        n, seconds = len(self.tokens) - 1, self.timing.decode_seconds
        return n / seconds if n > 0 and seconds > 0 else 0.0


def pooled_hit_rate(results: Iterable[GenerationResult]) -> float:
    """Foresight hits over the rounds that could hit, pooled across results: each prompt's
    rounds after its first (0.0 when there are none, as without foresight)."""
    hits = chances = 0
    for result in results:
        hits += sum(result.foresight_hits[1:])
        chances += max(len(result.foresight_hits) - 1, 0)
    return hits / chances if chances else 0.0


def row_outputs(state, rows: int | slice) -> dict[str, jax.Array]:
    """The arrays a `GenerationResult` is read from, at `rows` of the batch (device arrays; the
    caches stay on the device): one row (an int in range), or a slice of rows."""
    decode = state.decode if isinstance(state, SpecState) else state
    outputs = {
        "output": decode.output,
        "num_generated": decode.num_generated,
        "done": decode.done,
        "round_lengths": decode.round_lengths,
        "num_rounds": decode.num_rounds,
    }
    if isinstance(state, SpecState):
        outputs["verify_rounds"] = state.num_verify_rounds
        outputs["accepted"] = state.accepted
        outputs["bonus"] = state.bonus
        if isinstance(state.proposer, ForesightState):
            outputs["foresight_rounds"] = state.proposer.num_rounds
            outputs["hits"] = state.proposer.hits
            outputs["occupancy"] = state.proposer.occupancy
    if isinstance(rows, slice):
        return {name: x[rows] for name, x in outputs.items()}
    # One program per placement (the MPMD pipeline keeps the proposer's outputs on the other
    # device), not an eager slice per array: `ContinuousBatch.take_finished` reads every
    # finished row so at each chunk boundary, and the eager slices (one dispatch each: AR's five
    # arrays, speculative decoding's eight) took 4-12x the one program's time on a CPU.
    placements: dict = {}
    for name, x in outputs.items():
        placements.setdefault(x.sharding, {})[name] = x
    row = np.int32(rows)
    return {name: x for same in placements.values() for name, x in _row_of(same, row).items()}


@jax.jit
def _row_of(outputs: dict[str, jax.Array], row: jax.Array) -> dict[str, jax.Array]:
    """Row `row` (a scalar in range) of each `[B, ...]` array of `outputs`."""
    return {name: x[row] for name, x in outputs.items()}


def row_result(row: dict, prompt_length, stops, timing, cancelled) -> GenerationResult:
    """The `GenerationResult` of one row's host outputs (`row_outputs` at that row)."""
    tokens = row["output"][: int(row["num_generated"])].tolist()
    outcomes, hits, occupancy = [], [], []
    if "foresight_rounds" in row:
        rounds = int(row["foresight_rounds"])
        hits = row["hits"][:rounds].tolist()
        occupancy = row["occupancy"][:rounds].tolist()
    if "verify_rounds" in row:
        rounds = int(row["verify_rounds"])
        accepted, bonus = row["accepted"][:rounds].tolist(), row["bonus"][:rounds].tolist()
        outcomes = list(zip(accepted, bonus, strict=True))
    if tokens and tokens[-1] in stops:
        reason = "stop"
    elif cancelled:
        reason = "cancelled"
    else:
        reason = "length" if bool(row["done"]) else None
    return GenerationResult(
        tokens=tokens,
        acceptance_lengths=row["round_lengths"][: int(row["num_rounds"])].tolist(),
        finish_reason=reason,
        prompt_length=prompt_length,
        timing=timing,
        outcomes=outcomes,
        foresight_hits=hits,
        foresight_occupancy=occupancy,
    )
