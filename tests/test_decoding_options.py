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
        (dict(method="jetspec++", foresight=2, pipeline=True), "pipeline must be None or one"),
        (dict(method="jetspec++", foresight=2, pipeline="ring"), "'spmd', 'mpmd', got 'ring'"),
        (
            dict(method="jetspec++", foresight_rule="best"),
            "foresight_rule must be one of calibrated, uncalibrated, geometric, got 'best'",
        ),
        (dict(method="jetspec", refine_passes=1, foresight=2), "refine_passes, foresight apply"),
        (dict(method="ar", pipeline="spmd"), "pipeline apply to method 'jetspec\\+\\+' only"),
        (dict(method="jetspec++", refine_passes=1, refreshes=2), "refine_passes=1\\]"),
        (dict(method="jetspec++", pipeline="mpmd"), "set foresight >= 1"),
        (dict(method="jetspec++", foresight_rule="geometric"), "set foresight >= 1"),
        (dict(method="ar", foresight_rule="uncalibrated"), "set foresight >= 1"),
        (dict(method="jetspec++", replacement_confidence=0.5), "set refreshes >= 1"),
        # The value is checked first: adding refreshes must not reveal a second problem.
        (dict(method="jetspec++", replacement_confidence=1.5), "must be in \\[0, 1\\], got 1.5"),
        (dict(method="jetspec", block_size=1), "block_size must be an integer >= 2, got 1"),
        (dict(method="jetspec", block_size=4.0), "block_size must be an integer >= 2"),
        (dict(method="ar", block_size=4), "method 'ar' drafts none"),
        (
            dict(method="jetspec++", refine_passes=1, refreshes=1, replacement_confidence=1.5),
            "replacement_confidence must be in \\[0, 1\\], got 1.5",
        ),
    ],
)
def test_bad_options_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodingOptions(**kwargs)


def test_good_options():
    assert DecodingOptions() == DecodingOptions(method="ar")
    options = DecodingOptions("jetspec++", np.int64(3), 3, 4, "geometric", "mpmd")
    assert (options.refine_passes, options.foresight, options.pipeline) == (3, 4, "mpmd")
    assert type(options.refine_passes) is int  # NumPy counts become plain ints
    assert hash(options) == hash(DecodingOptions("jetspec++", 3, 3, 4, "geometric", "mpmd"))
    assert options.replacement_confidence is None  # the draft's calibration decides
    assert DecodingOptions("jetspec", block_size=np.int32(4)).block_size == 4
    options = DecodingOptions("jetspec++", 1, 1, replacement_confidence=np.float32(0.5))
    assert options.replacement_confidence == 0.5 and type(options.replacement_confidence) is float


@pytest.mark.parametrize(
    "flags, pipeline",
    [([], None), (["--pipeline", "spmd"], "spmd"), (["--pipeline", "mpmd"], "mpmd")],
)
def test_serve_pipeline_flag(flags, pipeline, capsys):
    import serve

    args = serve._parser().parse_args(
        ["generate", "hi", "--method", "jetspec++", "--foresight", "2"] + flags
    )
    assert serve._decoding_options(args, None).pipeline == pipeline
    # The form is required: a bare --pipeline would take the next word (the prompt, or
    # `generate`) as its value.
    for argv in (["generate", "hi", "--pipeline", "ring"], ["--pipeline", "generate", "hi"]):
        with pytest.raises(SystemExit):
            serve._parser().parse_args(argv)
        assert "argument --pipeline: invalid choice" in capsys.readouterr().err


def test_serve_replacement_confidence_flag():
    import serve

    argv = ["generate", "hi", "--method", "jetspec++", "--refine-passes", "1", "--refreshes", "1"]
    args = serve._parser().parse_args(argv)
    assert serve._decoding_options(args, None).replacement_confidence is None
    args = serve._parser().parse_args(argv + ["--replacement-confidence", "0.7"])
    assert serve._decoding_options(args, None).replacement_confidence == 0.7


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "hi", "--refine-passes", "1", "--refreshes", "2"], "refreshes"),
        (["generate", "hi", "--method", "ar", "--foresight", "4"], "foresight"),
        (["--max-batch-size", "0"], "max_batch_size"),
        (["--refine-passes", "1", "--refreshes", "2"], "refreshes"),
        (["generate", "hi", "--chunk-steps", "0"], "--chunk-steps must be >= 1"),
        (["generate", "hi", "--top-p", "1.5"], "--top-p must be in [0, 1]"),
        (["generate", "hi", "--method", "ar", "--block-size", "4"], "method 'ar' drafts none"),
        # --target without --draft (or --method) decodes autoregressively.
        (
            ["generate", "hi", "--target", "T", "--refine-passes", "1"],
            "not 'ar' (--target without --draft decodes autoregressively",
        ),
        (["--target", "T", "--foresight", "4"], "--target without --draft decodes"),
        (["--target", "T", "--max-batch-size", "0"], "max_batch_size"),  # no drafting hint
        # Paths, after the flags: a missing one fails before the load, not minutes into it.
        (["generate", "hi", "--target", "T"], "--target T: no such directory"),
        (["generate", "hi", "--draft", "D"], "--draft D: no such directory"),
    ],
)
def test_bad_serve_flags_fail_before_the_model_load(argv, message, monkeypatch, capsys):
    import jetspec_jax
    import serve

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(jetspec_jax, "load_target", no_load)
    assert serve.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert ("without --draft" in err) == ("without --draft" in message)
