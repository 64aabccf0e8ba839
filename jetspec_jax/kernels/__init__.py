"""Pallas kernels with their jnp references.

`refinement_attention`: the draft's attention (candidate blocks over a shared context plus their
own block), see `jetspec_jax.kernels.refinement`.
`chunked_delta_rule`: Gated DeltaNet's recurrence over a sequence (the hybrid target's prefill and
verification blocks), see `jetspec_jax.kernels.delta_rule`.
"""

from jetspec_jax.kernels.delta_rule import chunked_delta_rule
from jetspec_jax.kernels.layout import Tiling
from jetspec_jax.kernels.reference import refinement_attention_reference
from jetspec_jax.kernels.refinement import (
    GPU_TILING,
    TPU_TILING,
    kernel_supports,
    refinement_attention,
)
from jetspec_jax.kernels.select import IMPLS, check_impl, pallas_backend

__all__ = [
    "GPU_TILING",
    "IMPLS",
    "TPU_TILING",
    "Tiling",
    "check_impl",
    "chunked_delta_rule",
    "kernel_supports",
    "pallas_backend",
    "refinement_attention",
    "refinement_attention_reference",
]
