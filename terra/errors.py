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
