"""Errors raised where bad input enters terra; each message names the value and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot work (sizes, sparsity, bindings)."""


class DataNotFoundError(FileNotFoundError):
    """Data a task needs is not on disk (or not prepared); the message names the path tried and
    how to obtain or prepare the data. terra never falls back to a network download."""


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. the loss diverged); saved checkpoints are left intact."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used: it is missing, unreadable, or does not fit the target."""


class InputError(ValueError):
    """A user's input file cannot be used (empty, not UTF-8, not the expected format)."""


class UsageError(ValueError):
    """A command line that cannot be parsed: an unknown flag, a bad flag value, a missing argument."""


class StorageError(TrainingError):
    """The disk is full or read-only, or a folder cannot be written: the job stops, and what it
    saved before (checkpoints commit atomically) is left as it was."""


# What the file systems say when they cannot store: errno values, and the words of errors that
# carry none (TensorFlow's ResourceExhaustedError from tf.data's iterator save, TensorStore's).
_STORAGE_ERRNOS = {
    28: "no space left on the device",  # ENOSPC
    122: "the disk quota is exceeded",  # EDQUOT
    30: "the file system is read-only",  # EROFS
}
_STORAGE_WORDS = {
    "no space left on device": "no space left on the device",
    "disk quota exceeded": "the disk quota is exceeded",
    "read-only file system": "the file system is read-only",
}


def storage_problem(error: BaseException):
    """What stopped a write, in words (``'no space left on the device'``), where ``error`` or an
    error it was raised from is a full or read-only disk; None for any other error."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS:
            return _STORAGE_ERRNOS[error.errno]
        text = str(error).lower()
        for words, problem in _STORAGE_WORDS.items():
            if words in text:
                return problem
        error = error.__cause__ or error.__context__
    return None
