"""`refinement_attention`: the draft's attention, dispatched to the jnp reference or the Pallas
kernel, differentiable either way.

`impl` is chosen as for every kernel (`kernels/select.py`): "auto" (the kernel on the backends
where it was verified on hardware, `HARDWARE_VERIFIED`, for the operand dtypes where it was also
measured faster, `AUTO_DTYPES`, when the operands fit it, `kernel_supports`; else the reference
`reference.refinement_attention_reference`), "reference", "pallas" or "pallas_interpret".
The kernel's backward pass recomputes through the reference (`jax.custom_vjp`), so gradients are
the reference's.

Status of the accelerator paths (docs/BENCHMARKS.md, section `gpu_h200`):
- Triton (GPU): compiled and run on an H200 (jax 0.11.2, 2026-12-04). Against the float32
  reference at "highest" precision: float32 within 7e-7, bfloat16 no further off than the
  reference itself, gradients equal; float32 greedy speculative decoding (J1-R1, with and
  without foresight) gives the reference's tokens and round outcomes. In bfloat16 it was faster
  than the XLA reference and cuDNN at 9 of the 10 Qwen3-8B draft shapes measured, up to 1.9x
  (C = 4, S = 8192); float32 decoding was 1.9-2.5x slower end to end (likely its exact float32
  dots, which run on the FMA units), so "auto" takes the kernel for bfloat16 only. JAX 0.11
  deprecates Pallas' Triton lowering in favour of Mosaic GPU.
- Mosaic (TPU): checked on CPU only (the interpreter, which rejects out-of-bounds reads, and
  lowering for "tpu" in `tests/test_kernels.py`); never compiled for or run on a TPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jetspec_jax.kernels import layout, pallas_refinement
from jetspec_jax.kernels.layout import Tiling
from jetspec_jax.kernels.reference import (
    refinement_attention_over_span,
    refinement_attention_reference,
)
from jetspec_jax.kernels.select import select_launch, triton_head_dim_problem

# Pallas backends whose compiled kernel has been checked against the reference on real hardware
# (`benchmarks/bench_draft_attention.py --check`); a kernel merely interpreted and lowered on CPU
# is opt-in with impl="pallas".
HARDWARE_VERIFIED: frozenset[str] = frozenset({"triton"})
# Operand dtypes for which "auto" takes the verified kernel: where it was measured faster.
AUTO_DTYPES: frozenset[str] = frozenset({"bfloat16"})

# Default tilings per Pallas backend. GPU: small query tiles plus context splits, since decode has
# few query rows per KV head; TPU: lane-dense context tiles, no splits (the whole context of a head
# is one VMEM block there, so splitting would only re-read it).
GPU_TILING = Tiling(block_q=64, block_kv=64, num_warps=4, num_stages=2)
TPU_TILING = Tiling(block_q=128, block_kv=128, kv_splits=1)


def kernel_supports(q, context_k, context_v, block_k, block_v, backend: str) -> str | None:
    """None if the kernel takes these operands (arrays or `jax.ShapeDtypeStruct`s) on `backend`
    ("triton", "tpu" or "interpret"), else why not."""
    head_dim, num_heads, num_kv = q.shape[-1], q.shape[3], context_k.shape[2]
    dtypes = {jnp.dtype(x.dtype) for x in (q, context_k, context_v, block_k, block_v)}
    if len(dtypes) > 1:
        return f"operands of several dtypes ({', '.join(sorted(d.name for d in dtypes))})"
    if num_heads % num_kv:
        return f"{num_heads} query heads are not a multiple of {num_kv} KV heads"
    if backend == "triton" and (why := triton_head_dim_problem(head_dim)):
        return why
    if backend == "tpu" and head_dim % 128:
        return f"Mosaic TPU needs head_dim % 128 == 0 (lane-dense blocks), got {head_dim}"
    return None


def refinement_attention(
    q: jax.Array,
    context_k: jax.Array,
    context_v: jax.Array,
    context_lengths: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    *,
    causal: bool,
    impl: str = "auto",
    scale: float | None = None,
    tiling: Tiling | None = None,
) -> jax.Array:
    """C candidate blocks attend to a shared context and to their own block, one softmax.

    Args:
        q: `[B, C, K, N, D]` queries (C = 1: one block per row, as the decode loop drafts).
        context_k, context_v: `[B, S, N_kv, D]` the shared context, e.g. one layer of the draft
            cache; `N % N_kv == 0` (grouped-query attention).
        context_lengths: `[B, C]` int; candidate c sees context slots `< context_lengths[b, c]`
            (0 is allowed: the block only). Slots past it may hold any finite values (a NaN there
            would reach the output through a zero weight: 0 * NaN).
        block_k, block_v: `[B, C, K, N_kv, D]` each candidate's own keys/values.
        causal: within the block, row i sees rows `<= i` (True) or all K rows (False).
        impl: see the module docstring.
        scale: score scale; None: `D ** -0.5`.
        tiling: kernel tiling; None: `GPU_TILING` (Triton and the interpreter) or `TPU_TILING`.

    Returns:
        `[B, C, K, N, D]` in the dtype of `q`; scores and softmax statistics are float32.
    """
    _check_shapes(q, context_k, context_v, context_lengths, block_k, block_v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    args = (q, context_k, context_v, context_lengths, block_k, block_v)
    backend, interpret = _launch(impl, q, context_k, context_v, block_k, block_v)
    if backend is None:
        return refinement_attention_reference(*args, causal=causal, scale=scale)
    if tiling is None:
        tiling = TPU_TILING if backend == "tpu" else GPU_TILING
    options = KernelOptions(causal, scale, tiling, backend, interpret)
    return _kernel_attention(*args, options)


def cached_refinement_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    layer: int,
    context_lengths: jax.Array,
    block_k: jax.Array,
    block_v: jax.Array,
    *,
    causal: bool,
    chunk: int,
    impl: str = "auto",
) -> jax.Array:
    """`refinement_attention` over layer `layer` of a stacked cache `[L, B, S, N_kv, D]` (the
    decode loop's draft or adapter cache). Where the reference runs and the cache has more than
    `chunk` slots, only the chunks below the longest context are read
    (`reference.refinement_attention_over_span`); up to `chunk` slots, and on the kernel (which
    reads only the filled span itself), it is `refinement_attention` over the layer. Decode
    only: the span form is not reverse-differentiable.

    Args:
        q, context_lengths, block_k, block_v, causal, impl: as `refinement_attention`'s.
        cache_k, cache_v: `[L, B, S, N_kv, D]` the stacked context.
        layer: the layer to attend to.
        chunk: context slots per step of the span form (`TransformerConfig.cache_chunk`).

    Returns:
        `[B, C, K, N, D]` in the dtype of `q`.
    """
    context_k, context_v = cache_k[layer], cache_v[layer]
    _check_shapes(q, context_k, context_v, context_lengths, block_k, block_v)
    backend, _ = _launch(impl, q, context_k, context_v, block_k, block_v)
    if backend is None and cache_k.shape[2] > chunk:
        return refinement_attention_over_span(
            q,
            cache_k,
            cache_v,
            layer,
            context_lengths,
            block_k,
            block_v,
            causal=causal,
            chunk=chunk,
        )
    return refinement_attention(
        q, context_k, context_v, context_lengths, block_k, block_v, causal=causal, impl=impl
    )


def _launch(impl, q, context_k, context_v, block_k, block_v) -> tuple[str | None, bool]:
    """`select_launch` for these operands: `(backend, interpret)`, backend None for the
    reference."""
    return select_launch(
        impl,
        kernel="refinement-attention",
        verified=HARDWARE_VERIFIED if jnp.dtype(q.dtype).name in AUTO_DTYPES else frozenset(),
        supports=lambda b: kernel_supports(q, context_k, context_v, block_k, block_v, b),
    )


def _check_shapes(q, context_k, context_v, context_lengths, block_k, block_v) -> None:
    """Names the operand whose shape disagrees, before the reference's reshapes or the kernel's
    layout fail with an anonymous broadcasting error."""
    if q.ndim != 5:
        raise ValueError(f"q must be [B, C, K, N, D], got shape {q.shape}")
    b, c, k, n, d = q.shape
    if context_k.ndim != 4 or context_k.shape != context_v.shape:
        raise ValueError(
            f"context_k and context_v must both be [B, S, N_kv, D], got {context_k.shape} and "
            f"{context_v.shape}"
        )
    s, n_kv = context_k.shape[1], context_k.shape[2]
    if context_k.shape != (b, s, n_kv, d):
        raise ValueError(f"context_k {context_k.shape} does not fit q {q.shape} ([B, S, N_kv, D])")
    if n % n_kv:
        raise ValueError(f"{n} query heads are not a multiple of {n_kv} KV heads")
    if context_lengths.shape != (b, c):
        raise ValueError(f"context_lengths must be [B, C] = {(b, c)}, got {context_lengths.shape}")
    if not jnp.issubdtype(context_lengths.dtype, jnp.integer):  # the paths would round apart
        raise ValueError(f"context_lengths must be integers, got {context_lengths.dtype}")
    for name, x in (("block_k", block_k), ("block_v", block_v)):
        if x.shape != (b, c, k, n_kv, d):
            raise ValueError(
                f"{name} must be [B, C, K, N_kv, D] = {(b, c, k, n_kv, d)}, got {x.shape}"
            )


@dataclasses.dataclass(frozen=True)
class KernelOptions:
    """Static options of one kernel call (hashable: the custom_vjp's non-differentiable input).
    `backend` is "triton" or "tpu" (the launch); `interpret` runs it in the Pallas interpreter."""

    causal: bool
    scale: float
    tiling: Tiling
    backend: str
    interpret: bool


def kernel_forward(q, context_k, context_v, context_lengths, block_k, block_v, options):
    """The kernel path without its custom gradient: pack, launch, merge splits, unpack."""
    lay = layout.make_layout(q.shape, context_k.shape, options.tiling)
    packed = layout.pack(
        lay, q, context_k, context_v, context_lengths, block_k, block_v, options.causal
    )
    state = pallas_refinement.kernel_call(
        lay,
        packed,
        scale=options.scale,
        tiling=options.tiling,
        backend=options.backend,
        interpret=options.interpret,
    )
    return layout.unpack(lay, pallas_refinement.merge(*state, q.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kernel_attention(q, context_k, context_v, context_lengths, block_k, block_v, options):
    return kernel_forward(q, context_k, context_v, context_lengths, block_k, block_v, options)


def _kernel_attention_fwd(q, context_k, context_v, context_lengths, block_k, block_v, options):
    out = kernel_forward(q, context_k, context_v, context_lengths, block_k, block_v, options)
    return out, (q, context_k, context_v, context_lengths, block_k, block_v)


def _kernel_attention_bwd(options, residuals, grad):
    q, context_k, context_v, context_lengths, block_k, block_v = residuals

    def reference(q, context_k, context_v, block_k, block_v):
        return refinement_attention_reference(
            q,
            context_k,
            context_v,
            context_lengths,
            block_k,
            block_v,
            causal=options.causal,
            scale=options.scale,
        )

    _, vjp = jax.vjp(reference, q, context_k, context_v, block_k, block_v)
    dq, dck, dcv, dbk, dbv = vjp(grad)
    dlengths = np.zeros(context_lengths.shape, jax.dtypes.float0)  # integer input
    return dq, dck, dcv, dlengths, dbk, dbv


_kernel_attention.defvjp(_kernel_attention_fwd, _kernel_attention_bwd)
