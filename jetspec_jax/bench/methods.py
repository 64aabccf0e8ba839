"""Benchmark method specs: "ar", "dflash", "jetspec", "jetspec++" and "jetspec++-J<j>"."""

from __future__ import annotations

import dataclasses
import re

from jetspec_jax.decoding.options import METHODS

_SPEC = re.compile(r"^(ar|dflash|jetspec|jetspec\+\+)(?:-J(\d+))?(?:-R(\d+))?$")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration.

    Attributes:
        name: as given (the row label), e.g. "jetspec++-J2".
        method: the decoding method ("ar" or a draft variant).
        refine_passes: J, Jacobi refinement passes (jetspec++ only).
        refreshes: R <= J, context refreshes with anchor replacement (jetspec++ with an adapter).
    """

    name: str
    method: str
    refine_passes: int = 0
    refreshes: int = 0

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated specs; "ar" is added first when missing (speedups are measured against
    it). `-J<j>` sets jetspec++'s refinement passes and `-R<r>` its context refreshes (r <= j;
    the draft needs an adapter)."""
    specs = []
    for name in (part.strip() for part in text.split(",")):
        if not name:
            continue
        match = _SPEC.match(name)
        if match is None:
            raise ValueError(
                f"unknown method {name!r}; use {', '.join(METHODS)} or jetspec++-J<j>-R<r>"
            )
        method, passes, refreshes = match.groups()
        if (passes is not None or refreshes is not None) and method != "jetspec++":
            raise ValueError(f"{name!r}: refinement (-J, -R) applies to jetspec++ only")
        if int(refreshes or 0) > int(passes or 0):
            raise ValueError(f"{name!r}: each refresh precedes a pass, so R must be <= J")
        specs.append(MethodSpec(name, method, int(passes or 0), int(refreshes or 0)))
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"methods are repeated in {text!r}")
    if not any(s.method == "ar" for s in specs):
        specs.insert(0, MethodSpec("ar", "ar"))
    return specs
