"""Benchmark method specs: a method name and JetSpec++'s settings in one label.

    ar | dflash | jetspec[-K<k>] | jetspec++[-K<k>][-J<j>][-R<r>][-C<c>][-F<b>][-spmd|-mpmd]

`-K<k>` drafts blocks of k positions, shorter than the draft's trained block (causal drafts
only: a DFlash draft refuses it); then JetSpec++'s settings: `-J<j>` refinement passes, `-R<r>`
context refreshes (r <= j; needs an adapter), `-C<c>` their replacement confidence in [0, 1]
(default: the draft's calibration; `-C0`: the paper's rule), `-F<b>` foresight with B candidate
blocks (needs an adapter and a calibration: the outcomes are scored "calibrated"), `-spmd` /
`-mpmd` the foresight round pipelined over two devices. Each spec is a `DecodingOptions`, which
validates it.
"""

from __future__ import annotations

import dataclasses
import re

from jetspec_jax.decoding.options import METHODS, DecodingOptions

_SPEC = re.compile(
    r"^(ar|dflash|jetspec|jetspec\+\+)(?:-K(\d+))?(?:-J(\d+))?(?:-R(\d+))?"
    r"(?:-C(\d+(?:\.\d+)?))?(?:-F(\d+))?(?:-(spmd|mpmd))?$"
)


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """One benchmarked configuration.

    Attributes:
        name: as given (the row label), e.g. "jetspec++-J1-R1-F4".
        options: how it decodes.
    """

    name: str
    options: DecodingOptions

    @property
    def method(self) -> str:
        return self.options.method

    @property
    def speculative(self) -> bool:
        return self.method != "ar"


def parse_method(name: str) -> MethodSpec:
    """One spec (see the module doc).

    Raises:
        ValueError: naming the spec and what is wrong with it.
    """
    match = _SPEC.match(name)
    if match is None:
        raise ValueError(
            f"unknown method {name!r}; use {', '.join(METHODS)} or "
            "jetspec++[-K<k>][-J<j>][-R<r>][-C<c>][-F<b>][-spmd|-mpmd]"
        )
    method, block, passes, refreshes, confidence, foresight, pipeline = match.groups()
    jetspec_pp_settings = (passes, refreshes, confidence, foresight, pipeline)
    if method != "jetspec++" and any(x is not None for x in jetspec_pp_settings):
        # "ar-J0" would decode as AR under another label, and the speedups look AR up by "ar".
        raise ValueError(
            f"{name!r}: only jetspec++ takes -J, -R, -C, -F, -spmd / -mpmd; use "
            f"{method + ('' if block is None else f'-K{block}')!r}"
        )
    try:
        options = DecodingOptions(
            method,
            block_size=None if block is None else int(block),
            refine_passes=int(passes or 0),
            refreshes=int(refreshes or 0),
            replacement_confidence=None if confidence is None else float(confidence),
            foresight=int(foresight or 0),
            pipeline=pipeline,
        )
    except ValueError as e:
        raise ValueError(f"{name!r}: {e}") from None
    return MethodSpec(name, options)


def parse_methods(text: str) -> list[MethodSpec]:
    """Comma-separated specs; "ar" is added first when missing (speedups are measured against
    it).

    Raises:
        ValueError: for a bad spec, a repeated one, or two that decode the same way.
    """
    specs = [parse_method(name) for name in (p.strip() for p in text.split(",")) if name]
    if len({s.name for s in specs}) != len(specs):
        raise ValueError(f"methods are repeated in {text!r}")
    # Two labels of one decoding ("jetspec++" and "jetspec++-J0-F0") would time it twice as if
    # they were different rows.
    first_label = {}
    for spec in specs:
        same = first_label.setdefault(spec.options, spec.name)
        if same != spec.name:
            raise ValueError(f"{same!r} and {spec.name!r} in {text!r} decode the same way")
    if not any(s.method == "ar" for s in specs):
        specs.insert(0, parse_method("ar"))
    return specs
