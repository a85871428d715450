"""Megatron-style tensor parallelism inside a stage: the f / g boundaries, vocabulary-parallel embedding and loss.

`TensorParallel` wraps the stage's TP process group. `enter` (Megatron's f) is identity forward and all-reduce of the
input gradient backward, placed where a replicated activation meets a column-parallel GEMM; `leave` (g) all-reduces a
row-parallel GEMM's partial output forward and is identity backward. Activations are replicated across the TP ranks
(no sequence parallelism in the runtime). While speed emulation repeats layer math the collectives are skipped
(`suppressed`), so an emulated slow rank does more compute, not more communication.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from profiler.layers import EnterTensorParallel, LeaveTensorParallel, VocabParallelCrossEntropy


class TensorParallel:
    """A stage's TP group: `size` ranks, this one is `rank`; `group` is None for TP 1."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.suppressed = False
        self.comm_s = 0.0  # time spent in this group's collectives (the run record's measured TP term)
        self.comm_cpu_s = 0.0  # the process's CPU time meanwhile (every thread: Gloo's included)

    def all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> torch.Tensor:
        if self.size > 1 and not self.suppressed:
            started, cpu = time.perf_counter(), time.process_time()
            dist.all_reduce(tensor, op=op, group=self.group)
            self.comm_s += time.perf_counter() - started
            self.comm_cpu_s += time.process_time() - cpu
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.all_reduce(tensor, dist.ReduceOp.MAX)

    @contextmanager
    def suppress(self) -> Iterator[None]:
        self.suppressed = True
        try:
            yield
        finally:
            self.suppressed = False

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return EnterTensorParallel.apply(x, self) if self.size > 1 else x

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return LeaveTensorParallel.apply(x, self) if self.size > 1 else x


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the token embedding; the partial lookups are summed over the TP group. Learned
    positions are those of the first tokens of a sequence, or `token_positions` (a CP rank's chunks)."""

    def __init__(
        self,
        weight: torch.Tensor,
        start: int,
        tp: TensorParallel,
        positions: torch.Tensor | None,
        token_positions: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.start = start
        self.tp = tp
        self.positions = nn.Parameter(positions.clone()) if positions is not None else None
        self.token_positions = token_positions

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        x = self.tp.leave(x)
        if self.positions is not None:
            if self.token_positions is not None:
                x = x + self.positions[self.token_positions]
            else:
                x = x + self.positions[: token_ids.shape[1]]
        return x


class VocabParallelHead(nn.Module):
    """Final norm (replicated), the output projection's vocabulary rows [start, ...) and the parallel loss."""

    def __init__(self, norm: nn.Module, weight: torch.Tensor, start: int, tp: TensorParallel) -> None:
        super().__init__()
        self.norm = norm
        self.weight = nn.Parameter(weight.clone())
        self.start = start
        self.tp = tp

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.tp.enter(self.norm(x)), self.weight)
        return VocabParallelCrossEntropy.apply(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), self.start, self.tp
        )
