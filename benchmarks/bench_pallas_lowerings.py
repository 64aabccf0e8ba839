"""Pallas on the GPU: the Triton lowering vs Mosaic GPU, on the draft attention's work.

Our kernel has a Triton launch only. To choose between the two lowerings without writing the
kernel twice, this times JAX's own FlashAttention kernels, one per lowering, on the same work as
the draft attention at Qwen3-8B draft shapes: for each of the 8 KV heads, the `C * K * 4` query
rows of its 4 query heads (C candidate blocks of K = 16) attend to S context rows, no mask
(the block part, ~1% of the keys, is left out), bf16:

    ours       `refinement_attention(impl="pallas")`, `GPU_TILING` (Triton; with the block part
               and the per-candidate lengths, so it does slightly more)
    triton     `jax.experimental.pallas.ops.gpu.attention.mha` (Triton FlashAttention-2)
    mosaic     `jax.experimental.pallas.ops.gpu.attention_mgpu.attention` (Mosaic GPU
               FlashAttention-3: warp-specialised, TMA, wgmma); needs rows % 128 == 0, so C = 1's
               64 rows are padded to 128

Each is checked against a float32 XLA attention before timing (a failure is recorded, not fatal).

    python benchmarks/bench_pallas_lowerings.py [--out FILE]    # GPU
"""

from __future__ import annotations

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import bench_draft_attention  # noqa: E402
from benchmarks.kernel_bench import first_line, max_err, record, seconds  # noqa: E402
from benchmarks.report import machine_line, out_parser, write_section  # noqa: E402

SECTION = "pallas_lowerings"
KV_HEADS, GROUP, HEAD_DIM, BLOCK = 8, 4, 128, 16
GRID = [(c, s) for c in (1, 4, 16) for s in (1024, 8192)]


def operands(rows: int, context: int, seed: int = 0):
    """`q [1, rows, N_kv, D]`, `k, v [1, S, N_kv, D]` in bf16."""
    rng = np.random.default_rng(seed)

    def normal(*dims):
        return jnp.asarray(rng.standard_normal(dims, np.float32), jnp.bfloat16)

    return (
        normal(1, rows, KV_HEADS, HEAD_DIM),
        normal(1, context, KV_HEADS, HEAD_DIM),
        normal(1, context, KV_HEADS, HEAD_DIM),
    )


def exact(q, k, v):
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    with jax.default_matmul_precision("highest"):
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * HEAD_DIM**-0.5
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1), v)


def triton_fns() -> dict:
    from jax.experimental.pallas.ops.gpu import attention

    def fn(block_k):
        def run(q, k, v):
            sizes = attention.BlockSizes(block_q=min(64, q.shape[1]), block_k=block_k)
            return attention.mha(
                q, k, v, None, sm_scale=HEAD_DIM**-0.5, causal=False, block_sizes=sizes
            )

        return jax.jit(run)

    return {f"triton k{b}": fn(b) for b in (64, 128)}


def mosaic_fns() -> dict:
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    def fn(block_kv):
        config = attention_mgpu.TuningConfig(block_q=64, block_kv=block_kv, max_concurrent_steps=2)

        def run(q, k, v):
            rows = q.shape[1]
            padded = -(-rows // 128) * 128
            q = jnp.pad(q, ((0, 0), (0, padded - rows), (0, 0), (0, 0)))
            # the kernel scales by D ** -0.5 itself
            return attention_mgpu.attention(q, k, v, config)[:, :rows]

        return jax.jit(run)

    return {f"mosaic kv{b}": fn(b) for b in (64, 128)}


def ours_fn(cands: int, context: int):
    """Our kernel on the same work, in its own operand layout, and those operands."""
    shape = bench_draft_attention.Shape(cands, context)
    return bench_draft_attention.attention_fn("pallas"), bench_draft_attention.operands(
        shape, jnp.bfloat16
    )


def measure():
    """Yields `(rows, notes)` so far after each shape; failures are printed as they happen."""
    rows_out, notes = [], []
    families = {}
    for name, builder in (("triton", triton_fns), ("mosaic", mosaic_fns)):
        try:
            families.update(builder())
        except Exception as e:  # noqa: BLE001 - record and go on: one device run, all facts
            record(notes, f"{name}: {first_line(e)}")
    for cands, context in GRID:
        args = operands(cands * BLOCK * GROUP, context)
        want = exact(*args)
        times = {}
        for name, fn in families.items():
            try:
                err = max_err(fn(*args), want)
                if not err <= 2e-2:  # bf16 operands and output
                    record(notes, f"{name} C={cands} S={context}: max error {err:.2e}")
                    continue
                times[name] = seconds(fn, args)
            except Exception as e:  # noqa: BLE001
                record(notes, f"{name} C={cands} S={context}: {first_line(e)}")
        try:
            fn, ours_args = ours_fn(cands, context)
            times["ours"] = seconds(fn, ours_args)
        except Exception as e:  # noqa: BLE001
            record(notes, f"ours C={cands} S={context}: {first_line(e)}")
        print(
            f"C={cands} S={context}: "
            + ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items()),
            flush=True,
        )
        rows_out.append((cands, context, times))
        yield rows_out, notes


def best(times: dict, prefix: str) -> str:
    found = {n: t for n, t in times.items() if n.startswith(prefix)}
    if not found:
        return "failed"
    name, t = min(found.items(), key=lambda kv: kv[1])
    return f"{t * 1e3:.3f}" + (f" ({name.split()[1]})" if " " in name else "")


def report(rows, notes) -> str:
    lines = [
        "## Pallas lowerings on the GPU: Triton vs Mosaic GPU",
        "",
        f"{machine_line()}. `benchmarks/bench_pallas_lowerings.py`: the draft attention's work at "
        f"Qwen3-8B draft shapes ({KV_HEADS} KV heads x {GROUP} query heads, head_dim {HEAD_DIM}, "
        f"block {BLOCK}; C blocks give `C x {BLOCK * GROUP}` query rows per KV head over S "
        "context rows), bf16, batch 1. *triton*: JAX's Pallas FlashAttention-2 "
        "(`ops.gpu.attention.mha`); *mosaic*: JAX's Pallas Mosaic GPU FlashAttention-3 "
        "(`ops.gpu.attention_mgpu`, rows padded to a multiple of 128); *ours*: "
        '`refinement_attention(impl="pallas")` (Triton, split context, with the block part and '
        "per-candidate lengths). Times in ms, fastest tiling.",
        "",
        "| C | S | ours (Triton) | JAX FA2 (Triton) | JAX FA3 (Mosaic GPU) |",
        "|---|---|---|---|---|",
    ]
    for cands, context, times in rows:
        lines.append(
            f"| {cands} | {context} | {best(times, 'ours')} | {best(times, 'triton')} | "
            f"{best(times, 'mosaic')} |"
        )
    if notes:
        lines += ["", "Failures:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    return out_parser(__doc__.split("\n")[0])


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if jax.default_backend() != "gpu":
        parser.error("this benchmark needs a GPU")
    print(machine_line(), flush=True)
    body = ""
    for rows, notes in measure():  # a run cut off at the device's time limit keeps its rows
        body = report(rows, notes)
        write_section(SECTION, body, args.out)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
