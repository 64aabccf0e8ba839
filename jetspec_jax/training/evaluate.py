"""Evaluation through the inference code path: the tau a draft actually achieves.

Training accuracy that does not turn into acceptance at inference is the classic failure of draft
training; so evaluation runs `generate_batch` with the draft on held-out prompts and reports the
mean tokens per verification round, exactly as serving would see it.
"""

from __future__ import annotations

import pathlib

import numpy as np

from jetspec_jax.data.jsonl import read_jsonl
from jetspec_jax.data.prompts import MATH_SUFFIX
from jetspec_jax.draft import Draft
from jetspec_jax.generate import generate_batch
from jetspec_jax.prompting import encode_prompt
from jetspec_jax.target import Target

_MATH_SOURCES = ("gsm8k", "math", "math500")


def evaluate_tau(
    target: Target,
    draft: Draft,
    prompt_file: str | pathlib.Path,
    *,
    num_prompts: int = 8,
    max_new_tokens: int = 64,
    math_suffix: bool = True,
    refine_passes: int = 0,
    refreshes: int = 0,
) -> float:
    """Mean tau (greedy) of `draft` on the first `num_prompts` prompts of `prompt_file`.

    Records with `prompt_ids` (e.g. held-out `train.py regenerate` output) are used as they are;
    records with a text `prompt` are encoded with the target's chat template (thinking off), math
    sources getting the field's suffix.

    Raises:
        ValueError: a text prompt but the target has no tokenizer, or no usable record.
    """
    prompts = [_prompt_ids(r, target, math_suffix) for r in _records(prompt_file, num_prompts)]
    if not prompts:
        raise ValueError(f"{prompt_file} holds no prompts")
    results = generate_batch(
        target,
        prompts,
        draft=draft,
        method=draft.config.variant,
        max_new_tokens=max_new_tokens,
        refine_passes=refine_passes,
        refreshes=refreshes,
    )
    rounds = [n for r in results for n in r.acceptance_lengths[1:]]
    return float(np.mean(rounds)) if rounds else 1.0


def _records(path, limit: int) -> list[dict]:
    records = []
    for _, record in read_jsonl(path, what="evaluation prompt file"):
        if len(records) == limit:
            break
        records.append(record)
    return records


def _prompt_ids(record: dict, target: Target, math_suffix: bool) -> list[int]:
    if "prompt_ids" in record:
        return list(record["prompt_ids"])
    if target.tokenizer is None:
        raise ValueError("text evaluation prompts need a target with a tokenizer")
    text = record["prompt"]
    if math_suffix and record.get("source") in _MATH_SOURCES:
        text += MATH_SUFFIX
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    return encode_prompt(target.tokenizer, text, chat=chat)
