"""`Calibration`: how far the proxy (adapter + decoder) can be trusted, as fitted by
`train.py calibrate` (`training/calibrate.py`) and stored with the draft (`calibration.json`).

Two temperatures score foresight's outcomes (`decoding/outcomes.py` says how), and the
replacement confidence gates refinement's anchor replacement (`decoding/refinement.py`).
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from collections.abc import Mapping

import numpy as np

from jetspec_jax.decoding.refinement import check_replacement_confidence
from jetspec_jax.sampling import MIN_TEMPERATURE
from jetspec_jax.scalars import as_real

_SETTING = re.compile(r"J\d+-R\d+")
_MAX_FLOAT32 = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class Calibration:
    """What `train.py calibrate` fits of how far the proxy (adapter + decoder) can be trusted
    (frozen and hashable: a valid static jit argument).

    Attributes:
        acceptance_temperature: divides the decoder's logits when scoring draft acceptance.
        bonus_temperature: divides the decoder's logits when scoring the bonus token.
        replacement_confidence: the decoder probability above which refinement's anchor
            replacement trusts the proxy (`decoding/refinement.py`); 0, the paper's rule, when a
            calibration file predates it.
        fitted_for: the refinement setting `"Jj-Rr"` whose drafts the values were fitted on
            (`train.py calibrate`), or None (given by hand, or a file that predates the field).
            Information only: it does not take part in equality or hashing.
    """

    acceptance_temperature: float = 1.0
    bonus_temperature: float = 1.0
    replacement_confidence: float = 0.0
    fitted_for: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        for name in ("acceptance_temperature", "bonus_temperature"):
            value = as_real(getattr(self, name))
            # Used in float32: far smaller values flush to 0 there (every score NaN), and values
            # beyond its range turn infinite (every score equal).
            if value is None or not MIN_TEMPERATURE <= value <= _MAX_FLOAT32:
                raise ValueError(
                    f"{name} must be a finite number >= {MIN_TEMPERATURE:g} (float32 scores), "
                    f"got {getattr(self, name)!r}"
                )
            object.__setattr__(self, name, value)
        confidence = check_replacement_confidence(self.replacement_confidence)
        object.__setattr__(self, "replacement_confidence", confidence)
        if self.fitted_for is not None and not (
            isinstance(self.fitted_for, str) and _SETTING.fullmatch(self.fitted_for)
        ):
            raise ValueError(f"fitted_for must be a setting like 'J1-R1', got {self.fitted_for!r}")

    def warn_if_fitted_for_another(self, refine_passes: int, refreshes: int) -> None:
        """A `UserWarning` (Python shows each message once) when these values serve another
        `Jj-Rr` than they were fitted for: its drafts, hence the best confidence and
        temperatures, differ.

        Settings compare by the drafts they make: `refreshes` counts the refreshes that run,
        and a fit whose replacement confidence is 1 ran none, so its `Jj-Rr` drafted as
        `Jj-R0` (`refinement.refining_proposer`)."""
        if self.fitted_for is None:
            return
        served = f"J{refine_passes}-R{refreshes}"
        drafted = self.fitted_for
        if self.replacement_confidence == 1.0:
            drafted = re.sub(r"R\d+$", "R0", drafted)
        if drafted != served:
            fitted = self.fitted_for
            if drafted != fitted:
                fitted += f" (replacement confidence 1 runs no refresh: it drafted as {drafted})"
            # Warned from this line whoever asks (the draft's proposer, then foresight for the
            # same session): Python's filter then shows the message once, not once per caller.
            warnings.warn(
                f"the draft's calibration was fitted for {fitted} and serves {served}: "
                f"refit it for this setting with train.py calibrate --refine-passes "
                f"{refine_passes} --refreshes {refreshes}",
                stacklevel=1,
            )

    def to_dict(self) -> dict[str, float]:
        """JSON-ready `{name: value}`."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping) -> Calibration:
        """The inverse of `to_dict`; missing keys take their defaults, unknown keys are refused."""
        if not isinstance(data, Mapping):
            raise ValueError(f"calibration must be a JSON object, got {type(data).__name__}")
        known = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(str(key) for key in data if key not in known)
        if unknown:
            raise ValueError(
                f"unknown calibration key(s) {unknown}; expected a subset of {sorted(known)}"
            )
        return cls(**data)
