"""Python numbers from the scalars users pass: Python, NumPy, or 0-d NumPy/JAX arrays.

Request and config checks accept any of these (a temperature computed in JAX, a seed read from a
NumPy array) and keep plain Python numbers, which compare, hash and print alike. Bools are not
numbers here, and complex numbers are not real.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np


def as_int(value) -> int | None:
    """`value` as an int if it is an integer scalar, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int) or _array_scalar_of(value, jnp.integer):
        return int(value)
    return None


def is_integer(value) -> bool:
    """Whether `value` is a Python or NumPy integer: stricter than `as_int`, for indices and counts
    given one by one (a row, a step count, a record limit), where an array is refused."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


def as_real(value) -> float | None:
    """`value` as a float if it is an integer or floating-point scalar, else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float) or any(
        _array_scalar_of(value, kind) for kind in (jnp.integer, jnp.floating)
    ):
        try:
            return float(value)
        except OverflowError:  # a Python int beyond float range: out of every range checked
            return math.inf if value > 0 else -math.inf
    return None


def _array_scalar_of(value, kind) -> bool:
    """Whether `value` is a NumPy scalar or a 0-d NumPy/JAX array of a `kind` dtype."""
    dtype = getattr(value, "dtype", None)
    return dtype is not None and getattr(value, "ndim", None) == 0 and jnp.issubdtype(dtype, kind)
