"""Training data: regenerated conversations -> padded token batches, through a grain pipeline.

Each JSONL line written by `train.py regenerate` holds `prompt_ids` and `response_ids`. An example
is their concatenation truncated to `max_length` and right-padded; `loss_mask` marks the response
tokens (the draft is trained to predict what the target generates, never the prompt).

The pipeline is a `grain.MapDataset`: all records shuffled with the run's seed (each epoch anew),
this process's slice of that order, repeated indefinitely, batched. Its iterator state is saved
with every checkpoint, so a resumed run reads exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import functools
import logging

import grain
import numpy as np

from jetspec_jax.data.jsonl import read_jsonl

logger = logging.getLogger(__name__)


# Token ids are stored as int32 arrays: Python int lists cost ~9x the memory (every process holds
# all records, and paper-scale data is ~10^9 tokens).
_ID_LIMIT = 2**31


def read_regenerated(
    files, *, vocab_size: int | None = None, max_length: int | None = None
) -> list[dict[str, np.ndarray]]:
    """`{"prompt_ids": int32 [P], "response_ids": int32 [R]}` records of regenerated JSONL files.

    Args:
        files: JSONL paths.
        vocab_size: the target's vocabulary: an id outside it is refused (data regenerated with
            another tokenizer would otherwise train on clamped ids). None: ids must be in
            [0, 2**31).
        max_length: the training length: records whose prompt fills it have no supervised token
            and are skipped; longer ones have their response cut there (`to_example`). Both are
            counted in the log. None: kept whole.

    Raises:
        FileNotFoundError: a file is missing.
        ValueError: a line is not JSON, lacks integer `prompt_ids` / `response_ids` or holds an
            id outside the vocabulary (named by file and line), or the files hold no usable
            record.
    """
    records, too_long, empty = [], 0, 0
    cut, cut_tokens, response_tokens = 0, 0, 0
    limit = _ID_LIMIT if vocab_size is None else vocab_size
    for file in files:
        for where, row in read_jsonl(file, what="training data file"):
            ids = [row.get("prompt_ids"), row.get("response_ids")]
            # Exact types: JSON true is not token 1 (and numpy would read it as 1).
            if not all(isinstance(x, list) and set(map(type, x)) <= {int} for x in ids):
                # A prompt file, say: its text becomes training data through `regenerate`.
                hint = (
                    " (a prompt file? `train.py regenerate` turns it into training data)"
                    if isinstance(row.get("prompt"), str)
                    else ""
                )
                raise ValueError(f"{where} lacks integer prompt_ids / response_ids{hint}")
            if any(x and not 0 <= min(x) <= max(x) < limit for x in ids):
                if vocab_size is None:
                    raise ValueError(f"{where} holds a token id outside [0, 2**31)")
                raise ValueError(
                    f"{where} holds a token id outside the target's vocabulary of {vocab_size} "
                    "(regenerated for another tokenizer?)"
                )
            if max_length is not None and len(ids[0]) >= max_length:
                too_long += 1
            elif ids[0] and ids[1]:
                prompt, response = (np.asarray(x, np.int32) for x in ids)
                records.append({"prompt_ids": prompt, "response_ids": response})
                response_tokens += len(response)
                if max_length is not None and len(prompt) + len(response) > max_length:
                    cut += 1
                    cut_tokens += len(prompt) + len(response) - max_length
            else:
                empty += 1
    if empty:
        logger.warning("skipped %d records with an empty prompt or response", empty)
    if too_long:
        logger.warning(
            "skipped %d records whose prompt fills max_length %d: nothing left to supervise",
            too_long,
            max_length,
        )
    if cut:
        logger.warning(
            "cut %d of %d records at max_length %d: %d of all %d response tokens (%.1f%%) are "
            "not trained on",
            cut,
            len(records),
            max_length,
            cut_tokens,
            response_tokens,
            100 * cut_tokens / response_tokens,
        )
    if not records:
        shorter = "" if max_length is None else f", the prompt shorter than {max_length}"
        raise ValueError(
            f"no usable records (non-empty prompt and response{shorter}) in {list(files)}"
        )
    return records


def count_training_prompts(prompts, records: list[dict[str, np.ndarray]]) -> int:
    """How many of `prompts` (token-id sequences) are the prompt of one of `records`: held-out
    figures measured on those are not held out."""
    seen = {_key(r["prompt_ids"]) for r in records}
    return sum(_key(p) in seen for p in prompts)


def _key(ids) -> bytes:
    """A token-id sequence as a hashable set member (int32 bytes, whatever its container)."""
    return np.asarray(ids, np.int32).tobytes()


def to_example(record: dict[str, np.ndarray], max_length: int) -> dict[str, np.ndarray]:
    """`tokens` `[max_length]` int32 (right-padded with 0) and `loss_mask` `[max_length]` bool."""
    prompt, response = record["prompt_ids"], record["response_ids"]
    sequence = np.concatenate([prompt, response])[:max_length]
    tokens = np.zeros((max_length,), np.int32)
    tokens[: len(sequence)] = sequence
    loss_mask = np.zeros((max_length,), bool)
    loss_mask[len(prompt) : len(sequence)] = True
    return {"tokens": tokens, "loss_mask": loss_mask}


def training_dataset(
    records: list[dict[str, np.ndarray]],
    *,
    batch_size: int,
    max_length: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> grain.IterDataset:
    """An endless, shuffled, batched dataset of this process's share of `records`.

    Every process shuffles all records alike (each epoch anew) and reads its slice of that order
    (`[process_index::process_count]`): the processes' shares of an epoch are disjoint and cover
    it, and a global batch is as random as one process's would be. Slicing before shuffling
    would give every process the same permutation of its slice, so that each global batch were
    runs of `process_count` neighbouring records (`regenerate` writes them roughly by length).
    Batches are of `batch_size` (the local batch): `tokens` `[batch_size, max_length]` int32 and
    `loss_mask` `[batch_size, max_length]` bool (`to_example`).
    """
    # The smallest share decides, so that every process refuses alike (one refusing alone
    # would leave the others waiting in their first collective).
    if len(records) // process_count < batch_size:
        raise ValueError(
            f"{len(records)} examples over {process_count} process(es) leave some process "
            f"{len(records) // process_count}, fewer than one batch of {batch_size}"
        )
    dataset = (
        grain.MapDataset.source(records)
        .shuffle(seed=seed)[process_index::process_count]
        .repeat(None)
        .map(functools.partial(to_example, max_length=max_length))
        .batch(batch_size, drop_remainder=True)
    )
    return dataset.to_iter_dataset()
