"""The matmul precision rule every model and kernel follows."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def matmul_precision(*operands) -> jax.lax.Precision | None:
    """HIGHEST when an operand is float32, else XLA's default.

    XLA's default lets GPUs multiply float32 in TF32 and TPUs in bfloat16 passes: "float32" would
    not be float32 there, and block verification and one-token decoding would round differently.
    `operands`: arrays (or anything with a `dtype`).
    """
    return jax.lax.Precision.HIGHEST if any(x.dtype == jnp.float32 for x in operands) else None
