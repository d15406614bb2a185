"""A sandbox rank's side of emulation: the replay transport, its recording, sandbox peers, divergence checks, the assistant."""
