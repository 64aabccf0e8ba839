"""Gated DeltaNet's chunked recurrence: the Pallas kernel vs the XLA form, correctness first.

Shapes are the Qwen3.8-27B target's linear-attention layers (16 key heads repeated to 48 value
heads, Dk = Dv = 128, float32 state), one layer's recurrence:

    T = 16          a verification block (one chunk; what every decode round runs per layer)
    T = 512, 4096   prefills (8 and 64 chunks of 64)

for batch 1 and 8.

    kernel     `chunked_delta_rule(impl="pallas")` (Triton), at each launch of LAUNCHES
    reference  `chunked_delta_rule(impl="reference")` under jit (XLA: `gated_deltanet.chunked`)

Correctness (on the device, before any timing; the script exits 1 if a check fails): outputs and
final states of both forms against the XLA form at "highest" matmul precision.

    python benchmarks/bench_delta_rule.py            # GPU: full grid -> docs/BENCHMARKS.md
    python benchmarks/bench_delta_rule.py --check    # correctness only (fast)
    python benchmarks/bench_delta_rule.py --smoke    # CPU, tiny shapes, interpreted kernel

If the kernel is correct and faster at the decode shape, add "triton" to
`jetspec_jax.kernels.delta_rule.AUTO_BACKENDS` so "auto" selects it.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402

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
from jetspec_jax.kernels import chunked_delta_rule  # noqa: E402
from jetspec_jax.kernels.delta_rule import DeltaRuleLaunch  # noqa: E402
from jetspec_jax.models import gated_deltanet  # noqa: E402

SECTION = "delta_rule"
LAUNCHES = {"w4": DeltaRuleLaunch(num_warps=4), "w8": DeltaRuleLaunch(num_warps=8)}


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int
    length: int  # T
    key_heads: int = 16
    heads: int = 48
    head_dim: int = 128


FULL_GRID = [Shape(b, t) for b in (1, 8) for t in (16, 512, 4096)]
SMOKE_GRID = [Shape(1, t, 1, 2, 16) for t in (16, 100)]
CHECK_SHAPES = [Shape(1, 16), Shape(2, 200), Shape(1, 4096)]  # 200: not a chunk multiple


def operands(shape: Shape, seed: int = 0):
    """`(q, k, v, g, beta, state)` as the hybrid layer prepares them."""
    ks = jax.random.split(jax.random.key(seed), 6)
    b, t, d = shape.batch, shape.length, shape.head_dim
    q = jax.random.normal(ks[0], (b, t, shape.key_heads, d))
    k = jax.random.normal(ks[1], (b, t, shape.key_heads, d))
    q, k = gated_deltanet.prepare_qk(q, k, shape.heads)
    v = jax.random.normal(ks[2], (b, t, shape.heads, d))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, shape.heads)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, shape.heads)))
    state = 0.1 * jax.random.normal(ks[5], (b, shape.heads, d, d))
    return q, k, v, g, beta, state


def delta_rule_fn(impl: str, launch: DeltaRuleLaunch | None = None):
    launch = DeltaRuleLaunch() if launch is None else launch
    return jax.jit(lambda *a: chunked_delta_rule(*a, impl=impl, launch=launch))


def check(shapes, kernel_impl: str, launches: dict) -> list[str]:
    """Correctness lines; a line starting with FAIL fails the run."""
    lines = []
    for shape in shapes:
        args = operands(shape)
        with jax.default_matmul_precision("highest"):
            exact = delta_rule_fn("reference")(*args)
        candidates = {"reference": delta_rule_fn("reference")}
        candidates |= {f"kernel {n}": delta_rule_fn(kernel_impl, la) for n, la in launches.items()}
        for name, fn in candidates.items():
            try:
                out, state = fn(*args)
                err = max(max_err(out, exact[0]), max_err(state, exact[1]))
                verdict = "ok" if err <= 1e-4 else "FAIL"
                record(lines, f"{verdict} {shape} {name}: |out, state - exact| {err:.2e}")
            except Exception as e:  # noqa: BLE001 - record and go on: one run, all facts
                record(lines, f"FAIL {shape} {name}: {first_line(e)}")
    return lines


def timings(shapes, kernel_impl: str, launches: dict):
    """Yields `(rows, notes)` so far after each shape."""
    rows, notes = [], []
    for shape in shapes:
        args = operands(shape)
        ref_s = seconds(delta_rule_fn("reference"), args)
        kernel = {}
        for name, launch in launches.items():
            try:
                kernel[name] = seconds(delta_rule_fn(kernel_impl, launch), args)
            except Exception as e:  # noqa: BLE001
                notes.append(f"kernel {name} at {shape}: {first_line(e)}")
        rows.append((shape, ref_s, kernel))
        print(
            f"{shape}: reference {ref_s * 1e3:.3f} ms, kernel "
            + ", ".join(f"{n} {t * 1e3:.3f}" for n, t in kernel.items()),
            flush=True,
        )
        yield rows, notes


def report(rows, notes, check_lines, kernel_impl: str, smoke: bool) -> str:
    head = [
        "## Gated DeltaNet recurrence" + (" (smoke run, CPU, interpreted)" if smoke else ""),
        "",
        f"{machine_line()}. `benchmarks/bench_delta_rule.py`: one layer's recurrence at the "
        f'Qwen3.8-27B shapes, float32. Kernel: `impl="{kernel_impl}"`, fastest of the launches '
        f"{', '.join(f'`{n}`' for n in LAUNCHES)}. Times in ms (median of {REPEATS} x {ITERS} "
        "calls).",
        "",
        "| B | T | Hk / H / D | reference (XLA) | kernel (launch) | reference / kernel |",
        "|---|---|---|---|---|---|",
    ]
    for shape, ref_s, kernel in rows:
        if kernel:
            name, best = min(kernel.items(), key=lambda kv: kv[1])
            cell, ratio = f"{best * 1e3:.3f} ({name})", f"{ref_s / best:.2f}x"
        else:
            cell, ratio = "failed", "-"
        head.append(
            f"| {shape.batch} | {shape.length} | {shape.key_heads} / {shape.heads} / "
            f"{shape.head_dim} | {ref_s * 1e3:.3f} | {cell} | {ratio} |"
        )
    head += kernel_bench.report_lists(
        "Correctness on the device (vs the XLA form at highest precision):", check_lines, notes
    )
    return "\n".join(head) + "\n"


def _parser() -> argparse.ArgumentParser:
    return kernel_bench.parser(__doc__.split("\n")[0])


def main() -> int:
    args = kernel_bench.parse_args(_parser(), platforms=("gpu",))
    impl = args.kernel_impl
    return kernel_bench.run(
        args,
        SECTION,
        check=lambda: check(SMOKE_GRID if args.smoke else CHECK_SHAPES, impl, LAUNCHES),
        measure=lambda check_lines: (
            report(rows, notes, check_lines, impl, args.smoke)
            for rows, notes in timings(SMOKE_GRID if args.smoke else FULL_GRID, impl, LAUNCHES)
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
