"""PrismLLM's communication layer: the prism process group, collective semantics,
group reduction and the capture/replay transports behind it.

Core modules here never import megatron-core or deepspeed.
"""
