"""`chunked_delta_rule`: Gated DeltaNet's recurrence over a sequence, dispatched to the XLA form
(`models.gated_deltanet.chunked`) or the Pallas kernel (`pallas_delta_rule`).

`impl` is chosen as for every kernel (`kernels/select.py`): "auto" (the kernel where verified on
hardware, `HARDWARE_VERIFIED`, else the XLA form), "reference", "pallas" (Triton: GPU only) or
"pallas_interpret".

The target is never differentiated (training reads its states under `stop_gradient`), so the
kernel has no backward pass. Status: the kernel runs in the interpreter and lowers through Pallas
for "cuda" on CPU (`tests/test_delta_rule_kernel.py`); it has not run on a GPU yet. Run
`benchmarks/bench_delta_rule.py --check` on one, then add "triton" to `HARDWARE_VERIFIED` where
it is the faster form.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jetspec_jax.kernels import pallas_delta_rule
from jetspec_jax.kernels.layout import next_pow2
from jetspec_jax.kernels.select import select_launch, triton_head_dim_problem
from jetspec_jax.models import gated_deltanet

HARDWARE_VERIFIED: frozenset[str] = frozenset()
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
    """
    backend, interpret = select_launch(
        impl,
        kernel="delta-rule",
        verified=HARDWARE_VERIFIED,
        supports=lambda b: kernel_supports(k.shape, v.shape, b),
    )
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
