"""Evaluation through the inference code path: the tau a draft actually achieves.

Training accuracy that does not turn into acceptance at inference is the classic failure of draft
training; so evaluation runs `generate_batch` with the draft on held-out prompts and reports the
mean tokens per verification round, exactly as serving would see it.
"""

from __future__ import annotations

import logging
import pathlib
from collections.abc import Sequence

import numpy as np

from jetspec_jax.data.jsonl import read_jsonl
from jetspec_jax.data.prompts import prompt_text
from jetspec_jax.data.regenerate import recorded_encoding
from jetspec_jax.draft import Draft
from jetspec_jax.generate import generate_batch
from jetspec_jax.prompting import PromptEncoding, has_chat_template, require_unicode
from jetspec_jax.target import Target

logger = logging.getLogger(__name__)


def evaluate_tau(
    target: Target,
    draft: Draft,
    prompt_file: str | pathlib.Path,
    *,
    num_prompts: int = 8,
    max_new_tokens: int = 64,
    math_suffix: bool = True,
    encoding: PromptEncoding | None = None,
    refine_passes: int = 0,
    refreshes: int = 0,
    show_progress: bool | None = False,
) -> float:
    """Mean tau (greedy) of `draft` on the first `num_prompts` prompts of `prompt_file`, read as
    `eval_prompt_ids` reads them (`show_progress`: a bar over the generated tokens; None: only
    on a terminal).

    Raises:
        FileNotFoundError, ValueError: as `eval_prompt_ids`.
    """
    prompts = eval_prompt_ids(
        target, prompt_file, num_prompts=num_prompts, math_suffix=math_suffix, encoding=encoding
    )
    return prompts_tau(
        target,
        draft,
        prompts,
        max_new_tokens=max_new_tokens,
        refine_passes=refine_passes,
        refreshes=refreshes,
        show_progress=show_progress,
    )


def prompts_tau(
    target: Target,
    draft: Draft,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    refine_passes: int = 0,
    refreshes: int = 0,
    show_progress: bool | None = False,
) -> float:
    """Mean tau (greedy) of `draft` on `prompts` (token ids, `eval_prompt_ids`): tokens per
    verification round pooled over the prompts, the prefill's first token excluded."""
    results = generate_batch(
        target,
        prompts,
        draft=draft,
        method=draft.config.variant,
        max_new_tokens=max_new_tokens,
        refine_passes=refine_passes,
        refreshes=refreshes,
        show_progress=show_progress,
    )
    rounds = [n for r in results for n in r.acceptance_lengths[1:]]
    return float(np.mean(rounds)) if rounds else 1.0


def eval_prompt_ids(
    target: Target,
    prompt_file: str | pathlib.Path,
    *,
    num_prompts: int,
    math_suffix: bool = True,
    encoding: PromptEncoding | None = None,
) -> list[list[int]]:
    """The token ids of the first `num_prompts` prompts of `prompt_file`.

    Records with `prompt_ids` (e.g. held-out `train.py regenerate` output, whose records are in
    the order responses finished, roughly longest prompt first) are used as they are;
    records with a text `prompt` are encoded with `encoding` (`data_encoding` gives the training
    data's), by default the target's chat template if it has one (no system message, thinking
    off); math sources (`MATH_SOURCES`) get the field's suffix when `math_suffix`.

    Raises:
        FileNotFoundError: no such file.
        ValueError: as `eval_prompt_records`, or a text prompt but the target has no tokenizer.
    """
    records = eval_prompt_records(
        prompt_file, num_prompts=num_prompts, vocab_size=target.config.vocab_size
    )
    return encoded_prompts(target, records, math_suffix=math_suffix, encoding=encoding)


def eval_prompt_records(
    prompt_file: str | pathlib.Path, *, num_prompts: int, vocab_size: int
) -> list[tuple[str, dict]]:
    """`(file:line, record)` of the first `num_prompts` records of `prompt_file`, checked with
    the target's vocabulary size alone (`load_target_config`), so that a bad file fails before
    the target's weights load: each record holds a non-empty integer list `prompt_ids` of ids
    below `vocab_size`, or a string `prompt` (`encoded_prompts` encodes them).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a record (named by `file:line`) with neither, or a `prompt` that is not
            Unicode (`require_unicode`), or no record at all.
    """
    records = []
    for where, record in read_jsonl(prompt_file, what="evaluation prompt file"):
        if len(records) == num_prompts:
            break
        _check_prompt_record(where, record, vocab_size)
        records.append((where, record))
    if not records:
        raise ValueError(f"{prompt_file} holds no prompts")
    return records


def first_text_prompt(records: list[tuple[str, dict]]) -> str | None:
    """The `file:line` of the first of `eval_prompt_records`' records that is text (its encoding
    needs the target's tokenizer), or None when all are token ids."""
    return next((where for where, record in records if "prompt_ids" not in record), None)


def encoded_prompts(
    target: Target,
    records: list[tuple[str, dict]],
    *,
    math_suffix: bool = True,
    encoding: PromptEncoding | None = None,
) -> list[list[int]]:
    """The token ids of `eval_prompt_records`' records, as `eval_prompt_ids` says.

    Raises:
        ValueError: a text prompt (named by `file:line`) but the target has no tokenizer, or one
            that encodes to no tokens.
    """
    return [_prompt_ids(where, r, target, math_suffix, encoding) for where, r in records]


def data_encoding(data_files: Sequence[str | pathlib.Path]) -> PromptEncoding | None:
    """The prompt encoding the regenerated `data_files` share (`train.py regenerate` records it
    beside each file), for encoding text evaluation prompts as the training prompts were.

    None, logged, when a file recorded none or the files differ: text evaluation prompts then get
    `eval_prompt_ids`' default encoding.

    Raises:
        ValueError: as `recorded_encoding`.
    """
    encodings = {str(f): recorded_encoding(f) for f in data_files}
    unrecorded = [f for f, e in encodings.items() if e is None]
    if unrecorded:
        logger.info(
            "no prompt encoding recorded for %s: text evaluation prompts get the default "
            "(the chat template if the tokenizer has one)",
            ", ".join(unrecorded),
        )
        return None
    distinct = set(encodings.values())
    if len(distinct) > 1:
        logger.warning(
            "the training data files were encoded differently (%s): text evaluation prompts get "
            "the default encoding (the chat template if the tokenizer has one)",
            "; ".join(f"{f}: {e}" for f, e in encodings.items()),
        )
        return None
    return distinct.pop() if distinct else None


def _check_prompt_record(where: str, record: dict, vocab_size: int) -> None:
    """`eval_prompt_records`' check of one record."""
    if "prompt_ids" in record:
        ids = record["prompt_ids"]
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        ):
            raise ValueError(f"{where}: 'prompt_ids' must be a non-empty list of integers")
        if not all(0 <= t < vocab_size for t in ids):  # ids past the table: clamped silently
            raise ValueError(
                f"{where}: 'prompt_ids' holds ids outside the vocabulary [0, {vocab_size})"
            )
    elif not isinstance(record.get("prompt"), str):
        raise ValueError(f"{where} has neither 'prompt_ids' nor a string 'prompt'")
    else:
        require_unicode(record["prompt"], f"{where}: 'prompt'")


def _prompt_ids(
    where: str, record: dict, target: Target, math_suffix: bool, encoding: PromptEncoding | None
) -> list[int]:
    """A record `eval_prompt_records` checked, as token ids."""
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    if target.tokenizer is None:
        raise ValueError(f"{where}: text evaluation prompts need a target with a tokenizer")
    text = prompt_text(record) if math_suffix else record["prompt"]
    if encoding is None:
        encoding = PromptEncoding(chat=has_chat_template(target.tokenizer))
    ids = encoding.encode(target.tokenizer, text)
    if not ids:  # an empty raw prompt: decoding would refuse it without naming the line
        raise ValueError(f"{where}: the prompt encodes to no tokens")
    return ids
