"""`DecodingOptions` refuses bad values on construction, naming them (no model needed)."""

from __future__ import annotations

import numpy as np
import pytest

from jetspec_jax import DecodingOptions


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(method="medusa"), "unknown method 'medusa'"),
        (dict(method="jetspec++", refine_passes=-1), "refine_passes must be an integer >= 0"),
        (dict(method="jetspec++", refine_passes=1.5), "refine_passes must be an integer >= 0"),
        (dict(method="jetspec++", foresight=True), "foresight must be an integer >= 0"),
        (dict(method="jetspec++", foresight=2, pipeline=1), "pipeline must be True or False"),
        (dict(method="jetspec++", foresight_rule="best"), "unknown selection rule 'best'"),
        (dict(method="jetspec", refine_passes=1, foresight=2), "refine_passes, foresight apply"),
        (dict(method="ar", pipeline=True), "pipeline apply to method 'jetspec\\+\\+' only"),
        (dict(method="jetspec++", refine_passes=1, refreshes=2), "refine_passes=1\\]"),
        (dict(method="jetspec++", pipeline=True), "set foresight >= 1"),
    ],
)
def test_bad_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodingOptions(**kwargs)


def test_good_options():
    assert DecodingOptions() == DecodingOptions(method="ar")
    options = DecodingOptions("jetspec++", np.int64(3), 3, 4, "geometric", True)
    assert (options.refine_passes, options.foresight, options.pipeline) == (3, 4, True)
    assert hash(options) == hash(DecodingOptions("jetspec++", 3, 3, 4, "geometric", True))
