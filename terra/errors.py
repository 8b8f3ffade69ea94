"""Errors raised where bad input enters terra; each message names the value and the fix."""


class ConfigError(ValueError):
    """A configuration that cannot work (sizes, sparsity, bindings)."""
