"""The command-line programs' console: their log lines."""

from __future__ import annotations

import logging

from jetspec_jax import console

NOTICE = (
    "Unable to initialize backend 'tpu': INTERNAL: Failed to open libtpu.so: libtpu.so: cannot "
    "open shared object file: No such file or directory"
)


def test_the_absent_tpu_runtime_notice_is_left_out_and_other_backend_failures_kept(
    caplog, monkeypatch
):
    """JAX logs at INFO, on every CPU and GPU host, that it found no TPU runtime: a line that
    reads as an error in every `-v` run and every server start. Only that notice is dropped."""
    configured = []  # the suite's handlers stay
    monkeypatch.setattr(logging, "basicConfig", lambda **kwargs: configured.append(kwargs))
    jax_logger = logging.getLogger("jax._src.xla_bridge")
    try:
        console.configure_logging(logging.INFO)
        with caplog.at_level(logging.INFO):
            jax_logger.info(NOTICE)
            jax_logger.info("Unable to initialize backend 'cuda': no CUDA devices")
            jax_logger.info("Unable to initialize backend 'tpu': TPU is already in use")
        assert [r.getMessage() for r in caplog.records] == [
            "Unable to initialize backend 'cuda': no CUDA devices",
            "Unable to initialize backend 'tpu': TPU is already in use",
        ]
        assert [kwargs["level"] for kwargs in configured] == [logging.INFO]  # `-v`'s level
    finally:
        jax_logger.filters.clear()


def test_every_program_configures_its_logging_so(tmp_path, monkeypatch):
    """serve.py, train.py and the bench set their logging up with `configure_logging`."""
    import serve
    import train
    from jetspec_jax.bench import __main__ as bench

    levels = []

    def record(level):
        levels.append(level)
        raise SystemExit(0)  # stop before any model loads

    monkeypatch.setattr(console, "configure_logging", record)
    missing = str(tmp_path / "missing.jsonl")
    for main, argv in (
        (serve.main, ["generate", "hi", "-v"]),
        (train.main, ["regenerate", "--prompts", missing, "--out", str(tmp_path / "o.jsonl")]),
        (bench.main, ["--prompts", missing]),
    ):
        try:
            main(argv)
        except SystemExit:
            pass
    assert levels == [logging.INFO, logging.WARNING, logging.WARNING]
