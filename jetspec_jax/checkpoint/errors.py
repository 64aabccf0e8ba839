"""The one error type for checkpoints that cannot be loaded as asked."""


class CheckpointError(ValueError):
    """A checkpoint is missing, malformed, unsupported, or does not match what it is loaded into.

    Messages name the offending file, field or tensor, so the user can fix the checkpoint.
    """
