"""Prompt files → benchmark prompts, the field's way: math prompts get the standard suffix (by
their record's `source`), and every prompt goes through the chat template with thinking off."""

from __future__ import annotations

import collections
import dataclasses
import pathlib

from jetspec_jax.data.prompts import prompt_text, read_prompts
from jetspec_jax.prompting import encode_prompt


@dataclasses.dataclass(frozen=True)
class Dataset:
    """Encoded prompts of one file.

    Attributes:
        name: the records' `source` (else the file's stem).
        ids: the records' `id`s.
        prompts: token ids, one list per record.
    """

    name: str
    ids: list[str]
    prompts: list[list[int]]


def load_dataset(
    path: str | pathlib.Path, tokenizer, *, limit: int | None = None, chat: bool = True
) -> Dataset:
    """The first `limit` prompts of a JSONL file, encoded for the target.

    Raises:
        FileNotFoundError, ValueError: as `read_dataset`, or a prompt encodes to no tokens.
    """
    name, ids, records = read_dataset(path, limit=limit)
    prompts = [encode_prompt(tokenizer, prompt_text(record), chat=chat) for record in records]
    for rid, prompt in zip(ids, prompts, strict=True):
        if not prompt:  # an empty raw prompt: decoding would refuse it without naming the record
            raise ValueError(f"{path}: record {rid!r} encodes to no tokens")
    return Dataset(name=name, ids=ids, prompts=prompts)


def read_dataset(
    path: str | pathlib.Path, *, limit: int | None = None
) -> tuple[str, list[str], list[dict]]:
    """`(name, ids, records)` of the first `limit` prompts of a JSONL file, checked without a
    tokenizer (so before a model loads).

    Raises:
        FileNotFoundError, ValueError: the file is missing or malformed (`read_prompts`), holds no
            prompts, or two records share an `id` (results, AR's tokens included, are keyed by
            it).
    """
    path = pathlib.Path(path)
    records = read_prompts(path, limit=limit)
    if not records:
        raise ValueError(f"{path} holds no prompts")
    name = str(records[0].get("source") or path.stem)
    ids = [str(record.get("id", i)) for i, record in enumerate(records)]
    repeated = sorted(i for i, n in collections.Counter(ids).items() if n > 1)
    if repeated:
        raise ValueError(f"{path}: prompt ids {', '.join(repeated[:5])} occur more than once")
    return name, ids, records
