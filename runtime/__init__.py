"""Executes a Plan on torch.distributed and measures it (needs torch)."""
