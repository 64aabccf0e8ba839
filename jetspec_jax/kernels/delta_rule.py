"""`chunked_delta_rule`: Gated DeltaNet's recurrence over a sequence, dispatched to the XLA form
(`models.gated_deltanet.chunked`) or the Pallas kernel (`pallas_delta_rule`).

`impl` is chosen as for every kernel (`kernels/select.py`): "auto" (the kernel on the backends
where it was verified on hardware, `HARDWARE_VERIFIED`, and also measured faster, `AUTO_BACKENDS`;
else the XLA form), "reference", "pallas" (Triton: GPU only) or "pallas_interpret".

The target is never differentiated (training reads its states under `stop_gradient`), so the
kernel has no backward pass. Status: the kernel runs in the interpreter and lowers through Pallas
for "cuda" on CPU (`tests/test_delta_rule_kernel.py`). On an H200 (jax 0.11.2, 2026-12-04;
docs/BENCHMARKS.md, section `gpu_h200`) it compiled and matched the XLA form at "highest"
precision at T = 16 (a verification block, chunk 16: 4.5e-7) and T = 200 (chunk 64: 3.0e-7).
It stays out of "auto" (`AUTO_BACKENDS` empty): its speed was not measured, neither the
T = 4096 check nor greedy decoding of a hybrid target on it ran in the time lent, and one
compile during the T = 200 check took 2 min 41 s (the kernel at chunk 64 is the likely one: the
XLA form is one while loop). Run `benchmarks/bench_delta_rule.py` on a GPU, then add "triton" to
`AUTO_BACKENDS` if it is the faster form there and compiles in reasonable time.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import pallas_delta_rule
from jetspec_jax.kernels.layout import next_pow2
from jetspec_jax.kernels.select import select_launch, triton_head_dim_problem
from jetspec_jax.models import gated_deltanet

# Pallas backends whose compiled kernel was checked against the XLA form on hardware.
HARDWARE_VERIFIED: frozenset[str] = frozenset({"triton"})
# Those where "auto" takes it: also measured faster (none yet, see above).
AUTO_BACKENDS: frozenset[str] = frozenset()
# The XLA form's chunk; 64 x 64 float32 tiles fit a GPU program's registers.
MAX_CHUNK = gated_deltanet.DEFAULT_CHUNK


@dataclasses.dataclass(frozen=True)
class DeltaRuleLaunch:
    """Launch options of the kernel (powers of two)."""

    num_warps: int = 4
    num_stages: int = 1


def kernel_supports(k_shape: tuple[int, ...], v_shape: tuple[int, ...], backend: str) -> str | None:
    """None if the kernel takes keys `[B, T, H, Dk]` and values `[B, T, H, Dv]` on `backend`
    ("triton", "tpu" or "interpret"), else why not."""
    if backend == "tpu":
        return "the delta-rule kernel has no Mosaic (TPU) launch"
    if backend == "triton":
        return triton_head_dim_problem(k_shape[-1], "Dk") or triton_head_dim_problem(
            v_shape[-1], "Dv"
        )
    return None


def _check_shapes(q, k, v, g, beta, state) -> None:
    if k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"k and v must be [B, T, H, D], got shapes {k.shape} and {v.shape}")
    b, t, h, dk = k.shape
    dv = v.shape[-1]
    expected = dict(
        q=(b, t, h, dk), v=(b, t, h, dv), g=(b, t, h), beta=(b, t, h), state=(b, h, dk, dv)
    )
    for (name, want), x in zip(expected.items(), (q, v, g, beta, state), strict=True):
        if x.shape != want:
            raise ValueError(
                f"{name} has shape {x.shape}; keys {k.shape} and values of width {dv} need {want}"
            )


def chunked_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array,
    *,
    impl: str = "auto",
    launch: DeltaRuleLaunch = DeltaRuleLaunch(),
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over T positions, from `state`.

    Args:
        q, k: `[B, T, H, Dk]` prepared queries and keys (`gated_deltanet.prepare_qk`);
        v: `[B, T, H, Dv]`; g, beta: `[B, T, H]` log decays (<= 0) and write strengths (0 and 0
            at padding); state: `[B, H, Dk, Dv]` float32.
        impl: see the module docstring.
        launch: the kernel's launch options (ignored by "reference").

    Returns:
        `(out [B, T, H, Dv], final state [B, H, Dk, Dv])`, float32.

    Raises:
        ValueError: an operand's shape disagrees with the keys' and values' (the kernel takes
            its blocks from `k` alone: a mismatch would read out of bounds, not fail).
    """
    _check_shapes(q, k, v, g, beta, state)
    backend, interpret = select_launch(  # first: an empty sequence must not let a bad impl by
        impl,
        kernel="delta-rule",
        verified=HARDWARE_VERIFIED & AUTO_BACKENDS,
        supports=lambda b: kernel_supports(k.shape, v.shape, b),
    )
    if k.shape[1] == 0:  # nothing to run: the kernel's blocks cannot be empty
        return jnp.zeros(v.shape, jnp.float32), state.astype(jnp.float32)
    if backend is None:
        return gated_deltanet.chunked(q, k, v, g, beta, state)

    length = k.shape[1]
    chunk = min(MAX_CHUNK, max(16, next_pow2(length)))  # Triton's dot needs >= 16 rows
    pad = -length % chunk
    f32 = jnp.float32

    def padded(x):  # zeros are inert: g = beta = 0 leaves the state as it is
        return jnp.pad(x.astype(f32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    out, final = pallas_delta_rule.kernel_call(
        *(padded(x) for x in (q, k, v, g, beta)),
        state.astype(f32),
        chunk=chunk,
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
        interpret=interpret,
    )
    return out[:, :length], final
