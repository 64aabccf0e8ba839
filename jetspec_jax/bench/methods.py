"""Benchmark method specs: "ar", "dflash", "jetspec", "jetspec++" and "jetspec++-J<j>"."""

from __future__ import annotations

import dataclasses
import re

from jetspec_jax.decoding.session import METHODS

_SPEC = re.compile(r"^(ar|dflash|jetspec|jetspec\+\+)(?:-J(\d+))?(?:-R(\d+))?$")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration.

    Attributes:
        name: as given (the row label), e.g. "jetspec++-J2".
        method: the decoding method ("ar" or a draft variant).
        refine_passes: J, Jacobi refinement passes (jetspec++ only).
    """

    name: str
    method: str
    refine_passes: int = 0

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated specs; "ar" is added first when missing (speedups are measured against
    it). `-J<j>` sets jetspec++'s refinement passes; `-R<r>` (context refreshes) needs the
    adapter/decoder, which this version does not have, and is refused."""
    specs = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        match = _SPEC.match(name)
        if match is None:
            raise ValueError(
                f"unknown method {name!r}; use {', '.join(METHODS)} or jetspec++-J<passes>"
            )
        method, passes, refreshes = match.groups()
        if passes is not None and method != "jetspec++":
            raise ValueError(f"{name!r}: refinement passes (-J) apply to jetspec++ only")
        if refreshes not in (None, "0"):
            raise ValueError(
                f"{name!r}: context refreshes (-R) need the adapter and decoder, not available yet"
            )
        specs.append(MethodSpec(name, method, int(passes or 0)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"methods are repeated in {text!r}")
    if not any(s.method == "ar" for s in specs):
        specs.insert(0, MethodSpec("ar", "ar"))
    return specs
