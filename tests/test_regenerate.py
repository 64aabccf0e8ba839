"""Regenerating training responses with the target: output format, resume, errors, the CLI.

Uses a tiny random target with a character tokenizer and chat template (`text_fixtures`): the
regeneration is model-agnostic, and the real default model's text path is tested elsewhere
(test_default_model.py, test_default_draft.py).
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import jetspec_jax
from jetspec_jax.data.jsonl import read_jsonl
from jetspec_jax.data.prompts import MATH_SUFFIX, read_prompts
from jetspec_jax.data.regenerate import check_output_path, read_records, regenerate, settings_path
from jetspec_jax.prompting import PromptEncoding, encode_prompt
from jetspec_jax.sampling import row_seed
from tests.text_fixtures import char_tokenizer, with_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_NEW = 8
BATCH = 2
FIELDS = {"id", "source", "prompt_ids", "response_ids", "response", "finish_reason"}
FILE_A = [
    {"id": "gsm-1", "prompt": "What is 2 + 3?", "source": "gsm8k"},
    {"id": "alp-1", "prompt": "Name a color.", "source": "alpaca"},
    {"id": "alp-2", "prompt": "Say hi.", "source": "alpaca"},
]
FILE_B = [
    {"id": "gsm-2", "prompt": "What is 10 - 4?", "source": "gsm8k"},
    {"id": "mbpp-1", "prompt": "Write a function that adds two numbers.", "source": "mbpp"},
]
RECORDS = FILE_A + FILE_B


def _write_jsonl(path: pathlib.Path, records: list[dict]) -> pathlib.Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def _read_by_id(path: pathlib.Path) -> dict[str, dict]:
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    by_id = {line["id"]: line for line in lines}
    assert len(by_id) == len(lines), "duplicate ids in the output"
    return by_id


@pytest.fixture(scope="module")
def target_dir(checkpoints, tmp_path_factory) -> pathlib.Path:
    return with_tokenizer(checkpoints.get("qwen3")[0], tmp_path_factory.mktemp("text") / "tiny")


@pytest.fixture(scope="module")
def target(target_dir, cli_run):
    # Requests `cli_run` so that the CLI's model load and compilation overlap ours.
    return jetspec_jax.load_target(target_dir, show_progress=False)


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory) -> list[pathlib.Path]:
    root = tmp_path_factory.mktemp("prompts")
    return [_write_jsonl(root / "a.jsonl", FILE_A), _write_jsonl(root / "b.jsonl", FILE_B)]


@pytest.fixture(scope="module")
def cli_run(target_dir, prompt_files, tmp_path_factory):
    """`train.py regenerate` on the first 3 prompts, started in the background: (process, out)."""
    out = tmp_path_factory.mktemp("cli") / "cli.jsonl"
    args = ["regenerate", "--prompts", *map(str, prompt_files), "--out", str(out)]
    flags = ["--target", str(target_dir), "--max-new-tokens", "4", "--batch-size", "4"]
    proc = _start_cli([*args, *flags, "--limit", "3"])
    yield proc, out
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


@pytest.fixture(scope="module")
def uninterrupted(target, prompt_files, tmp_path_factory) -> pathlib.Path:
    """The output of one uninterrupted run over all prompts."""
    out = tmp_path_factory.mktemp("full") / "out.jsonl"
    summary = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (summary.written, summary.skipped_existing, summary.total) == (5, 0, 5)
    return out


def test_lines_hold_the_fields_and_equal_generating_alone(target, uninterrupted):
    lines = _read_by_id(uninterrupted)
    assert set(lines) == {r["id"] for r in RECORDS}
    for record in RECORDS:
        line = lines[record["id"]]
        assert set(line) == FIELDS and line["source"] == record["source"]
        suffix = MATH_SUFFIX if record["source"] == "gsm8k" else ""
        ids = encode_prompt(target.tokenizer, record["prompt"] + suffix, chat=True)
        assert line["prompt_ids"] == ids
        alone = jetspec_jax.generate(target, ids, max_new_tokens=MAX_NEW)
        assert line["response_ids"] == alone.tokens
        assert line["finish_reason"] == alone.finish_reason
        assert line["response"] == target.tokenizer.decode(alone.tokens, skip_special_tokens=True)


def test_math_suffix_only_for_gsm8k_sources(target, uninterrupted):
    lines = _read_by_id(uninterrupted)
    for record in RECORDS:
        text = target.tokenizer.decode(lines[record["id"]]["prompt_ids"])
        tail = MATH_SUFFIX.strip()  # the character tokenizer has no newline
        assert (tail in text) == (record["source"] == "gsm8k"), record["id"]


def test_resume_after_limit_equals_uninterrupted_run(target, prompt_files, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    first = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW, limit=2)
    assert (first.written, first.skipped_existing, first.total) == (2, 0, 2)
    second = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (second.written, second.skipped_existing, second.total) == (3, 2, 5)
    assert _read_by_id(out) == _read_by_id(uninterrupted)
    again = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (again.written, again.skipped_existing) == (0, 5)


def test_resuming_after_a_prompt_changed_is_refused(target, prompt_files, uninterrupted, tmp_path):
    """The resumed run would keep the response to the old prompt under the id."""
    out = tmp_path / "out.jsonl"
    out.write_bytes(uninterrupted.read_bytes())
    settings_path(out).write_bytes(settings_path(uninterrupted).read_bytes())
    first = json.loads(prompt_files[0].read_text().splitlines()[0])
    edited = _write_jsonl(tmp_path / "a.jsonl", [{**first, "prompt": first["prompt"] + "?"}])
    before = out.read_bytes()
    with pytest.raises(ValueError, match=f"response for id {first['id']!r} to another prompt"):
        regenerate(target, [edited, prompt_files[1]], out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert out.read_bytes() == before


def test_responses_cut_at_the_budget_are_counted(
    target, uninterrupted, prompt_files, tmp_path, caplog
):
    """Unfinished answers (stopped at max_new_tokens, not at a stop token) are counted and
    logged: training on many of them teaches a draft truncated text."""
    first = next(iter(_read_by_id(uninterrupted).values()))
    stops = dataclasses.replace(target, stop_token_ids=(first["response_ids"][2],))
    out = tmp_path / "out.jsonl"
    summary = regenerate(stops, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    reasons = [line["finish_reason"] for line in _read_by_id(out).values()]
    assert 0 < summary.cut_at_budget == reasons.count("length") < summary.written
    assert f"{summary.cut_at_budget} of 5 responses stopped at max_new_tokens=8" in caplog.text


def test_resuming_with_other_settings_is_refused(target, prompt_files, tmp_path):
    """One output file, one data set: a resume with another budget, sampling or encoding would
    append responses of another kind to it."""
    out = tmp_path / "out.jsonl"
    regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW, limit=1)
    assert json.loads(settings_path(out).read_text())["max_new_tokens"] == MAX_NEW
    written = out.read_text()
    changes = [
        (dict(max_new_tokens=MAX_NEW + 1), f"max_new_tokens {MAX_NEW + 1} \\(generated with 8\\)"),
        (dict(sampling=jetspec_jax.SamplingParams(temperature=1.0)), "sampling"),
        (dict(system="Be brief."), "system 'Be brief.' \\(generated with None\\)"),
        (dict(math_suffix_sources=()), "math_suffix_sources"),  # suffixed and plain mixed
    ]
    for change, message in changes:
        with pytest.raises(ValueError, match=f"other settings; resuming would mix.*{message}"):
            regenerate(target, prompt_files, out, **{"max_new_tokens": MAX_NEW, **change})
        assert out.read_text() == written  # refused before generating
    bf16 = jetspec_jax.load_target(target.path, dtype="bfloat16")
    with pytest.raises(ValueError, match="target"):
        regenerate(bf16, prompt_files, out, max_new_tokens=MAX_NEW)
    # Another checkpoint of the same architecture (say base vs instruct), or other stop tokens.
    other_dir = shutil.copytree(target.path, tmp_path / "other_checkpoint")
    (other_dir / "generation_config.json").write_text('{"temperature": 0.7}')
    other = jetspec_jax.load_target(other_dir)
    assert other.config == target.config and other.dtype == target.dtype
    with pytest.raises(ValueError, match="other settings; resuming would mix.*target_files"):
        regenerate(other, prompt_files, out, max_new_tokens=MAX_NEW)
    other_stops = dataclasses.replace(target, stop_token_ids=(*target.stop_token_ids, 5))
    with pytest.raises(ValueError, match="other settings; resuming would mix.*stop_token_ids"):
        regenerate(other_stops, prompt_files, out, max_new_tokens=MAX_NEW)
    assert out.read_text() == written
    # A model card or a download cache beside the weights is not another checkpoint.
    documented = shutil.copytree(target.path, tmp_path / "documented_checkpoint")
    (documented / "README.md").write_text("# A model card")
    (documented / ".cache").mkdir()
    (documented / ".cache" / "model.safetensors.metadata").write_text("etag")
    documented_target = jetspec_jax.load_target(documented)
    resumed = regenerate(documented_target, prompt_files, out, max_new_tokens=MAX_NEW, limit=1)
    assert (resumed.written, resumed.skipped_existing) == (0, 1)
    # A new output (the old one deleted) records its own settings.
    out.unlink()
    regenerate(target, prompt_files, out, max_new_tokens=MAX_NEW + 1, limit=1)
    assert json.loads(settings_path(out).read_text())["max_new_tokens"] == MAX_NEW + 1
    with pytest.raises(ValueError, match="thinking is a chat-template switch"):
        regenerate(target, prompt_files, tmp_path / "raw.jsonl", chat=False, thinking=True)


def test_math_evaluation_prompts_get_the_suffix_unless_told_not_to(target, tmp_path):
    """As regeneration encodes a math record (`eval_math_suffix`, on by default), evaluation
    does; `math_suffix=False` evaluates the question as written."""
    from jetspec_jax.training.evaluate import eval_prompt_ids

    text = "What is 7 + 1?"
    questions = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": text, "source": "gsm8k"}])
    suffixed = encode_prompt(target.tokenizer, text + MATH_SUFFIX, chat=True)
    assert eval_prompt_ids(target, questions, num_prompts=1) == [suffixed]
    plain = encode_prompt(target.tokenizer, text, chat=True)
    assert eval_prompt_ids(target, questions, num_prompts=1, math_suffix=False) == [plain]


def test_text_evaluation_prompts_are_encoded_as_the_training_data_was(
    target, prompt_files, tmp_path, caplog
):
    """A draft trained on prompts with a system message (or raw ones) is evaluated on text prompts
    encoded alike: the encoding `regenerate` recorded, not the tokenizer's default."""
    from jetspec_jax.training.config import DataConfig, TrainConfig
    from jetspec_jax.training.evaluate import data_encoding, eval_prompt_ids
    from jetspec_jax.training.run_helpers import read_eval_prompts

    kwargs = dict(max_new_tokens=MAX_NEW, limit=0)  # the settings are recorded, no response
    briefed, plain, raw = (tmp_path / f"{n}.jsonl" for n in ("briefed", "plain", "raw"))
    regenerate(target, prompt_files, briefed, system="Be brief.", **kwargs)
    regenerate(target, prompt_files, plain, **kwargs)
    regenerate(target, prompt_files, raw, chat=False, **kwargs)
    text = "What is 7 + 1?"
    questions = _write_jsonl(tmp_path / "eval.jsonl", [{"prompt": text, "source": "alpaca"}])
    config = TrainConfig(data=DataConfig(files=(str(briefed),), eval_prompts=str(questions)))
    expected = encode_prompt(target.tokenizer, text, chat=True, system="Be brief.")
    assert read_eval_prompts(config, target, []) == [expected]
    default = encode_prompt(target.tokenizer, text, chat=True)  # no system message
    assert eval_prompt_ids(target, questions, num_prompts=1) == [default] != [expected]
    assert data_encoding([raw]) == PromptEncoding(chat=False)
    # A prompt that encodes to no tokens (an empty raw one) is named by its line.
    empty = _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": "Hi"}, {"prompt": ""}])
    with pytest.raises(ValueError, match="empty.jsonl:2: the prompt encodes to no tokens"):
        eval_prompt_ids(target, empty, num_prompts=2, encoding=PromptEncoding(chat=False))
    assert data_encoding([plain, raw, plain]) is None
    assert "encoded differently" in caplog.text
    # Data from before the settings were recorded: the default, said so in the log.
    settings_path(plain).unlink()
    with caplog.at_level(logging.INFO, logger="jetspec_jax.training.evaluate"):
        assert data_encoding([plain]) is None
    assert f"no prompt encoding recorded for {plain}" in caplog.text
    settings_path(raw).write_text('{"chat": "yes", "system": null, "thinking": false}')
    with pytest.raises(ValueError, match="'chat' and 'thinking' must be booleans"):
        data_encoding([raw])
    settings_path(raw).write_text('{"chat": true, "system": 5, "thinking": false}')
    with pytest.raises(ValueError, match="'system' must be a string or null"):
        data_encoding([raw])
    settings_path(raw).write_text("[]")
    with pytest.raises(ValueError, match="is not a JSON object"):
        data_encoding([raw])


def test_a_damaged_settings_file_is_named(tmp_path):
    """An empty, cut or non-object `<out>.settings.json` is named as damaged, by its path, when
    resuming and when its encoding or temperature is read: not a bare JSON error or TypeError."""
    from jetspec_jax.data.regenerate import (
        record_settings,
        recorded_encoding,
        recorded_temperature,
    )

    out = tmp_path / "out.jsonl"
    path = settings_path(out)
    for text, problem in (
        ("", "not valid JSON"),
        ('{"chat": tr', "not valid JSON"),
        ("[1]", "not a JSON object"),
    ):
        path.write_text(text)
        for read in (
            lambda: record_settings(path, {"chat": True}, resuming=True),
            lambda: recorded_encoding(out),
            lambda: recorded_temperature(out),
        ):
            with pytest.raises(ValueError, match=f"{path} is {problem}"):
                read()
    path.write_text(json.dumps({"sampling": {"temperature": 0.7, "seed": 0}}))
    assert recorded_temperature(out) == 0.7
    path.write_text(json.dumps({"chat": True}))  # recorded before sampling was
    assert recorded_temperature(out) is None
    path.unlink()
    assert recorded_temperature(out) is None and recorded_encoding(out) is None


def test_sampled_resume_equals_uninterrupted_run(target, prompt_files, uninterrupted, tmp_path):
    # Per-record seeds depend on the record's index only, not on which batch it lands in.
    sampling = jetspec_jax.SamplingParams(temperature=1.0, seed=3)
    kwargs = dict(batch_size=BATCH, max_new_tokens=MAX_NEW, sampling=sampling)
    regenerate(target, prompt_files, tmp_path / "full.jsonl", **kwargs)
    regenerate(target, prompt_files, tmp_path / "resumed.jsonl", limit=3, **kwargs)
    regenerate(target, prompt_files, tmp_path / "resumed.jsonl", **kwargs)
    sampled = _read_by_id(tmp_path / "full.jsonl")
    assert _read_by_id(tmp_path / "resumed.jsonl") == sampled
    # Sampled, not greedy: the responses differ from the greedy run's.
    greedy = _read_by_id(uninterrupted)
    differing = [i for i in greedy if sampled[i]["response_ids"] != greedy[i]["response_ids"]]
    assert len(differing) >= 3, differing


def test_each_sampled_record_draws_with_the_seed_of_its_index(target, prompt_files, tmp_path):
    """Record i samples with `row_seed(base, i)`: its response is its prompt's generated alone
    with that seed. (One seed shared by every record would still resume identically, which the
    test above checks.)"""
    sampling = jetspec_jax.SamplingParams(temperature=1.0, seed=3)
    out = tmp_path / "out.jsonl"
    regenerate(
        target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW, sampling=sampling
    )
    lines = _read_by_id(out)
    for index, record in enumerate(RECORDS):
        line = lines[record["id"]]
        seed = row_seed(sampling.seed, index)
        alone = jetspec_jax.generate(
            target, line["prompt_ids"], max_new_tokens=MAX_NEW, temperature=1.0, seed=seed
        )
        assert line["response_ids"] == alone.tokens, record["id"]


def test_partial_trailing_line_is_truncated_and_regenerated(
    target, prompt_files, uninterrupted, tmp_path, caplog
):
    out = tmp_path / "out.jsonl"
    shutil.copyfile(uninterrupted, out)
    text = out.read_text(encoding="utf-8")
    last_start = text.rstrip("\n").rfind("\n") + 1
    cut_id = json.loads(text[last_start:])["id"]
    complete = text[:last_start]
    out.write_text(text[: last_start + 20], encoding="utf-8")  # a kill mid-write
    with caplog.at_level(logging.WARNING, logger="jetspec_jax.data.regenerate"):
        summary = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert "partial line" in caplog.text
    assert (summary.written, summary.skipped_existing) == (1, 4)
    assert out.read_text(encoding="utf-8").startswith(complete)  # complete lines untouched
    assert _read_by_id(out) == _read_by_id(uninterrupted)
    assert cut_id in _read_by_id(out)


def test_a_failed_append_names_the_output_and_a_rerun_completes_it(
    target, prompt_files, uninterrupted, tmp_path, monkeypatch
):
    """A full disk while a response is appended: the error names the output (a failed write
    names no file), and the rerun writes what is missing."""
    out, real_fsync, appended = tmp_path / "out.jsonl", os.fsync, []

    def full_disk_after_two(fd):
        if os.readlink(f"/proc/self/fd/{fd}") == str(out):
            appended.append(fd)
            if len(appended) == 3:
                raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_disk_after_two)
    with pytest.raises(OSError, match="No space left on device") as failed:
        regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert failed.value.filename == str(out)
    monkeypatch.setattr(os, "fsync", real_fsync)
    summary = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (summary.written, summary.skipped_existing) == (2, 3)
    assert _read_by_id(out) == _read_by_id(uninterrupted)


def test_a_complete_last_line_without_its_newline_is_kept(
    target, prompt_files, uninterrupted, tmp_path
):
    out = tmp_path / "out.jsonl"
    out.write_text(uninterrupted.read_text(encoding="utf-8").rstrip("\n"), encoding="utf-8")
    summary = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (summary.written, summary.skipped_existing) == (0, 5)
    assert out.read_text(encoding="utf-8") == uninterrupted.read_text(encoding="utf-8")


def test_a_prompt_file_is_refused_as_the_output(target, prompt_files, tmp_path):
    """Neither named as the output nor found there: resuming into it would append responses to
    (or cut) the user's prompts."""
    before = prompt_files[0].read_bytes()
    with pytest.raises(ValueError, match="is one of the prompt files"):
        regenerate(target, prompt_files, prompt_files[0])
    other = tmp_path / "prompts_copy.jsonl"
    other.write_bytes(before)
    with pytest.raises(ValueError, match="is no regenerated record"):
        regenerate(target, prompt_files, other)
    assert prompt_files[0].read_bytes() == before == other.read_bytes()


def test_an_output_that_cannot_be_a_file_is_refused_before_the_load(prompt_files, tmp_path):
    """`check_output_path`, which `train.py regenerate` runs before loading the target: a
    directory, or a path under a file (mkdir would say only "File exists")."""
    with pytest.raises(ValueError, match="is a directory; give a file path"):
        check_output_path(tmp_path, prompt_files)
    with pytest.raises(ValueError, match=f"cannot be written: {prompt_files[0]} is a file"):
        check_output_path(prompt_files[0] / "sub" / "out.jsonl", prompt_files)
    check_output_path(tmp_path / "new" / "out.jsonl", prompt_files)


@pytest.mark.parametrize(
    "text", ["# My notes\nimportant last line", "one line, no newline", '{"a": 1}\n{"b": 2']
)
def test_another_file_given_as_the_output_is_refused_untouched(
    target, prompt_files, tmp_path, text
):
    """A mistyped output path: its lines are checked before a partial last line is cut."""
    other = tmp_path / "notes.md"
    other.write_text(text, encoding="utf-8")
    with pytest.raises(ValueError, match="notes.md:1 is (not valid JSON|no regenerated record)"):
        regenerate(target, prompt_files, other)
    assert other.read_text(encoding="utf-8") == text


def test_an_output_another_run_is_writing_is_refused(target, prompt_files, uninterrupted, tmp_path):
    out = tmp_path / "out.jsonl"
    shutil.copyfile(uninterrupted, out)
    before = out.read_bytes()
    with out.open("ab") as other_run:
        fcntl.flock(other_run.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="being written by another regenerate run"):
            regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert out.read_bytes() == before
    # Released: the run resumes (nothing left to generate).
    summary = regenerate(target, prompt_files, out, batch_size=BATCH, max_new_tokens=MAX_NEW)
    assert (summary.written, summary.skipped_existing) == (0, 5)


def test_empty_or_non_utf8_prompt_files_are_refused(target, tmp_path):
    empty = _write_jsonl(tmp_path / "empty.jsonl", [])
    with pytest.raises(ValueError, match="no prompts in .*empty.jsonl"):
        regenerate(target, [empty], tmp_path / "out.jsonl")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"id": "a", "prompt": "caf\xe9"}\n')
    with pytest.raises(ValueError, match="latin.jsonl:1 is not UTF-8"):
        regenerate(target, [latin], tmp_path / "out.jsonl")
    # JSON's escapes admit unpaired surrogates, which no tokenizer encodes nor file holds (nor
    # the output line a `source` is copied into, once its response is generated).
    for field in ("id", "prompt", "source"):
        lone = tmp_path / f"lone_{field}.jsonl"
        record = {"id": "a", "prompt": "Hi", field: "x\udc80"}
        lone.write_text("\n" + json.dumps(record) + "\n")  # escaped by json.dumps
        with pytest.raises(ValueError, match=f"lone_{field}.jsonl:2: its '{field}' holds an unp"):
            regenerate(target, [lone], tmp_path / "out.jsonl")
    assert not (tmp_path / "out.jsonl").exists()


def test_a_bad_record_is_named_by_its_line(tmp_path):
    good = {"id": "a", "prompt": "Hi"}
    for bad, message in [
        ({"prompt": "Hi"}, "bad.jsonl:2: the record has no string 'id'"),
        ({"id": "b", "prompt": "Hi", "source": 3}, "bad.jsonl:2: record 'b' has a non-string"),
        (good, "duplicate id 'a': at .*bad.jsonl:1 and .*bad.jsonl:2"),
    ]:
        path = _write_jsonl(tmp_path / "bad.jsonl", [good, bad])
        with pytest.raises(ValueError, match=message):
            read_records([path])


def test_too_long_prompt_is_skipped_and_counted(target, tmp_path, caplog):
    context = target.config.max_position_embeddings
    prompts = _write_jsonl(tmp_path / "long.jsonl", [{"id": "long", "prompt": "word " * context}])
    out = tmp_path / "out.jsonl"
    with caplog.at_level(logging.WARNING, logger="jetspec_jax.data.regenerate"):
        summary = regenerate(target, [prompts], out, max_new_tokens=MAX_NEW)
    counts = (summary.written, summary.skipped_existing, summary.skipped_too_long, summary.total)
    assert counts == (0, 0, 1, 1)  # the three counts sum to the total: none counted twice
    assert "skipping 'long'" in caplog.text
    assert out.read_text() == ""


def test_a_prompt_that_fills_the_context_with_its_budget_is_kept(target):
    """Prompt plus budget may equal the context; one token more is skipped."""
    from jetspec_jax.data.regenerate import PromptRecord, _encode

    encoding = PromptEncoding()
    record = PromptRecord(index=0, id="q", source="alpaca", text="What is 7 + 1?")
    n = len(encoding.encode(target.tokenizer, record.text))
    room = target.config.max_position_embeddings - n
    assert [r.id for r, _ in _encode(target, [record], room, encoding)] == ["q"]
    assert _encode(target, [record], room + 1, encoding) == []


def test_row_seeds_depend_on_base_and_index_only():
    assert row_seed(0, 3) == row_seed(0, 3)
    assert len({row_seed(base, i) for base in range(3) for i in range(3)}) == 9
    assert all(0 <= row_seed(7, i) < 2**32 for i in range(10))


def test_duplicate_ids_across_files_are_rejected(target, prompt_files, tmp_path):
    dup = _write_jsonl(tmp_path / "dup.jsonl", [{"id": "alp-2", "prompt": "x", "source": "a"}])
    with pytest.raises(ValueError, match="duplicate id 'alp-2'"):
        regenerate(target, [*prompt_files, dup], tmp_path / "out.jsonl")


def test_a_prompt_file_given_twice_is_named_as_such(prompt_files):
    """Not as an id duplicated within a line of itself (`at a.jsonl:1 and a.jsonl:1`)."""
    a = prompt_files[0]
    with pytest.raises(ValueError, match=f"prompt file {a} is given twice"):
        read_records([a, prompt_files[1], a.parent / "." / a.name])
    with pytest.raises(ValueError, match=f"prompt file {a} is given twice"):
        read_records([str(a), str(a)])


def test_missing_prompt_file_is_rejected(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        regenerate(target, [tmp_path / "missing.jsonl"], tmp_path / "out.jsonl")


def test_bad_arguments_are_rejected(target, prompt_files, tmp_path):
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        regenerate(target, prompt_files, tmp_path / "out.jsonl", batch_size=0)
    with pytest.raises(ValueError, match="list of paths"):
        regenerate(target, prompt_files[0], tmp_path / "out.jsonl")
    for limit in (-1, True, 1.5):  # -1 would silently drop the last record
        with pytest.raises(ValueError, match="limit must be"):
            regenerate(target, prompt_files, tmp_path / "out.jsonl", limit=limit)
        with pytest.raises(ValueError, match="limit must be"):
            read_records(prompt_files, limit=limit)
    context = target.config.max_position_embeddings
    with pytest.raises(
        ValueError, match=f"no room for a prompt in the target's context of {context}"
    ):
        regenerate(target, prompt_files, tmp_path / "run" / "out.jsonl", max_new_tokens=context)
    assert not (tmp_path / "run").exists()


def test_a_prompt_the_chat_template_refuses_writes_nothing(target, prompt_files, tmp_path):
    """Templates without a system role refuse `system` (jinja's raise_exception): a ValueError,
    before the output or its settings file exist."""
    tokenizer = copy.copy(target.tokenizer)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    refusing = dataclasses.replace(target, tokenizer=tokenizer)
    with pytest.raises(ValueError, match="the chat template refuses these messages: System role"):
        regenerate(refusing, prompt_files, tmp_path / "run" / "out.jsonl", system="Be brief.")
    assert not (tmp_path / "run").exists()


def test_target_without_tokenizer_is_rejected(checkpoints, prompt_files, tmp_path):
    no_tokenizer = jetspec_jax.load_target(checkpoints.get("qwen3")[0], show_progress=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        regenerate(no_tokenizer, prompt_files, tmp_path / "out.jsonl")


def _start_cli(args: list[str]) -> subprocess.Popen:
    """`python train.py ARGS`."""
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=ROOT,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_cli_regenerate_writes_the_output(cli_run):
    proc, out = cli_run
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-3000:]
    assert "regenerated 3 responses" in stdout
    lines = _read_by_id(out)
    assert set(lines) == {r["id"] for r in FILE_A}
    assert all(set(line) == FIELDS and len(line["response_ids"]) <= 4 for line in lines.values())


def test_cli_bad_argument_exits_2_without_traceback(prompt_files, tmp_path, capsys):
    import train

    args = ["regenerate", "--prompts", str(prompt_files[0]), "--out", str(tmp_path / "o.jsonl")]
    proc = _start_cli([*args, "--batch-size", "0"])
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 2
    assert "error: --batch-size must be >= 1" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "o.jsonl").exists()
    # Refused before the model loads: a target that does not exist is never reached. (In this
    # process, which a traceback would fail: the script's exit path is the run's above.)
    missing = str(tmp_path / "no_model")
    for flag in (["--thinking"], ["--system", "Be brief."]):
        assert train.main([*args, "--target", missing, "--no-chat", *flag]) == 2
        message = f"error: {flag[0]} is a chat-template setting; drop --no-chat"
        assert message in capsys.readouterr().err
    # A --system with bytes that are not UTF-8 (read as surrogates, which no tokenizer takes).
    assert train.main([*args, "--target", missing, "--system", "Be \udcff"]) == 2
    assert "error: --system holds an unpaired UTF-16 surrogate" in capsys.readouterr().err
    # Sampling values name their flags, as the other arguments do.
    for flag, value in (("--temperature", "-1"), ("--seed", "-1")):
        assert train.main([*args, "--target", missing, flag, value]) == 2
        assert f"error: {flag} must be" in capsys.readouterr().err


def test_cli_refuses_a_budget_the_context_cannot_hold_before_the_load(
    target, target_dir, prompt_files, tmp_path, monkeypatch, capsys
):
    import train

    monkeypatch.setattr(jetspec_jax, "load_target", lambda *a, **k: pytest.fail("loaded"))
    context = target.config.max_position_embeddings
    args = ["regenerate", "--prompts", str(prompt_files[0]), "--out", str(tmp_path / "o.jsonl")]
    args += ["--target", str(target_dir), "--max-new-tokens", str(context)]
    assert train.main(args) == 2
    assert f"--max-new-tokens {context} leaves no room for a prompt" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists()


def test_chat_prompts_end_in_the_assistants_turn_with_thinking_off():
    """With a template that reads `enable_thinking` (Qwen3's do): the generation prompt is added,
    thinking is off unless asked for, and a system message comes first."""
    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'][0] }}:{{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>a:"
        "{% if enable_thinking is defined and not enable_thinking %}N{% endif %}{% endif %}"
    )

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    turn = "<|im_start|>u:Hi<|im_end|><|im_start|>a:"
    assert encode_prompt(tokenizer, "Hi", chat=True) == ids(turn + "N")
    assert encode_prompt(tokenizer, "Hi", chat=True, thinking=True) == ids(turn)
    with_system = encode_prompt(tokenizer, "Hi", chat=True, system="S")
    assert with_system == ids("<|im_start|>s:S<|im_end|>" + turn + "N")
    # An empty system message is one (the template renders its turn), not none.
    empty = encode_prompt(tokenizer, "Hi", chat=True, system="")
    assert empty == ids("<|im_start|>s:<|im_end|>" + turn + "N")
    # Text that is not Unicode is named, not the tokenizer's bare TypeError.
    for text, system, named in (("Hi\ud800", None, "the prompt"), ("Hi", "\udcff", "the system")):
        for chat in (True, False) if system is None else (True,):
            with pytest.raises(ValueError, match=f"{named}.* holds an unpaired UTF-16 surrogate"):
                encode_prompt(tokenizer, text, chat=chat, system=system)


def test_a_malformed_middle_line_is_an_error_even_when_skipping_a_torn_tail(tmp_path):
    """Only a last line without its newline is a write a kill cut; a damaged line before it is
    an error (a resume that stopped reading there would write the later records again)."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "b", \n{"id": "c"}\n{"id": "d", "x"')
    with pytest.raises(ValueError, match="out.jsonl:2 is not valid JSON"):
        list(read_jsonl(path, skip_partial_tail=True))
    path.write_bytes(b'{"id": "a"}\n{"id": "c"}\n{"id": "d", "x"')
    assert [o["id"] for _, o in read_jsonl(path, skip_partial_tail=True)] == ["a", "c"]


def test_read_records_suffixes_the_sources_it_is_given(tmp_path):
    path = tmp_path / "p.jsonl"
    rows = [
        {"id": "g", "prompt": "x", "source": "gsm8k"},
        {"id": "m", "prompt": "y", "source": "mbpp"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by_id = {r.id: r.text for r in read_records([path], math_suffix_sources=("mbpp",))}
    assert by_id == {"g": "x", "m": "y" + MATH_SUFFIX}
    assert [r.text for r in read_records([path], math_suffix_sources=())] == ["x", "y"]


def test_a_limit_keeps_that_many_records_and_zero_keeps_none(tmp_path):
    """`limit` counts records from the first; 0 keeps none (a run that only records its
    settings), not every record as no limit would."""
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": "x"} for i in "abc"])
    assert [r.id for r in read_records([path], limit=0)] == []
    assert [r.id for r in read_records([path], limit=2)] == ["a", "b"]
    assert [r.id for r in read_records([path], limit=5)] == ["a", "b", "c"]


def test_read_prompts_keeps_the_first_limit_records(tmp_path):
    """The bench and evaluation read `limit` prompts: that many, from the first (0: none)."""
    path = _write_jsonl(tmp_path / "p.jsonl", [{"id": i, "prompt": i} for i in "abc"])
    for limit, ids in ((0, ""), (1, "a"), (2, "ab"), (3, "abc"), (5, "abc"), (None, "abc")):
        assert [r["id"] for r in read_prompts(path, limit=limit)] == list(ids), limit


def test_a_setting_recorded_on_one_side_only_is_a_change(tmp_path):
    """A setting the recorded file lacks (written before the setting existed), or holds alone,
    counts as changed: the resumed run might make responses of another kind."""
    from jetspec_jax.data.regenerate import record_settings

    path = settings_path(tmp_path / "out.jsonl")
    record_settings(path, {"chat": True}, resuming=False)
    with pytest.raises(ValueError, match="system 'x' \\(generated with None\\)"):
        record_settings(path, {"chat": True, "system": "x"}, resuming=True)
    with pytest.raises(ValueError, match="chat None \\(generated with True\\)"):
        record_settings(path, {}, resuming=True)
    record_settings(path, {"chat": True}, resuming=True)  # the same settings: resumed


def test_the_default_prompt_encoding_is_what_no_flag_gives():
    """`train.py evaluate` reads `PromptEncoding()` as "no flag given" (the template if the
    tokenizer has one): it must be the flags' own defaults, or `--no-chat` would be the value
    read as no flag, and ignored."""
    import train

    args = train._parser().parse_args(["evaluate", "--draft", "D", "--prompts", "P"])
    assert train._prompt_encoding(args) == PromptEncoding()
    no_chat = train._parser().parse_args(
        ["evaluate", "--draft", "D", "--prompts", "P", "--no-chat"]
    )
    assert train._prompt_encoding(no_chat) != PromptEncoding()
