"""Pallas kernels with their jnp references.

`refinement_attention`: the draft's attention (candidate blocks over a shared context plus their
own block), see `jetspec_jax.kernels.refinement`.
"""

from jetspec_jax.kernels.layout import Tiling
from jetspec_jax.kernels.reference import refinement_attention_reference
from jetspec_jax.kernels.refinement import (
    GPU_TILING,
    IMPLS,
    TPU_TILING,
    check_impl,
    kernel_supports,
    pallas_backend,
    refinement_attention,
)

__all__ = [
    "GPU_TILING",
    "IMPLS",
    "TPU_TILING",
    "Tiling",
    "check_impl",
    "kernel_supports",
    "pallas_backend",
    "refinement_attention",
    "refinement_attention_reference",
]
