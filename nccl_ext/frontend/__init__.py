"""What torch.distributed sees: the prism process group and its installation."""
