"""The hybrid target's rollback after a verification: over the block's positions only
(`HybridCache.rolled_back(..., appended=K)`, what `verify_block` runs) against the whole rollback
window (W = 32 positions, what it ran before).

A rollback needs no weights, only the cache: a `HybridCache` shaped for the Qwen3.5-0.8B-like
linear layers below (18 Gated DeltaNet layers, 16 key and value heads of 128, conv window 4),
its window filled as a forward of K positions leaves it (random recurrence inputs in the first K
positions, zeros after), each row kept to a random prefix of the block. Both forms give the same
states (checked first); median of `--repeats` timed calls each, side by side, alternating, after
one that compiles.

    python benchmarks/bench_hybrid_rollback.py
"""

from __future__ import annotations

import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.report import (  # noqa: E402
    changed_flags,
    int_list,
    machine_line,
    out_parser,
    require_at_least,
    write_section,
)
from jetspec_jax.checkpoint.hf_config import config_from_hf  # noqa: E402
from jetspec_jax.models.hybrid_cache import ROLLBACK_WINDOW, HybridCache  # noqa: E402

LINEAR_LAYERS = 18
HF_CONFIG = dict(
    model_type="qwen3_5_text",
    vocab_size=1024,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 6,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    partial_rotary_factor=0.25,
    rope_parameters=dict(rope_type="default", rope_theta=10000000.0),
)


def _parser():
    parser = out_parser(__doc__.split("\n")[0])
    parser.add_argument("--blocks", default="4,8,16", help="verification block sizes K")
    parser.add_argument("--batches", default="1,8", help="batch sizes")
    parser.add_argument("--repeats", type=int, default=10)
    return parser


def verified_cache(config, batch: int, block: int, seed: int) -> HybridCache:
    """A cache as a forward of `block` positions leaves it: the window's first `block`
    positions hold recurrence inputs (keys normalised, decays and strengths in range)."""
    rng = np.random.default_rng(seed)
    cache = HybridCache.zeros(config, batch, 64, jnp.float32)

    def window(x, scale=1.0):
        values = np.zeros(x.shape, np.float32)
        values[:, :, :block] = scale * rng.standard_normal(values[:, :, :block].shape)
        return jnp.asarray(values)

    keys = window(cache.block_k)
    keys = keys / jnp.maximum(jnp.linalg.norm(keys, axis=-1, keepdims=True), 1e-6)
    return cache.replace(
        lengths=jnp.full((batch,), 40 + block, jnp.int32),
        start=jnp.full((batch,), 40, jnp.int32),
        state=jnp.asarray(rng.standard_normal(cache.state.shape), jnp.float32),
        start_state=jnp.asarray(rng.standard_normal(cache.state.shape), jnp.float32),
        block_conv=window(cache.block_conv),
        block_k=keys,
        block_v=window(cache.block_v),
        block_g=-jnp.abs(window(cache.block_g, 0.1)),
        block_beta=jax.nn.sigmoid(window(cache.block_g)),
    )


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    batches = int_list(parser, "--batches", args.batches)
    blocks = int_list(parser, "--blocks", args.blocks, maximum=ROLLBACK_WINDOW)
    require_at_least(parser, args, 1, "--repeats")
    config = config_from_hf(HF_CONFIG)
    assert len(config.linear_layers) == LINEAR_LAYERS
    rows = []
    for batch in batches:
        for block in blocks:
            cache = verified_cache(config, batch, block, seed=batch * 100 + block)
            kept = 40 + jnp.asarray(np.random.default_rng(block).integers(0, block + 1, batch))
            ways = {
                "window": jax.jit(lambda c, n: c.rolled_back(n)),
                "block": jax.jit(lambda c, n, k=block: c.rolled_back(n, appended=k)),
            }
            outs = {w: jax.block_until_ready(f(cache, kept)) for w, f in ways.items()}
            np.testing.assert_allclose(outs["block"].state, outs["window"].state, atol=1e-4)
            np.testing.assert_array_equal(outs["block"].conv, outs["window"].conv)
            times = {w: [] for w in ways}
            for _ in range(args.repeats):
                for w, f in ways.items():
                    start = time.perf_counter()
                    jax.block_until_ready(f(cache, kept))
                    times[w].append(time.perf_counter() - start)
            window, over_block = (statistics.median(times[w]) for w in ways)
            rows.append((batch, block, window, over_block))
            print(batch, block, f"{1e3 * window:.2f} {1e3 * over_block:.2f}")
    lines = [
        "## Hybrid rollback over the verified block (`benchmarks/bench_hybrid_rollback.py`)",
        "",
        f"- Machine: {machine_line()}",
        f"- Command: `python benchmarks/bench_hybrid_rollback.py{changed_flags(args, parser)}`",
        f"- Setup: `HybridCache.rolled_back` for {LINEAR_LAYERS} Gated DeltaNet layers of "
        "Qwen3.5-0.8B-like shape (16 key and value heads of 128; the weights play no part), "
        "each row kept to a random prefix of a K-position block; over the whole window (32 "
        "positions, as before) and over the block (`appended=K`, what `verify_block` runs "
        f"now). Same states both ways (checked). Median of {args.repeats} calls each, side by "
        "side, alternating; compilation excluded.",
        "",
        "| batch | block K | whole window ms | block only ms | speedup |",
        "|---:|---:|---:|---:|---:|",
    ]
    for batch, block, window, over_block in rows:
        lines.append(
            f"| {batch} | {block} | {1e3 * window:.2f} | {1e3 * over_block:.2f} | "
            f"{window / over_block:.2f}x |"
        )
    body = "\n".join(lines) + "\n"
    print(body)
    write_section("hybrid_rollback", body, args.out)


if __name__ == "__main__":
    main()
