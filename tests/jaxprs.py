"""Reading what a traced program asks of XLA, for tests that check requests a CPU ignores."""

from __future__ import annotations

import jax
import jax.extend


def dot_precisions(jaxpr) -> list:
    """The `precision` of every dot_general in `jaxpr` and its sub-jaxprs (jit, scan, ...)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn.params["precision"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += dot_precisions(sub)
    return found
