"""Gradient sync across pipeline families as shards, as the cost model counts it (cost_model.cross_family_sync_time_s).

Inside a family, each (stage, TP rank) reduce-scatters its flat gradient over its replicas: replica r keeps chunk r of
the family's sum (ZeRO-1's chunk). Across families, each element of the model is held once per family by an *owner*
(TP shards are disjoint; a parameter replicated over TP ranks, a norm, is owned by TP rank 0), so every device swaps
with each device of another family whose owned elements meet its chunk exactly those elements (by their positions in
the whole model's flat vector, runtime.model.shard_positions) and adds what it receives: its chunk then holds the sum
over all families, having sent and received only its 1/replicas shard per other family. An all-gather over the
replicas gives every replica the full gradient back (skipped under ZeRO, whose update needs only its chunk:
`summed_chunk`). With context parallelism the "replicas" here are the dp-cp group's members,
replica r's CP rank c being r * cp + c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm.communicator import CommGroup, Communicator
from comm.plan_groups import stage_chunks
from runtime.model import shard_positions
from runtime.tensor_parallel import TensorParallel
from specs.layout import Strategy, stage_rank
from specs.model import ModelSpec

SYNC_TAG = 2  # point-to-point tag of the shard swaps (pipeline activations use 0, gradients 1)


def rank_positions(model: ModelSpec, strategy: Strategy, family: int, index: int, tp_rank: int) -> torch.Tensor:
    """Positions in the whole model of every element of a rank's trainable parameters (all its chunks, in order)."""
    pipeline = strategy.pipelines[family]
    stage = pipeline.stages[index]
    recompute = strategy.stage_recompute(stage)
    tp = TensorParallel(None, stage.tp, tp_rank)
    parts = [
        shard_positions(model, c.layer_start, c.layer_end, c.first, c.last, tp, recompute)
        for c in stage_chunks(pipeline, index, strategy.virtual_stages)
    ]
    return torch.cat(parts)


@dataclass(frozen=True)
class Holding:
    """What one rank holds after its family's reduce-scatter: its chunk's positions, and which of them it owns."""

    rank: int
    positions: torch.Tensor  # the chunk's elements' positions in the whole model, in flat order
    owned: torch.Tensor  # bool per element: this rank speaks for its family at that position


def chunk_bounds(numel: int, index: int, count: int) -> tuple[int, int]:
    """Elements [lo, hi) of replica `index`'s chunk of a flat vector of `numel` over `count` replicas (ZeRO-1's)."""
    size = -(-numel // count)
    return min(numel, index * size), min(numel, (index + 1) * size)


def family_holdings(model: ModelSpec, strategy: Strategy, offsets: dict[str, int]) -> list[list[Holding]]:
    """Every rank's holding, family by family."""
    families = []
    for family, pipeline in enumerate(strategy.pipelines):
        held = []
        for index, stage in enumerate(pipeline.stages):
            tp_positions = [rank_positions(model, strategy, family, index, k) for k in range(stage.tp)]
            for k, positions in enumerate(tp_positions):
                owned = ~torch.isin(positions, torch.cat(tp_positions[:k])) if k else torch.ones_like(positions).bool()
                cp, members = pipeline.context_parallel, pipeline.gradient_ranks  # the DP group: replicas x CP ranks
                for member in range(members):
                    lo, hi = chunk_bounds(positions.numel(), member, members)
                    rank = stage_rank(offsets, stage, member // cp, k, member % cp, cp)
                    held.append(Holding(rank, positions[lo:hi], owned[lo:hi]))
        families.append(held)
    return families


@dataclass(frozen=True)
class Swap:
    """With one device of another family: the elements of my chunk I send (sorted by position) and receive."""

    peer: int
    send: torch.Tensor  # indices into my chunk
    receive: torch.Tensor  # indices into my chunk


class CrossFamilySync:
    """This rank's part of the sharded sync (see the module text)."""

    def __init__(self, model: ModelSpec, strategy: Strategy, offsets: dict[str, int], rank: int, dp: CommGroup) -> None:
        families = family_holdings(model, strategy, offsets)
        mine_family = next(f for f, held in enumerate(families) if any(h.rank == rank for h in held))
        mine = next(h for h in families[mine_family] if h.rank == rank)
        self.swaps: list[Swap] = []
        for family, held in enumerate(families):
            if family == mine_family:
                continue
            for other in held:
                send = torch.isin(mine.positions, other.positions) & mine.owned  # what I speak for that it needs
                receive = torch.isin(mine.positions, other.positions[other.owned])  # what it speaks for that I need
                if send.any() or receive.any():
                    swap = Swap(other.rank, _by_position(mine.positions, send), _by_position(mine.positions, receive))
                    self.swaps.append(swap)
        self.dp, self.index = dp, dp.ranks.index(rank)

    def sync(self, grads: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """The whole gradient summed over the replicas and the families (ZeRO-0; ZeRO keeps `summed_chunk`)."""
        return all_gathered(self.summed_chunk(grads, comm), grads.numel(), comm, self.dp)

    def summed_chunk(self, grads: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """This replica's chunk of the gradient summed over the replicas and the families (ZeRO-2/3 keep only it)."""
        mine = reduce_scattered(grads, comm, self.dp, self.index)
        received = [torch.empty(s.receive.numel(), dtype=grads.dtype) for s in self.swaps]
        pairs = zip(received, self.swaps, strict=True)
        works = [comm.irecv(buffer, s.peer, SYNC_TAG) for buffer, s in pairs if buffer.numel()]
        works += [comm.isend(mine[s.send].contiguous(), s.peer, SYNC_TAG) for s in self.swaps if s.send.numel()]
        for work in works:
            work.wait()
        total = mine.clone()
        for buffer, swap in zip(received, self.swaps, strict=True):
            total[swap.receive] += buffer
        return total


def reduce_scattered(flat: torch.Tensor, comm: Communicator, dp: CommGroup, index: int) -> torch.Tensor:
    """Member `index`'s chunk (chunk_bounds) of the sum of `flat` over the group: the vector is padded to a multiple
    of the group size for the reduce-scatter, and the padding cut off again."""
    count, numel = len(dp.ranks), flat.numel()
    size = -(-numel // count)
    padded = torch.zeros(size * count, dtype=flat.dtype)
    padded[:numel] = flat
    lo, hi = chunk_bounds(numel, index, count)
    return comm.reduce_scatter(padded, dp)[: hi - lo]


def all_gathered(chunk: torch.Tensor, numel: int, comm: Communicator, dp: CommGroup) -> torch.Tensor:
    """The whole flat vector of `numel` elements from every member's chunk (chunk_bounds) of it."""
    size = -(-numel // len(dp.ranks))
    padded = torch.zeros(size, dtype=chunk.dtype)
    padded[: chunk.numel()] = chunk
    return torch.cat(comm.all_gather(padded, dp))[:numel]


def _by_position(positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Indices of the masked elements, ordered by their position in the whole model (both sides of a swap agree)."""
    indices = torch.nonzero(mask).flatten()
    return indices[torch.argsort(positions[indices])]
