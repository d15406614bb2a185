"""Framework integrations (CPU compatibility layers for GPU training stacks)."""
