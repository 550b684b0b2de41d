"""The model errors a user can fix (exit 5), apart from the loader so that reporting them
imports no torch (`batchgen status` and the CLI's error handling load in a fraction of a
second)."""


class ModelNotFoundError(FileNotFoundError):
    """--model is nowhere on disk and is not downloaded; the message lists where it looked."""


class CheckpointError(ValueError):
    """A model folder whose files contradict each other or are damaged (named in the message)."""
