"""Reading the programs the decode sessions compiled (`session.COMPILED`), for tests that check
what XLA made of them (which buffers it copies)."""

from __future__ import annotations

from collections.abc import Iterable

from jetspec_jax.decoding.session import COMPILED


def compiled_program(name: str) -> str:
    """The HLO text of the one compiled program of the jitted function `name`."""
    (text,) = compiled_programs(name)
    return text


def compiled_programs(name: str) -> list[str]:
    """The HLO texts of the compiled programs of the jitted function `name` (one per shape)."""
    texts = [e.as_text() for e in COMPILED._executables.values()]
    return [text for text in texts if text.startswith(f"HloModule jit_{name}")]


def copies_shaped_like(hlo: str, shapes: Iterable[tuple[int, ...]]) -> list[str]:
    """The `copy` ops of `hlo` whose result has one of `shapes` (a whole cache's, say).

    The search is textual, so it first checks that it finds `copy` ops at all (the program holds
    small ones): an empty answer then means none of these shapes, not a format it cannot read.
    """
    copies = [line for line in hlo.splitlines() if " copy(" in line]
    assert copies, "no copy op found at all: has the HLO text format changed?"
    wanted = {"[" + ",".join(map(str, shape)) + "]{" for shape in shapes}
    return [line for line in copies if any(shape in line for shape in wanted)]
