"""Choosing between a Pallas kernel and its jnp/XLA reference: one rule for every kernel.

Implementations (`impl`):

    "auto"              the kernel on backends where it was verified on hardware (the kernel's
                        `HARDWARE_VERIFIED`, and where a kernel says so, only for operands it
                        was measured faster on) when the operands fit it, else the reference
    "reference"         the jnp/XLA reference
    "pallas"            the kernel on this platform's Pallas backend (GPU or TPU only)
    "pallas_interpret"  the kernel's Triton launch in the Pallas interpreter (any platform;
                        slow: for tests)
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jetspec_jax.kernels.layout import next_pow2

IMPLS = ("auto", "reference", "pallas", "pallas_interpret")


def check_impl(impl: str, what: str = "attention impl") -> None:
    """Raises ValueError unless `impl` (the `what` of the message) is one of `IMPLS`."""
    if impl not in IMPLS:
        raise ValueError(f"{what} must be one of {', '.join(IMPLS)}, got {impl!r}")


def pallas_backend(platform: str | None = None) -> str | None:
    """The Pallas backend of `platform` (default: JAX's): "triton" on GPU, "tpu" on TPU, None
    where Pallas only interprets (CPU)."""
    platform = jax.default_backend() if platform is None else platform
    return {"gpu": "triton", "cuda": "triton", "rocm": "triton", "tpu": "tpu"}.get(platform)


def triton_head_dim_problem(dim: int, name: str = "head_dim") -> str | None:
    """Why Triton's block shapes cannot take a head dimension `dim`, or None."""
    if dim < 16 or dim != next_pow2(dim):
        return f"Triton needs a power-of-two {name} >= 16, got {dim}"
    return None


def select_launch(
    impl: str,
    *,
    kernel: str,
    verified: frozenset[str],
    supports: Callable[[str], str | None],
) -> tuple[str | None, bool]:
    """The launch `impl` asks for: `(backend, interpret)`, backend None for the reference.

    Args:
        impl: one of `IMPLS` (see the module docstring).
        kernel: the kernel's name, for messages.
        verified: the Pallas backends on which "auto" takes the kernel for these operands (its
            compiled form checked on hardware there).
        supports: `supports(backend)` is None if the kernel takes the operands on `backend`
            ("triton", "tpu" or "interpret"), else why not.

    Raises:
        ValueError: an unknown impl, "pallas" where Pallas only interprets, or operands the
            kernel does not take (impl "pallas" / "pallas_interpret"; "auto" falls back).
    """
    check_impl(impl, f"{kernel} impl")
    backend = pallas_backend()
    if impl == "auto":
        usable = backend in verified and supports(backend) is None
        return (backend if usable else None), False
    if impl == "reference":
        return None, False
    interpret = impl == "pallas_interpret"
    if interpret:
        backend = "triton"  # the launch the interpreter runs; its shape limits do not apply
    elif backend is None:
        raise ValueError(
            f"impl 'pallas' needs a GPU or TPU; the {jax.default_backend()!r} backend can only "
            "interpret Pallas kernels (impl 'pallas_interpret')"
        )
    if why := supports("interpret" if interpret else backend):
        raise ValueError(f"the {kernel} kernel does not take these operands: {why}")
    return backend, interpret
