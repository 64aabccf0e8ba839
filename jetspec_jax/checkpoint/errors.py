"""The error type for checkpoints that cannot be loaded as asked (with its case for one made
for another target), and `gguf_hint`."""

import os


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, unsupported, or does not match what it is loaded into.

    Messages name the offending file, field or tensor, so the user can fix the checkpoint.
    """


class TargetMismatchError(CheckpointError):
    """A draft or adapter that is well formed but made for another target: its hidden size,
    vocabulary, target depth, taps, mask token or the adapter's context and RoPE do not fit the
    target it is loaded for (a command line given no `--target` may name the flag)."""


def gguf_hint(path: str | os.PathLike) -> str:
    """What to add to an error about a file given where a checkpoint directory belongs: the
    conversion a GGUF file needs ("" for any other file)."""
    if os.fspath(path).endswith(".gguf"):
        return " (a GGUF file: convert it with convert_gguf_to_hf)"
    return ""
