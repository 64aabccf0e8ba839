"""`DecodingOptions`: how a batch is decoded — the method, and JetSpec++'s refinement and
foresight.

One frozen value built by the public entry points (`generate`, `generate_batch`,
`generate_as_completed`, `stream`: from their `**decoding` keywords) and the server's config, and
handed as is to the scheduler and `DecodeSession`. It checks itself on construction (everything
that does not need the draft); the pairing with the draft is checked when the session builds its
proposer.
"""

from __future__ import annotations

import dataclasses

from jetspec_jax.decoding.outcomes import SELECTION_RULES
from jetspec_jax.decoding.refinement import check_replacement_confidence
from jetspec_jax.decoding.request_checks import check_int

METHODS = ("ar", "dflash", "jetspec", "jetspec++")
PIPELINES = ("spmd", "mpmd")
# Wide enough that a chunk's forward is efficient, narrow enough to bound a long prompt's
# activations (docs/BENCHMARKS.md, section `prefill_chunks`).
DEFAULT_PREFILL_CHUNK = 512
_JETSPEC_PP_ONLY = ("refine_passes", "refreshes", "foresight", "pipeline")


@dataclasses.dataclass(frozen=True)
class DecodingOptions:
    """How every row of a batch is decoded.

    Attributes:
        method: "ar" (autoregressive), or a speculative method matching the draft's variant:
            "dflash", "jetspec" or "jetspec++". Every method gives the same tokens as "ar" (greedy,
            and sampled with the same seed, up to floating-point differences between block and
            single-token forwards); they differ in how many target forwards they need.
        refine_passes: "jetspec++" only: J extra Jacobi refinement passes of the draft per round
            (J0 = one pass; at most the served block size - 1, `block_size` below if set, else
            the draft's: later passes change nothing, refused when the proposer is built).
        refreshes: "jetspec++" only: R <= J context refreshes with anchor replacement, one before
            each of the first R passes (`Jj-Rr`; needs a draft with an adapter).
        replacement_confidence: with refreshes only: anchor replacement trusts the proxy where
            the decoder's probability of its argmax exceeds this value in [0, 1] (0: the paper's
            rule, every disagreement replaced; 1: none, drafting as `Jj-R0`). None: the value
            the draft's calibration holds (0 without one).
        foresight: "jetspec++" only: B >= 1 turns foresight drafting on: while a block is
            verified, the next block is drafted for its B likely outcomes (k, a) from the
            adapter's predicted states (needs a draft with an adapter); a hit skips drafting on
            the critical path. 0 = off. Tokens are unchanged either way.
        foresight_rule: how the B outcomes are chosen: "calibrated" (the draft's calibration;
            with foresight on, a draft without one is refused when the session builds its
            proposer), "uncalibrated" or "geometric" (SSD's fixed fan-out).
        block_size: speculative methods only: K, positions per drafted block (the anchor and
            K-1 drafts), at least 2 and at most the draft's trained block size (checked when
            the session builds its proposer). Shorter blocks verify fewer positions per round,
            which is cheaper where the target's forward is compute-bound (a CPU, a large batch),
            and cap tau at K. Causal drafts only (JetSpec, JetSpec++: their first drafts are the
            full block's). None: the draft's trained block size.
        pipeline: run the foresight round pipelined over two devices, device 0 verifying while
            device 1 drafts ahead (needs foresight >= 1 and >= 2 visible devices): "spmd", one
            `shard_map` program, every device holding both stages (`decoding/pipeline.py`);
            "mpmd", one program per stage dispatched by the host, each device holding only its
            stage (`decoding/pipeline_mpmd.py`). None: the same round sequentially on one
            device.
        prefill_chunk: prompts longer than this many tokens are prefilled this many at a time,
            each chunk a forward against the cache the earlier ones filled
            (`decoding/prompt_chunks.py`): a long prompt's activation memory is bounded by the
            chunk, and one compiled prefill serves every long prompt of a session's context
            bucket. None: every prompt in one forward (one program per prompt-length bucket).

    Raises:
        ValueError: on construction, naming the bad value.
    """

    method: str = "ar"
    refine_passes: int = 0
    refreshes: int = 0
    foresight: int = 0
    foresight_rule: str = "calibrated"
    pipeline: str | None = None
    replacement_confidence: float | None = None
    block_size: int | None = None
    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; available: {', '.join(METHODS)}")
        for name in ("refine_passes", "refreshes", "foresight"):
            # As plain ints: the counts reach the proposer, a static jit argument.
            object.__setattr__(self, name, check_int(name, getattr(self, name), 0))
        if self.prefill_chunk is not None:
            chunk = check_int("prefill_chunk", self.prefill_chunk, 1)
            object.__setattr__(self, "prefill_chunk", chunk)
        if self.block_size is not None:
            object.__setattr__(self, "block_size", check_int("block_size", self.block_size, 2))
            if self.method == "ar":
                raise ValueError(
                    "block_size sizes a speculative method's drafted blocks; method 'ar' drafts "
                    "none"
                )
        if self.pipeline is not None and self.pipeline not in PIPELINES:
            raise ValueError(
                f"pipeline must be None or one of {', '.join(map(repr, PIPELINES))}, got "
                f"{self.pipeline!r}"
            )
        if self.foresight_rule not in SELECTION_RULES:
            raise ValueError(
                f"foresight_rule must be one of {', '.join(SELECTION_RULES)}, got "
                f"{self.foresight_rule!r}"
            )
        used = [name for name in _JETSPEC_PP_ONLY if getattr(self, name) not in (0, None)]
        if used and self.method != "jetspec++":
            raise ValueError(
                f"{', '.join(used)} apply to method 'jetspec++' only, not {self.method!r}"
            )
        if self.refreshes > self.refine_passes:
            raise ValueError(
                f"refreshes must be in [0, refine_passes={self.refine_passes}] (one refresh "
                f"before each of the first R passes), got {self.refreshes}"
            )
        if self.replacement_confidence is not None:
            # The value first: a user told to add refreshes should not learn it is wrong after.
            confidence = check_replacement_confidence(self.replacement_confidence)
            if not self.refreshes:
                raise ValueError(
                    "replacement_confidence applies to context refreshes: set refreshes >= 1"
                )
            object.__setattr__(self, "replacement_confidence", confidence)
        if self.foresight_rule != "calibrated" and not self.foresight:
            raise ValueError(
                f"foresight_rule={self.foresight_rule!r} chooses foresight's candidate blocks: "
                "set foresight >= 1"
            )
        if self.pipeline is not None and not self.foresight:
            raise ValueError(
                "a pipeline drafts ahead on the second device: set foresight >= 1 (candidate "
                "blocks per round)"
            )
