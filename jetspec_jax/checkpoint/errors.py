"""The one error type for checkpoints that cannot be loaded as asked, and `gguf_hint`."""

import os


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, unsupported, or does not match what it is loaded into.

    Messages name the offending file, field or tensor, so the user can fix the checkpoint.
    """


def gguf_hint(path: str | os.PathLike) -> str:
    """What to add to an error about a file given where a checkpoint directory belongs: the
    conversion a GGUF file needs ("" for any other file)."""
    if os.fspath(path).endswith(".gguf"):
        return " (a GGUF file: convert it with convert_gguf_to_hf)"
    return ""
