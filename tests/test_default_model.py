"""The embedded default model end to end: real 30-layer Llama parity, chat prompts, the CLI."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

import jetspec_jax
from jetspec_jax.prompting import encode_prompt

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def target(default_model_dir):
    return jetspec_jax.load_target()  # None: the default model, found in the session's cache


def test_default_target_is_smollm2(target, default_model_dir):
    assert target.path == default_model_dir
    c = target.config
    assert (c.model_type, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads) == (
        "llama",
        30,
        576,
        9,
        3,
    )
    assert target.stop_token_ids == (2,)  # <|im_end|>
    assert target.tokenizer.chat_template


def test_real_model_logits_match_transformers(target, default_model_dir):
    ids = encode_prompt(target.tokenizer, "What is the capital of France?", chat=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(default_model_dir).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits.numpy()
    np.testing.assert_allclose(np.asarray(target.logits([ids])), ref, atol=1e-3, rtol=0)
    # Logits here reach ~30 in magnitude over 30 layers: 1e-3 absolute is ~1e-5 relative.
    assert np.max(np.abs(ref)) > 10


def test_chat_prompt_equals_the_template_tokens(target):
    ids = encode_prompt(target.tokenizer, "Hi there", chat=True, system="Be brief.")
    rendered = target.tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert target.tokenizer.decode(ids) == rendered
    with pytest.raises(ValueError, match="needs the chat template"):
        encode_prompt(target.tokenizer, "Hi", chat=False, system="Be brief.")


def test_serve_generate_cli_reports_bad_input_without_traceback(default_cache, default_model_dir):
    env = {**os.environ, "JETSPEC_JAX_CACHE": str(default_cache)}
    proc = subprocess.run(
        [sys.executable, "serve.py", "generate", "Hi", "--temperature", "-1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2
    assert "error: --temperature must be" in proc.stderr and "Traceback" not in proc.stderr
