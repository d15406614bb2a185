"""The one error type of configuration (defined in :mod:`prism_launch.errors`)."""

from prism_launch.errors import ConfigError

__all__ = ["ConfigError"]
