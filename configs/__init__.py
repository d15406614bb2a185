"""Hydra configuration shipped with prism-launch (``config.yaml`` selects the typed schema)."""
