"""The draft's refinement attention: Pallas kernel vs jnp reference vs cuDNN, correctness first.

Shapes are the Qwen3-8B draft's (32 query heads, 8 KV heads, head_dim 128, block K = 16, bf16),
batch 1, C in {1, 4, 16} candidate blocks sharing a context of S in 512..8192 slots; candidate c
sees `S - (c mod K)` of them (foresight candidates differ by their accepted counts).

    kernel     `refinement_attention(impl="pallas")` (Triton on GPU), at each tiling of TILINGS
               (the table shows the fastest; all are printed)
    reference  `refinement_attention(impl="reference")` under jit (XLA)
    cudnn      `jax.nn.dot_product_attention(implementation="cudnn")`: it can express the mask
               only as an explicit bias over `[context; own block]` per candidate, so each
               candidate gets its own copy of the context. Timed twice: with that copy built per
               call (what using it costs) and with the keys prebuilt (the attention alone).

Correctness (on the device, before any timing; the script exits 1 if a check fails): kernel vs
the reference in bf16 and fp32 (the fp32 reference at "highest" matmul precision), and the
gradient of the kernel path (custom_vjp) vs the reference's.

    python benchmarks/bench_draft_attention.py            # GPU: full grid -> docs/BENCHMARKS.md
    python benchmarks/bench_draft_attention.py --check    # correctness only (fast)
    python benchmarks/bench_draft_attention.py --smoke    # CPU, tiny shapes, interpreted kernel

Timing: `ITERS` back-to-back calls of a jitted function, then one `block_until_ready`, median
over `REPEATS`; launch overhead is included (as in a decode step).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import kernel_bench  # noqa: E402
from benchmarks.kernel_bench import (  # noqa: E402
    ITERS,
    REPEATS,
    first_line,
    max_err,
    record,
    seconds,
)
from benchmarks.report import machine_line  # noqa: E402
from jetspec_jax.kernels import Tiling, refinement_attention  # noqa: E402

SECTION = "draft_attention"
TILINGS = {
    "q64-kv64-w4": Tiling(block_q=64, block_kv=64, num_warps=4, num_stages=2),
    "q64-kv128-w4": Tiling(block_q=64, block_kv=128, num_warps=4, num_stages=2),
    "q128-kv64-w8": Tiling(block_q=128, block_kv=64, num_warps=8, num_stages=2),
}
SMOKE_TILINGS = {"q16-kv16": Tiling(block_q=16, block_kv=16)}


@dataclasses.dataclass(frozen=True)
class Shape:
    cands: int  # C
    context: int  # S
    k_len: int = 16
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128


FULL_GRID = [Shape(c, s) for c in (1, 4, 16) for s in (512, 1024, 2048, 4096, 8192)]
SMOKE_GRID = [Shape(c, s, 4, 4, 2, 16) for c in (1, 2) for s in (40, 64)]
CHECK_SHAPES = [Shape(1, 1000), Shape(4, 2048), Shape(16, 520)]  # incl. S not a tile multiple


def operands(shape: Shape, dtype, seed: int = 0):
    """`(q, context_k, context_v, lengths, block_k, block_v)` for `shape`."""
    rng = np.random.default_rng(seed)
    s, c, k = shape.context, shape.cands, shape.k_len

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims, np.float32), dtype)

    lengths = jnp.asarray([[s - (i % k) for i in range(c)]], jnp.int32)
    return (
        normal(1, c, k, shape.heads, shape.head_dim),
        normal(1, s, shape.kv_heads, shape.head_dim),
        normal(1, s, shape.kv_heads, shape.head_dim),
        lengths,
        normal(1, c, k, shape.kv_heads, shape.head_dim),
        normal(1, c, k, shape.kv_heads, shape.head_dim),
    )


def attention_fn(impl: str, tiling: Tiling | None = None):
    return jax.jit(lambda *a: refinement_attention(*a, causal=True, impl=impl, tiling=tiling))


def cudnn_inputs(q, context_k, context_v, lengths, block_k, block_v):
    """One attention row per candidate: keys `[context; own block]`, mask `[B*C, 1, K, S+K]`."""
    batch, cands, k_len = q.shape[:3]
    s = context_k.shape[1]

    def per_candidate(context, block):
        context = jnp.broadcast_to(context[:, None], (batch, cands, *context.shape[1:]))
        keys = jnp.concatenate([context, block], axis=2)
        return keys.reshape(batch * cands, s + k_len, *keys.shape[3:])

    keys, values = per_candidate(context_k, block_k), per_candidate(context_v, block_v)
    ctx = jnp.arange(s)[None, None, None, :] < lengths.reshape(-1)[:, None, None, None]
    ctx = jnp.broadcast_to(ctx, (batch * cands, 1, k_len, s))
    blk = jnp.broadcast_to(
        jnp.tril(jnp.ones((k_len, k_len), bool)), (batch * cands, 1, k_len, k_len)
    )
    mask = jnp.concatenate([ctx, blk], axis=-1)
    return q.reshape(batch * cands, k_len, *q.shape[3:]), keys, values, mask


def cudnn_attention(q, keys, values, mask):
    return jax.nn.dot_product_attention(q, keys, values, mask=mask, implementation="cudnn")


def cudnn_fns(shape: Shape):
    """(with the per-call context copies, attention alone on prebuilt inputs)."""
    out_shape = (1, shape.cands, shape.k_len, shape.heads, shape.head_dim)
    full = jax.jit(lambda *a: cudnn_attention(*cudnn_inputs(*a)).reshape(out_shape))
    alone = jax.jit(lambda *a: cudnn_attention(*a).reshape(out_shape))
    return full, alone


def check(shapes, kernel_impl: str, tilings: dict) -> list[str]:
    """Correctness lines; a line starting with FAIL fails the run."""
    lines = []
    for shape in shapes:
        for dtype, tol in ((jnp.float32, 2e-5), (jnp.bfloat16, None)):
            args = operands(shape, dtype)
            as_f32 = [a if a.dtype == jnp.int32 else a.astype(jnp.float32) for a in args]
            with jax.default_matmul_precision("highest"):
                exact = attention_fn("reference")(*as_f32)
            ref = attention_fn("reference")(*args)
            bound = tol if tol is not None else 2 * max_err(ref, exact) + 1e-3
            for name, tiling in tilings.items():
                try:
                    got = attention_fn(kernel_impl, tiling)(*args)
                    err = max_err(got, exact)
                    verdict = "ok" if err <= bound else "FAIL"
                    record(
                        lines,
                        f"{verdict} {shape} {jnp.dtype(dtype).name} {name}: "
                        f"|kernel - exact| {err:.2e} (bound {bound:.2e}; "
                        f"reference {max_err(ref, exact):.2e})",
                    )
                except Exception as e:  # noqa: BLE001 - record and go on: one run, all facts
                    record(lines, f"FAIL {shape} {jnp.dtype(dtype).name} {name}: {first_line(e)}")
    record(lines, check_cudnn_form(shapes[0]))
    shape = shapes[0]
    args = operands(shape, jnp.float32, seed=1)
    cot = jnp.asarray(np.random.default_rng(2).standard_normal(args[0].shape), jnp.float32)

    def grad(impl):
        def loss(q, ck, cv, bk, bv):
            return jnp.sum(
                refinement_attention(q, ck, cv, args[3], bk, bv, causal=True, impl=impl) * cot
            )

        with jax.default_matmul_precision("highest"):
            return jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))(*args[:3], *args[4:])

    try:
        err = max(max_err(a, b) for a, b in zip(grad(kernel_impl), grad("reference"), strict=True))
        record(lines, f"{'ok' if err <= 1e-5 else 'FAIL'} gradients {shape}: max error {err:.2e}")
    except Exception as e:  # noqa: BLE001
        record(lines, f"FAIL gradients {shape}: {first_line(e)}")
    return lines


def check_cudnn_form(shape: Shape) -> str:
    """The cuDNN baseline computes the same attention (on CPU: the same inputs through XLA's
    `dot_product_attention`, which checks the mask construction)."""
    implementation = "cudnn" if jax.default_backend() == "gpu" else None
    args = operands(shape, jnp.bfloat16, seed=3)
    as_f32 = [a if a.dtype == jnp.int32 else a.astype(jnp.float32) for a in args]
    with jax.default_matmul_precision("highest"):
        exact = attention_fn("reference")(*as_f32)
    bound = 2 * max_err(attention_fn("reference")(*args), exact) + 1e-3
    name = implementation or "xla"
    try:
        inputs = jax.jit(cudnn_inputs)(*args)
        out = jax.nn.dot_product_attention(
            *inputs[:3], mask=inputs[3], implementation=implementation
        )
        err = max_err(out.reshape(exact.shape), exact)
        verdict = "ok" if err <= bound else "FAIL"
        return (
            f"{verdict} {shape} bfloat16 {name} baseline: |out - exact| {err:.2e} "
            f"(bound {bound:.2e})"
        )
    except Exception as e:  # noqa: BLE001
        return f"FAIL {shape} {name} baseline: {first_line(e)}"


def timings(shapes, kernel_impl: str, tilings: dict, with_cudnn: bool):
    """Yields `(rows, notes)` so far after each shape."""
    rows, notes = [], []
    for shape in shapes:
        args = operands(shape, jnp.bfloat16)
        ref_s = seconds(attention_fn("reference"), args)
        kernel = {}
        for name, tiling in tilings.items():
            try:
                kernel[name] = seconds(attention_fn(kernel_impl, tiling), args)
            except Exception as e:  # noqa: BLE001
                notes.append(f"kernel {name} at {shape}: {first_line(e)}")
        cudnn_full = cudnn_alone = None
        if with_cudnn:
            full, alone = cudnn_fns(shape)
            try:
                cudnn_full = seconds(full, args)
                cudnn_alone = seconds(alone, jax.jit(cudnn_inputs)(*args))
            except Exception as e:  # noqa: BLE001
                notes.append(f"cudnn at {shape}: {first_line(e)}")
        rows.append((shape, ref_s, kernel, cudnn_full, cudnn_alone))
        best = min(kernel.values()) if kernel else float("nan")
        print(
            f"{shape}: reference {ref_s * 1e3:.3f} ms, kernel "
            + ", ".join(f"{n} {t * 1e3:.3f}" for n, t in kernel.items())
            + f" (best {best * 1e3:.3f}), cudnn {_ms(cudnn_full)} / {_ms(cudnn_alone)}",
            flush=True,
        )
        yield rows, notes


def _ms(t: float | None) -> str:
    return "n/a" if t is None else f"{t * 1e3:.3f}"


def report(rows, notes, check_lines, kernel_impl: str, smoke: bool) -> str:
    head = [
        "## Draft refinement attention" + (" (smoke run, CPU, interpreted)" if smoke else ""),
        "",
        f"{machine_line()}. `benchmarks/bench_draft_attention.py`: causal, batch 1, bf16; "
        'candidate c sees `S - (c mod K)` context slots. Kernel: `impl="{}"`, fastest of '
        'the tilings {}. cuDNN: `jax.nn.dot_product_attention(implementation="cudnn")` with an '
        "explicit mask over `[context; own block]` per candidate (it cannot share the context "
        "between candidates): *+copy* builds those keys per call, *alone* times the attention on "
        "prebuilt keys. Times in ms (median of {} x {} calls).".format(
            kernel_impl,
            ", ".join(f"`{n}`" for n in (SMOKE_TILINGS if smoke else TILINGS)),
            REPEATS,
            ITERS,
        ),
        "",
        "| C | S | N / N_kv / D / K | reference | kernel (tiling) | cuDNN +copy | cuDNN alone "
        "| kernel vs best other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for shape, ref_s, kernel, cudnn_full, cudnn_alone in rows:
        if kernel:
            name, best = min(kernel.items(), key=lambda kv: kv[1])
            others = [t for t in (ref_s, cudnn_full, cudnn_alone) if t is not None]
            ratio = f"{min(others) / best:.2f}x"
            kernel_cell = f"{best * 1e3:.3f} ({name})"
        else:
            kernel_cell, ratio = "failed", "-"
        head.append(
            f"| {shape.cands} | {shape.context} | {shape.heads} / {shape.kv_heads} / "
            f"{shape.head_dim} / {shape.k_len} | {ref_s * 1e3:.3f} | {kernel_cell} | "
            f"{_ms(cudnn_full)} | {_ms(cudnn_alone)} | {ratio} |"
        )
    head += kernel_bench.report_lists(
        "Correctness on the device (kernel vs fp32 reference at highest precision):",
        check_lines,
        notes,
    )
    return "\n".join(head) + "\n"


def _parser() -> argparse.ArgumentParser:
    return kernel_bench.parser(__doc__.split("\n")[0])


def main() -> int:
    args = kernel_bench.parse_args(_parser(), platforms=("gpu", "tpu"))
    impl, tilings = args.kernel_impl, SMOKE_TILINGS if args.smoke else TILINGS
    with_cudnn = jax.default_backend() == "gpu"
    return kernel_bench.run(
        args,
        SECTION,
        check=lambda: check(SMOKE_GRID[2:3] if args.smoke else CHECK_SHAPES, impl, tilings),
        measure=lambda check_lines: (
            report(rows, notes, check_lines, impl, args.smoke)
            for rows, notes in timings(
                SMOKE_GRID if args.smoke else FULL_GRID, impl, tilings, with_cudnn
            )
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
