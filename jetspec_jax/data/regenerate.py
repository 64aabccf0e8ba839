"""Regenerating training responses with the target itself (the data step of draft training).

A draft is trained to predict what the target would say, so its training responses are produced by
the target from the prompt files (`read_prompts`) and written as JSONL, one object per line:

    {"id": str, "source": str | null, "prompt_ids": [int], "response_ids": [int],
     "response": str, "finish_reason": "stop" | "length"}

Lines appear in the order responses finish (`generate_as_completed`: `batch_size` rows decoded at
once, each finished row taking the next prompt, longest first), not in the prompt files' order.

Runs are resumable: ids already in the output file are skipped, and each response's line is
appended and flushed to disk as it finishes, so a kill loses only the responses in flight. A
partial last line (a kill mid-write) is truncated before appending; complete lines are never
rewritten. The settings that shape a response (target architecture and dtype, a digest of its
checkpoint directory's files: weights, tokenizer and chat template; its stop ids, budget, prompt
encoding, sampling) are kept beside the output in `<out>.settings.json`; resuming with other
settings is refused, since the file would mix two data sets.

Sampled runs stay reproducible across resumes: record i (its position in the prompt files, read in
the order given, before `limit`) is sampled with a seed derived from (base seed, i) alone, and a
row's tokens do not depend on its batch-mates (see `jetspec_jax.sampling`). A resumed run therefore
writes the same responses as an uninterrupted one, provided it gets the same prompt files in the
same order and the same settings (the limit may differ).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import time
from collections.abc import Sequence

import tqdm

from jetspec_jax.checkpoint.atomic import write_text_atomically
from jetspec_jax.checkpoint.digest import directory_digest
from jetspec_jax.console import bar_disabled
from jetspec_jax.data.jsonl import read_jsonl, trim_partial_last_line
from jetspec_jax.data.prompts import MATH_SOURCES, located_prompts, prompt_text
from jetspec_jax.file_lock import exclusively
from jetspec_jax.generate import generate_as_completed
from jetspec_jax.prompting import PromptEncoding
from jetspec_jax.sampling import SamplingParams, row_seed
from jetspec_jax.scalars import is_integer
from jetspec_jax.target import Target

logger = logging.getLogger(__name__)

GREEDY = SamplingParams()


@dataclasses.dataclass(frozen=True)
class RegenerateSummary:
    """What one `regenerate` call did.

    Attributes:
        written: responses generated and appended in this call.
        skipped_existing: records whose id was already in the output file.
        skipped_too_long: records whose prompt + max_new_tokens exceed the target's context.
        total: records considered (after `limit`); the three counts above sum to it.
        seconds: wall-clock time of the call.
        cut_at_budget: of the `written` responses, those that stopped at `max_new_tokens`
            rather than at a stop token (finish reason "length"): unfinished answers.
    """

    written: int
    skipped_existing: int
    skipped_too_long: int
    total: int
    seconds: float
    cut_at_budget: int = 0


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """One prompt to regenerate.

    Attributes:
        index: position among all records of the prompt files, in the order given (seeds use it).
        id: the record's unique id.
        source: the record's `source` field, or None when it has none.
        text: the prompt text (raw `prompt`, plus `MATH_SUFFIX` for math sources).
    """

    index: int
    id: str
    source: str | None
    text: str


def read_records(
    prompt_files: Sequence[str | os.PathLike],
    *,
    math_suffix_sources: Sequence[str] = MATH_SOURCES,
    limit: int | None = None,
) -> list[PromptRecord]:
    """The records of all prompt files, in order, ids checked for uniqueness across files.

    Args:
        prompt_files: JSONL prompt files (`read_prompts` format); each record needs a string `id`.
        math_suffix_sources: records whose `source` is one of these get `MATH_SUFFIX` appended.
        limit: keep the first `limit` records overall (all when None). Ids are checked in all.

    Raises:
        FileNotFoundError: a prompt file does not exist.
        ValueError: no prompt files or no records in them, a file given twice, a malformed
            record, or an id seen twice (named).
    """
    if isinstance(prompt_files, (str, os.PathLike)):
        raise ValueError("prompt_files must be a list of paths, not a single path")
    if not prompt_files:
        raise ValueError("no prompt files given")
    _check_limit(limit)
    # By real path (`a.jsonl`, `./a.jsonl` and a symlink are one file): else its every id is
    # refused as a duplicate of itself, at the same file and line.
    given: dict[str, str | os.PathLike] = {}  # real path -> the entry that named it first
    for path in prompt_files:
        real = os.path.realpath(path)
        if real in given:
            also = "" if str(given[real]) == str(path) else f" (as {given[real]} and {path})"
            raise ValueError(f"prompt file {given[real]} is given twice{also}; give each file once")
        given[real] = path
    suffixed = set(math_suffix_sources)
    records: list[PromptRecord] = []
    seen: dict[str, str] = {}  # id -> the path:line it was first seen at
    for path in prompt_files:
        for where, record in located_prompts(path):
            rid, source = record.get("id"), record.get("source")
            if not isinstance(rid, str) or not rid:
                raise ValueError(f"{where}: the record has no string 'id' (got {rid!r})")
            if rid in seen:
                raise ValueError(f"duplicate id {rid!r}: at {seen[rid]} and {where}")
            if source is not None and not isinstance(source, str):
                raise ValueError(f"{where}: record {rid!r} has a non-string 'source' {source!r}")
            seen[rid] = where
            text = prompt_text(record, suffixed)
            records.append(PromptRecord(len(records), rid, source, text))
    if not records:
        raise ValueError(f"no prompts in {', '.join(str(p) for p in prompt_files)}")
    return records if limit is None else records[:limit]


def check_room_for_a_prompt(
    max_new_tokens: int, context: int, name: str = "max_new_tokens"
) -> None:
    """Refuses a budget that leaves no token of the target's `context` for a prompt (`name`: the
    budget as the caller's user gave it, a keyword or a flag)."""
    if max_new_tokens >= context:
        raise ValueError(
            f"{name} {max_new_tokens} leaves no room for a prompt in the target's context of "
            f"{context} tokens"
        )


def check_output_path(
    out_path: str | os.PathLike, prompt_files: Sequence[str | os.PathLike]
) -> None:
    """Refuses an output path that is a directory, lies under a file, or is one of the prompt
    files (resuming into a prompt file would append responses to the user's prompts).

    Raises:
        ValueError: naming the path.
    """
    out_path = pathlib.Path(out_path)
    if out_path.is_dir():
        raise ValueError(f"the output {out_path} is a directory; give a file path")
    parent = next(p for p in out_path.parents if p.exists())
    if not parent.is_dir():
        raise ValueError(f"the output {out_path} cannot be written: {parent} is a file")
    if any(out_path.resolve() == pathlib.Path(f).resolve() for f in prompt_files):
        raise ValueError(f"the output {out_path} is one of the prompt files")


def regenerate(
    target: Target,
    prompt_files: Sequence[str | os.PathLike],
    out_path: str | os.PathLike,
    *,
    batch_size: int = 8,
    max_new_tokens: int = 512,
    chat: bool = True,
    system: str | None = None,
    thinking: bool = False,
    math_suffix_sources: Sequence[str] = MATH_SOURCES,
    limit: int | None = None,
    sampling: SamplingParams = GREEDY,
    show_progress: bool | None = None,
) -> RegenerateSummary:
    """Generates the target's response to every prompt not yet in `out_path`, appending JSONL.

    Args:
        target: a loaded target with a tokenizer.
        prompt_files: JSONL prompt files, read in this order (`read_records`).
        out_path: the output JSONL file; created (with its directory) if missing, else resumed.
        batch_size: rows decoded at once (>= 1; rounded up to a power of two); a finished row
            takes the next prompt (`generate_as_completed`).
        max_new_tokens: response budget per prompt (>= 1).
        chat, system, thinking: prompt encoding, as in `encode_prompt`.
        math_suffix_sources: sources whose prompts get `MATH_SUFFIX` appended.
        limit: regenerate only the first `limit` records of the prompt files (all when None).
        sampling: temperature / top-k / top-p for all rows; its seed is the base of the per-record
            seeds (`row_seed`). Stop tokens are the target's defaults.
        show_progress: progress bar over prompts (None: only on a terminal).

    Returns:
        A `RegenerateSummary`.

    Raises:
        FileNotFoundError: a prompt file does not exist.
        ValueError: bad arguments, a target without tokenizer, malformed or duplicate prompt
            records, an output path `check_output_path` refuses, an output file with a
            malformed complete line, one generated with other settings, or one another
            regenerate run is writing.
    """
    start = time.perf_counter()
    _check_positive("batch_size", batch_size)
    _check_positive("max_new_tokens", max_new_tokens)
    if not isinstance(sampling, SamplingParams):
        raise ValueError(f"sampling must be a SamplingParams, got {sampling!r}")
    if target.tokenizer is None:
        raise ValueError(f"target {target.path} has no tokenizer; regeneration needs one")
    if thinking and not chat:
        raise ValueError("thinking is a chat-template switch: it needs chat=True")
    check_room_for_a_prompt(max_new_tokens, target.config.max_position_embeddings)
    records = read_records(prompt_files, math_suffix_sources=math_suffix_sources, limit=limit)
    out_path = pathlib.Path(out_path)
    check_output_path(out_path, prompt_files)
    # Before any file is made: a prompt the chat template refuses fails with nothing written.
    encoding = PromptEncoding(chat=chat, system=system, thinking=thinking)
    encoded = _encode(target, records, max_new_tokens, encoding)
    settings = _settings(target, max_new_tokens, encoding, math_suffix_sources, sampling)
    busy = (
        f"{out_path} is being written by another regenerate run; wait for it, or give another "
        "output file"
    )
    with exclusively(out_path, busy=busy):  # a second run would append the same records
        done = _existing_prompts(out_path)
        record_settings(settings_path(out_path), settings, resuming=bool(done))
        _check_same_prompts(out_path, done, encoded)  # same settings, but a prompt edited?
        existing = sum(r.id in done for r in records)
        todo = [(r, ids) for r, ids in encoded if r.id not in done]
        too_long = len(records) - existing - len(todo)
        logger.info(
            "%d records: %d already in %s, %d too long, %d to generate",
            len(records),
            existing,
            out_path,
            too_long,
            len(todo),
        )
        written, cut = _generate_into(
            target, todo, out_path, batch_size, max_new_tokens, sampling, show_progress
        )
    if cut:
        logger.warning(
            "%d of %d responses stopped at max_new_tokens=%d, unfinished", cut, written,
            max_new_tokens,
        )  # fmt: skip
    return RegenerateSummary(
        written=written,
        skipped_existing=existing,
        skipped_too_long=too_long,
        total=len(records),
        seconds=time.perf_counter() - start,
        cut_at_budget=cut,
    )


def _settings(
    target: Target,
    max_new_tokens: int,
    encoding: PromptEncoding,
    math_suffix_sources: Sequence[str],
    sampling: SamplingParams,
) -> dict:
    """The settings that shape a response, as `record_settings` keeps them (JSON-ready)."""
    return dict(
        target=dict(config=_json_ready(target.config), dtype=target.dtype),
        # The weights, tokenizer and chat template (a target built in memory: None, unchecked).
        target_files=directory_digest(target.path) if target.path is not None else None,
        stop_token_ids=list(target.stop_token_ids),
        max_new_tokens=max_new_tokens,
        chat=encoding.chat,
        system=encoding.system,
        thinking=encoding.thinking,
        math_suffix_sources=sorted(math_suffix_sources),
        sampling=_json_ready(sampling),
    )


def _generate_into(
    target: Target,
    encoded: list[tuple[PromptRecord, list[int]]],
    out_path: pathlib.Path,
    batch_size: int,
    max_new_tokens: int,
    sampling: SamplingParams,
    show_progress: bool | None,
) -> tuple[int, int]:
    """Generates the (record, prompt ids) pairs, appending each line as its response finishes;
    returns how many, and how many of them stopped at the budget."""
    progress = tqdm.tqdm(
        total=len(encoded),
        desc="regenerating",
        unit="prompt",
        disable=bar_disabled(show_progress),
    )
    cut = 0
    # Unbuffered: a write that fails leaves no buffer for `close` to flush again (its error,
    # naming no file, would replace `_append_line`'s).
    with out_path.open("ab", buffering=0) as out, progress:
        if not encoded:
            return 0, 0
        results = generate_as_completed(
            target,
            [ids for _, ids in encoded],
            max_new_tokens=max_new_tokens,
            sampling=[
                dataclasses.replace(sampling, seed=row_seed(sampling.seed, r.index))
                for r, _ in encoded
            ],
            max_batch_size=batch_size,
        )
        for i, result in results:
            line = _line(target, *encoded[i], result)
            _append_line(out, line)
            cut += line["finish_reason"] == "length"
            progress.update(1)
    return len(encoded), cut


def _encode(
    target: Target,
    records: list[PromptRecord],
    max_new_tokens: int,
    encoding: PromptEncoding,
) -> list[tuple[PromptRecord, list[int]]]:
    """(record, prompt ids) of the records that fit the context; the others are logged."""
    context = target.config.max_position_embeddings
    fitting = []
    for record in records:
        ids = encoding.encode(target.tokenizer, record.text)
        if not ids:
            raise ValueError(f"record {record.id!r} encodes to no tokens")
        if len(ids) + max_new_tokens > context:
            logger.warning(
                "skipping %r: %d prompt tokens + max_new_tokens=%d exceed the context of %d",
                record.id,
                len(ids),
                max_new_tokens,
                context,
            )
            continue
        fitting.append((record, ids))
    return fitting


def _line(target: Target, record: PromptRecord, ids: list[int], result) -> dict:
    """The output object of one record's response."""
    return {
        "id": record.id,
        "source": record.source,
        "prompt_ids": ids,
        "response_ids": result.tokens,
        "response": target.tokenizer.decode(result.tokens, skip_special_tokens=True),
        "finish_reason": result.finish_reason,
    }


def _append_line(out, obj: dict) -> None:
    """Appends `obj` as a JSONL line to the unbuffered binary file `out`, then flushes it to disk.

    Raises:
        OSError: the write failed (a full disk, say), naming the file (a failed write names
            none); a partial line it left is cut when the run resumes.
    """
    data = memoryview((json.dumps(obj, ensure_ascii=False) + "\n").encode())
    try:
        while data:  # an unbuffered write may take part of it
            data = data[out.write(data) :]
        os.fsync(out.fileno())
    except OSError as e:
        if e.filename is not None or e.errno is None:
            raise
        raise OSError(e.errno, e.strerror, out.name) from e


def settings_path(out_path: pathlib.Path) -> pathlib.Path:
    """Where the settings of the output file `out_path` are kept."""
    return out_path.with_name(out_path.name + ".settings.json")


def read_settings(path: pathlib.Path) -> dict:
    """The settings recorded at `path` (a `<out>.settings.json`).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not valid JSON (empty, or cut short), or not a JSON object — named, so
            that it can be repaired or deleted (not a bare parser error or TypeError).
    """
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); damaged regeneration settings") from e
    if not isinstance(settings, dict):
        raise ValueError(
            f"{path} is not a JSON object (got {type(settings).__name__}); damaged regeneration "
            "settings"
        )
    return settings


def recorded_encoding(out_path: str | os.PathLike) -> PromptEncoding | None:
    """The prompt encoding `regenerate` recorded for the output file `out_path`; None when it
    recorded no settings (a file from before they were recorded, or not written by `regenerate`).

    Raises:
        ValueError: a settings file that is no JSON object with the encoding's fields.
    """
    path = settings_path(pathlib.Path(out_path))
    if not path.is_file():
        return None
    settings = read_settings(path)
    try:
        encoding = PromptEncoding(
            chat=settings["chat"], system=settings["system"], thinking=settings["thinking"]
        )
    except KeyError as e:
        raise ValueError(f"{path} holds no regeneration settings: no {e}") from e
    if not isinstance(encoding.chat, bool) or not isinstance(encoding.thinking, bool):
        raise ValueError(f"{path}: 'chat' and 'thinking' must be booleans")
    if encoding.system is not None and not isinstance(encoding.system, str):
        raise ValueError(f"{path}: 'system' must be a string or null")
    return encoding


def recorded_temperature(out_path: str | os.PathLike) -> float | None:
    """The sampling temperature `regenerate` recorded for the output file `out_path` (0:
    greedy); None when it recorded none (no settings file, or one without sampling settings).

    Raises:
        ValueError: a damaged settings file (`read_settings`), or a temperature that is no number.
    """
    path = settings_path(pathlib.Path(out_path))
    if not path.is_file():
        return None
    sampling = read_settings(path).get("sampling")
    if sampling is None:
        return None
    temperature = sampling.get("temperature") if isinstance(sampling, dict) else None
    if isinstance(temperature, bool) or not isinstance(temperature, int | float):
        raise ValueError(f"{path}: 'sampling' must hold a numeric 'temperature', got {sampling!r}")
    return float(temperature)


def record_settings(path: pathlib.Path, settings: dict, *, resuming: bool) -> None:
    """Records `settings` at `path`; `resuming` an output file, refuses (ValueError) settings
    that differ from those recorded. An output written before settings were recorded gets the
    current ones (unchecked); a new output replaces the settings of a deleted one."""
    if resuming and path.is_file():
        recorded = read_settings(path)
        changed = [
            f"{key} {settings.get(key)!r} (generated with {recorded.get(key)!r})"
            for key in sorted(set(recorded) | set(settings))
            if recorded.get(key) != settings.get(key)
        ]
        if changed:
            raise ValueError(
                f"{path.name[: -len('.settings.json')]} was generated with other settings; "
                f"resuming would mix two data sets: {'; '.join(changed)}. Use another output "
                "file, or the recorded settings"
            )
        return
    write_text_atomically(path, json.dumps(settings, indent=1))


def _json_ready(value) -> dict:
    """A frozen dataclass (the target's config, the sampling) as it reads back from JSON (tuples
    as lists); the config's runtime-only choices of how to compute (`recurrence_impl`,
    `cache_chunk`) are left out."""
    fields = dataclasses.asdict(value)
    fields.pop("recurrence_impl", None)
    fields.pop("cache_chunk", None)
    return json.loads(json.dumps(fields))


def _check_same_prompts(
    out_path: pathlib.Path,
    done: dict[str, list[int]],
    encoded: list[tuple[PromptRecord, list[int]]],
) -> None:
    """Refuses to resume where a finished record's prompt is not its id's prompt now (the prompt
    file was edited, or another one reuses the id): the resumed run would keep a response to
    another prompt."""
    for record, ids in encoded:
        if record.id in done and done[record.id] != ids:
            raise ValueError(
                f"{out_path} holds a response for id {record.id!r} to another prompt than the "
                "prompt files give it now: remove that line to regenerate it, or write to "
                "another file"
            )


def _existing_prompts(out_path: pathlib.Path) -> dict[str, list[int]]:
    """`{id: prompt ids}` of the complete lines of `out_path`.

    Once every complete line has proved to be a regenerated record (so a mistyped path to
    another file is refused untouched), truncates a partial last line left by a kill.
    """
    prompts = {}
    for where, obj in read_jsonl(out_path, what="output file", skip_partial_tail=True):
        missing = [k for k in ("id", "prompt_ids", "response_ids") if k not in obj]
        if missing or not isinstance(obj["id"], str):
            raise ValueError(
                f"{where} is no regenerated record (it needs a string 'id', 'prompt_ids' and "
                "'response_ids'); is it an output file?"
            )
        prompts[obj["id"]] = obj["prompt_ids"]
    cut = trim_partial_last_line(out_path)
    if cut:
        logger.warning(
            "%s ended in a partial line of %d bytes (an interrupted write), now cut: its record "
            "is generated again",
            out_path,
            cut,
        )
    return prompts


def _check_positive(name: str, value) -> None:
    if not is_integer(value):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_limit(limit) -> None:
    if limit is None:
        return
    if not is_integer(limit):
        raise ValueError(f"limit must be an integer or None, got {limit!r}")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
