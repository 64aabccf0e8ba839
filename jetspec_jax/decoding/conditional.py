"""`apply_if`: a conditional update that XLA writes in place.

A `lax.cond` whose branch updates a large buffer (a cache row write) makes XLA write the branch's
result into a copy of the buffer (on XLA:CPU, jax 0.10: one copy before the branch and one after
it), every time the conditional runs. The body of a `lax.while_loop` updates its carry in place,
so a loop of zero or one trip is the same conditional without the copies. The decode loops use it
wherever a branch writes a cache: the foresight fallback (its refreshes write the draft's and the
decoder's caches) and the SPMD pipeline's per-stage steps (verification writes the target's).
`tests/test_foresight.py` and `tests/test_pipeline.py` pin the compiled loops' copies at zero.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import jax
import jax.numpy as jnp

T = TypeVar("T")


def apply_if(pred: jax.Array, fn: Callable[[T], T], operand: T) -> T:
    """`fn(operand)` if `pred` else `operand`, as a `lax.while_loop` of zero or one trip.

    Args:
        pred: a scalar bool.
        fn: a function from the operand's pytree to one of the same structure, shapes and dtypes
            (it is the loop's body); it must take what it updates from its argument, not from
            an enclosing scope, for the update to land in place.
        operand: the pytree `fn` updates.

    Where XLA reads a loop's predicate on the host (a GPU), this reads one more than a `lax.cond`
    would: after the trip.
    """

    def once(carry):
        _, value = carry
        return jnp.bool_(False), fn(value)

    return jax.lax.while_loop(lambda carry: carry[0], once, (pred, operand))[1]
