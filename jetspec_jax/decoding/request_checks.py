"""Validation of decoding requests: prompts as token ids, per-row values, the budget against the
context. Each check returns the value normalised (Python ints) or raises a ValueError that says
what is wrong, naming the prompt."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence, Set

import numpy as np

from jetspec_jax.sampling import SamplingParams, row_seed
from jetspec_jax.scalars import as_int


def check_budget(config, prompt_length: int, max_new_tokens, what: str = "prompt") -> int:
    """`max_new_tokens` as an int, after checking it is an integer >= 1 (Python, NumPy or JAX)
    and that the prompt (named `what` in the error) plus that many tokens fits the model's
    context (ValueError otherwise)."""
    budget = as_int(max_new_tokens)
    if budget is None:
        raise ValueError(f"max_new_tokens must be an integer, got {max_new_tokens!r}")
    if budget < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {budget}")
    if prompt_length + budget > config.max_position_embeddings:
        raise ValueError(
            f"{what} of {prompt_length} tokens + max_new_tokens={budget} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens"
        )
    return budget


def check_budgets(config, prompts: list[list[int]], max_new_tokens) -> list[int]:
    """One budget per prompt of a checked batch (`max_new_tokens` as `per_row` takes it), each
    as `check_budget` returns it, naming the prompt by its index."""
    budgets = per_row(max_new_tokens, len(prompts), "max_new_tokens")
    return [
        check_budget(config, len(p), n, prompt_name(i, len(prompts)))
        for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))
    ]


def check_prompts(prompts, vocab_size: int) -> list[list[int]]:
    """`prompts` (a non-empty sequence of prompts, each as `check_token_ids` takes it) as lists
    of ints, or a ValueError saying what is wrong."""
    iterable = hasattr(prompts, "__iter__") and getattr(prompts, "ndim", None) != 0
    if isinstance(prompts, (str, bytes)) or not iterable:
        raise ValueError(f"prompts must be a list of prompts (lists of token ids), got {prompts!r}")
    _check_ordered(prompts, "prompts", sets=False)
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts is empty")
    # One prompt's ids where a batch of prompts belongs (`generate_batch(target, ids)`).
    if any(as_int(p) is not None for p in prompts):
        raise ValueError(
            "prompts must be a list of prompts (lists of token ids), got a list of token ids: "
            "pass [prompt] for one prompt, or use generate"
        )
    return [
        check_token_ids(p, vocab_size, prompt_name(i, len(prompts))) for i, p in enumerate(prompts)
    ]


def prompt_name(index: int, count: int) -> str:
    """How errors name a prompt: by its index when it is one of a batch."""
    return f"prompt {index}" if count > 1 else "prompt"


def check_token_ids(
    ids, vocab_size: int, what: str = "prompt", allow_empty: bool = False, ordered: bool = True
) -> list[int]:
    """`ids` (a sequence of integer ids, or a 1-D NumPy/JAX integer array; a set too unless
    `ordered`) as a list of ints in [0, vocab_size), or a ValueError saying what is wrong."""
    if isinstance(ids, (str, bytes)):
        raise ValueError(f"{what} must be a list of token ids, not text; tokenize it first")
    if not hasattr(ids, "__iter__") or getattr(ids, "ndim", 1) != 1:  # 0-d arrays iterate no ids
        raise ValueError(f"{what} must be a list of token ids, got {ids!r}")
    _check_ordered(ids, what, sets=not ordered)
    if hasattr(ids, "dtype"):  # an array: one dtype check, then Python ints
        array = np.asarray(ids)
        if not np.issubdtype(array.dtype, np.integer):  # bool is no integer dtype
            raise ValueError(f"{what} must hold integer token ids, got an array of {array.dtype}")
        ids = array.tolist()
    ids = list(ids)
    if not ids and not allow_empty:
        raise ValueError(f"{what} is empty: at least one token id is needed")
    checked = []
    for i in ids:
        token = as_int(i)
        if token is None:
            raise ValueError(f"{what} must hold integer token ids, got {i!r}")
        if not 0 <= token < vocab_size:
            raise ValueError(
                f"{what} holds token id {token}, outside the vocabulary [0, {vocab_size})"
            )
        checked.append(token)
    return checked


def _check_ordered(value, what: str, sets: bool) -> None:
    """ValueError for a mapping, or a set unless `sets`, where a list belongs: iterated, a
    mapping gives its keys (a tokenizer's output: 'input_ids', 'attention_mask') and a set its
    items in hash order, either read without a word as something else."""
    if isinstance(value, Mapping):
        raise ValueError(
            f"{what} must be a list, got a mapping ({type(value).__name__}); a tokenizer's "
            "output holds the ids under 'input_ids' (or use tokenizer.encode)"
        )
    if isinstance(value, Set) and not sets:
        raise ValueError(f"{what} must be a list, got an unordered {type(value).__name__}")


def check_int(name: str, value, minimum: int) -> int:
    """`value` as an int (`as_int`'s integer scalars) after checking it is >= `minimum`;
    ValueError naming `name` otherwise."""
    number = as_int(value)
    if number is None or number < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return number


def check_reserve(config, prompt_tokens, new_tokens) -> tuple[int, int]:
    """`(prompt_tokens, new_tokens)` of a session's reserve as ints, after checking each is an
    integer >= 0 and that together they fit the model's context (ValueError otherwise)."""
    prompt_tokens = check_int("reserve_prompt_tokens", prompt_tokens, 0)
    new_tokens = check_int("reserve_new_tokens", new_tokens, 0)
    if prompt_tokens + new_tokens > config.max_position_embeddings:
        raise ValueError(
            f"reserve_prompt_tokens={prompt_tokens} + reserve_new_tokens={new_tokens} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens"
        )
    return prompt_tokens, new_tokens


def per_row(value, rows: int, name: str) -> list:
    """`value` per row: its items when it is a sequence (or 1-D NumPy/JAX array), else `value`
    repeated; a ValueError naming `name` when the items are not one per row."""
    is_array = getattr(value, "ndim", None) == 1
    if is_array or (isinstance(value, Sequence) and not isinstance(value, str)):
        if len(value) != rows:
            raise ValueError(f"got {len(value)} values of {name} for {rows} prompts")
        return list(value)
    return [value] * rows


def row_sampling(sampling, rows: int) -> list[SamplingParams]:
    """One `SamplingParams` per row: `sampling`'s items, each with its own seed as given, or
    one `SamplingParams` for all rows, row i drawing with the seed `row_seed(seed, i)` (so that
    rows are independent samples, not copies of one)."""
    if isinstance(sampling, SamplingParams):
        return [dataclasses.replace(sampling, seed=row_seed(sampling.seed, i)) for i in range(rows)]
    if isinstance(sampling, str) or not isinstance(sampling, Sequence):  # a str is no list of them
        kind = type(sampling).__name__
        raise ValueError(f"sampling must be a SamplingParams or one per prompt, got {kind}")
    sampling = list(sampling)
    if len(sampling) != rows:
        raise ValueError(f"got {len(sampling)} SamplingParams for {rows} prompts")
    for params in sampling:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling must hold SamplingParams, got {type(params).__name__}")
    return sampling
