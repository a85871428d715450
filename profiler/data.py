"""The synthetic tokens hetplan's runtime trains on; here so that the profiler can time making them
(profiler/host.py) as the runtime makes them every step."""

from __future__ import annotations

try:
    import torch
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("making training batches") from err

from specs.model import ModelSpec


def synthetic_batch(model: ModelSpec, global_batch: int, seq_length: int, seed: int, step: int) -> torch.Tensor:
    """Token sequences (global_batch, seq_length + 1) following a fixed rule next = (7 * token + 3) mod V with
    random starts and 10% random tokens: learnable, so the loss falls as training works."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    vocab = model.vocab_size
    tokens = torch.empty(global_batch, seq_length + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (global_batch,), generator=generator)
    for t in range(seq_length):
        tokens[:, t + 1] = (7 * tokens[:, t] + 3) % vocab
    noise = torch.rand(global_batch, seq_length + 1, generator=generator) < 0.1
    tokens[noise] = torch.randint(0, vocab, (int(noise.sum()),), generator=generator)
    return tokens
