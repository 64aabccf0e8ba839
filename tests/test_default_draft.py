"""The draft shipped for the default model: small, fits its target, trained, lossless, the default.

These run the real 30-layer SmolLM2-135M-Instruct target with the shipped JetSpec++ checkpoint.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

import jetspec_jax
import serve
from jetspec_jax.checkpoint.bundle import read_manifest
from jetspec_jax.decoding.options import DecodingOptions
from jetspec_jax.default_model import DEFAULT_MODEL_NAME, default_draft_dir, served_model_name
from jetspec_jax.prompting import encode_prompt
from jetspec_jax.serving import ServerConfig, build_app
from jetspec_jax.serving.app import MODEL

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMPTS = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May?",
    "Write a Python function that returns the largest element of a list.",
    "Explain in three sentences why the sky is blue.",
)
# On these prompts a random draft of this target reaches tau 1.01; the shipped one ~1.3.
TRAINED_TAU = 1.15


@pytest.fixture(scope="module")
def target(default_model_dir):
    return jetspec_jax.load_target()


@pytest.fixture(scope="module")
def draft(target):
    return jetspec_jax.load_draft(default_draft_dir(), target)


@pytest.fixture(scope="module")
def prompts(target):
    return [encode_prompt(target.tokenizer, p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def ar_results(target, prompts):
    """AR's greedy output, shared: compiling the 30-layer target costs more than decoding."""
    return jetspec_jax.generate_batch(target, prompts, max_new_tokens=32)


def test_shipped_checkpoint_is_a_small_bfloat16_jetspec_pp_bundle():
    path = default_draft_dir()
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert size <= 40e6, f"the shipped draft is {size / 1e6:.1f} MB (at most 40 MB)"
    manifest = read_manifest(path)
    assert manifest["dtype"] == "bfloat16"
    assert manifest["contents"] == ["draft", "adapter", "calibration"]


def test_shipped_draft_fits_the_default_target(draft, target):
    assert draft.config.variant == "jetspec++"
    assert draft.adapter is not None and draft.calibration is not None
    # Fitted (train.py calibrate): refinement acts on the adapter only where it is confident.
    assert 0 < draft.calibration.replacement_confidence < 1
    assert draft.dtype == target.dtype == "float32"  # served in the target's dtype
    assert max(draft.config.target_layer_ids) < target.config.num_layers


def test_shipped_draft_is_lossless_and_trained(draft, target, prompts, ar_results):
    """Greedy JetSpec++ output equals AR's token for token, and the draft is better than noise."""
    # About 70 rounds: enough for the tau bound (compiling the 30 layers costs the most).
    spec = jetspec_jax.generate_batch(
        target, prompts, draft=draft, method="jetspec++", max_new_tokens=32
    )
    for a, s in zip(ar_results, spec, strict=True):
        assert s.tokens == a.tokens and len(a.tokens) == 32  # no row stopped early
    rounds = [n for s in spec for n in s.acceptance_lengths[1:]]  # the prefill's token excluded
    tau = sum(rounds) / len(rounds)
    assert tau >= TRAINED_TAU, f"tau {tau:.2f}"


@pytest.mark.parametrize(
    "flags, method, shipped",
    [
        ([], "jetspec++", True),
        (["--method", "jetspec++"], "jetspec++", True),
        (["--method", "ar"], "ar", False),
    ],
)
def test_serve_flags_choose_the_shipped_draft_for_the_default_model(
    flags, method, shipped, default_model_dir
):
    args = serve._parser().parse_args(["generate", "hi", *flags])
    _, draft = serve._load_models(args)
    assert (draft is not None and draft.path == default_draft_dir()) == shipped
    assert serve._decoding_options(args, draft).method == method


def test_serve_flags_a_draft_without_method_runs_its_variant(target, tmp_path):
    draft_dir = jetspec_jax.init_draft(target, variant="jetspec", block_size=4).save(tmp_path / "d")
    args = serve._parser().parse_args(["generate", "hi", "--draft", str(draft_dir)])
    _, draft = serve._load_models(args)
    assert serve._decoding_options(args, draft).method == "jetspec"
    other_target = serve._parser().parse_args(["generate", "hi", "--target", str(target.path)])
    assert serve._load_models(other_target)[1] is None  # another target: AR unless told
    with pytest.raises(ValueError, match="--method must be one of"):
        serve._load_models(serve._parser().parse_args(["generate", "hi", "--method", "eagle"]))


def test_readme_main_command_runs_jetspec_pp_with_no_flags(target, ar_results, default_cache):
    """`python serve.py generate "PROMPT"`: the shipped draft, JetSpec++, AR's greedy text."""
    # Greedy: AR's first 16 tokens are what AR gives with a budget of 16.
    expected = target.tokenizer.decode(ar_results[0].tokens[:16], skip_special_tokens=True)
    proc = subprocess.run(
        [sys.executable, "serve.py", "generate", PROMPTS[0], "--max-new-tokens", "16"],
        cwd=ROOT,
        env={  # the compilation cache as on a user's machine, not the session's
            **{k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"},
            "JETSPEC_JAX_CACHE": str(default_cache),
            "JAX_ENABLE_COMPILATION_CACHE": "true",
        },
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == expected.strip()
    assert "[jetspec++ J0-R0]" in proc.stderr and "tau" in proc.stderr
    # The compiled programs were kept for the next run, in the cache beside the default model.
    assert any((default_cache / "xla").iterdir())


def test_bench_harness_serves_jetspec_pp_with_the_shipped_draft(
    default_model_dir, tmp_path, monkeypatch
):
    """With no --target and no --draft the harness benchmarks the shipped draft. (Its output on
    this target is AR's: test_shipped_draft_is_lossless_and_trained; the harness's runs and
    checks: test_bench.py.)"""
    from jetspec_jax.bench import runner
    from jetspec_jax.bench.__main__ import main

    class Captured(Exception):
        pass

    def capture(target, datasets, methods, drafts, **kwargs):
        raise Captured(drafts)

    monkeypatch.setattr(runner, "run_benchmark", capture)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "0", "prompt": PROMPTS[0], "source": "gsm8k"}) + "\n")
    with pytest.raises(Captured) as captured:
        main(["--prompts", str(prompts), "--methods", "jetspec++"])
    (drafts,) = captured.value.args
    assert list(drafts) == ["jetspec++"] and drafts["jetspec++"].path == default_draft_dir()


def test_the_server_serves_the_default_model_by_its_name(target, tmp_path, monkeypatch):
    """Clients ask for "SmolLM2-135M-Instruct", not for the cache directory's name, whether the
    server is `serve.py`'s or a `BackgroundServer`."""
    assert served_model_name(target.path) == DEFAULT_MODEL_NAME
    assert served_model_name(tmp_path / "Llama-3.2-1B") == "Llama-3.2-1B"
    assert served_model_name(None) == "jetspec"
    monkeypatch.chdir(tmp_path)
    assert served_model_name(pathlib.Path(".")) == tmp_path.name  # `--target .`
    app = build_app(target, None, ServerConfig(decoding=DecodingOptions(method="ar")))
    assert app[MODEL].name == DEFAULT_MODEL_NAME
    args = serve._parser().parse_args(["--method", "ar", "--model-name", "mine"])
    assert serve._server_config(args, None).model_name == "mine"


def test_the_api_key_comes_from_the_flag_else_the_environment(monkeypatch):
    parse = serve._parser().parse_args
    monkeypatch.delenv("JETSPEC_API_KEY", raising=False)
    assert serve._server_config(parse(["--method", "ar"]), None).api_key is None
    monkeypatch.setenv("JETSPEC_API_KEY", "from-env")
    assert serve._server_config(parse(["--method", "ar"]), None).api_key == "from-env"
    flagged = parse(["--method", "ar", "--api-key", "from-flag"])
    assert serve._server_config(flagged, None).api_key == "from-flag"
