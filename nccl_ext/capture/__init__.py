"""A captured rank's side of capture: its transport to the coordinator, the exchange, waits on the GPU, discovery."""
