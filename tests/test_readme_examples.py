"""The README's Python examples run as written, so the documented API cannot drift from the code.

The examples name real checkpoints ("path/to/Qwen3-0.6B", the default model, the shipped draft);
here every `load_target` gets the tiny random Qwen3 (with a character tokenizer) and every
`load_draft` a tiny JetSpec++ draft saved for it, with the README's other arguments passed
through. Every other line runs unchanged, in one namespace, in order, in a scratch directory.
"""

from __future__ import annotations

import pathlib
import re

import jetspec_jax
from tests.text_fixtures import with_tokenizer

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_examples() -> list[str]:
    """The README's ```python blocks that use the library (the OpenAI client needs a server)."""
    blocks = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.M | re.S)
    return [b for b in blocks if "from openai" not in b]


def test_readme_has_the_api_examples():
    examples = python_examples()
    assert len(examples) >= 3, "the README's Python API examples were not found"
    assert "jetspec_jax.generate(" in examples[0]


def test_readme_python_examples_run(checkpoints, tmp_path, monkeypatch):
    tiny = with_tokenizer(checkpoints.get("qwen3")[0], tmp_path / "tiny_target")
    load_target, load_draft = jetspec_jax.load_target, jetspec_jax.load_draft
    target = load_target(tiny)
    tiny_draft = jetspec_jax.init_draft(target, variant="jetspec++", num_layers=1, block_size=4)
    tiny_draft = tiny_draft.save(tmp_path / "tiny_draft")

    targets_asked, drafts_asked = [], []

    def fake_load_target(path=None, **kwargs):
        targets_asked.append(path)
        return load_target(tiny, **kwargs)

    def fake_load_draft(path, target, **kwargs):
        drafts_asked.append(path)
        return load_draft(tiny_draft, target, **kwargs)

    monkeypatch.setattr(jetspec_jax, "load_target", fake_load_target)
    monkeypatch.setattr(jetspec_jax, "load_draft", fake_load_draft)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for example in python_examples():
        exec(compile(example, str(README), "exec"), namespace)

    assert targets_asked == [None, "path/to/Qwen3-0.6B"]
    assert drafts_asked == ["path/to/draft", jetspec_jax.default_draft_dir()]
    # What the examples save is loadable again.
    exported = load_target(tmp_path / "exported")
    assert exported.config == namespace["target"].config
    load_draft(tmp_path / "exported-draft", exported)
