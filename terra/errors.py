"""Errors raised where bad input enters terra; each message names the value and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot work (sizes, sparsity, bindings)."""


class DataNotFoundError(FileNotFoundError):
    """Data a task needs is not on disk (or not prepared); the message names the path tried and
    how to obtain or prepare the data. terra never falls back to a network download."""


class TrainingError(RuntimeError):
    """Training cannot continue (e.g. the loss diverged); saved checkpoints are left intact."""
