"""The one error type of configuration."""


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and what to do."""
