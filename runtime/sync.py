"""Gradient sync across pipeline families, and between the two copies of a tied embedding, as shards: across
families as the cost model counts it (cost_model.cross_family_sync_time_s); the tied copies' sum moves each device's
1/replicas shard of the matrix here, where the cost model counts Megatron's all-reduce of a device's whole TP shard of
it between the first and last stage (cost_model.tied_embedding_sync_time_s: the same bytes without replicas, more
with them).

Inside a family, each (stage, TP rank) reduce-scatters its flat gradient over its replicas: replica r keeps chunk r of
the stage's sum (ZeRO-1's chunk). Each element of the model is then held once per (family, stage) by an *owner* (TP
shards are disjoint; a parameter replicated over TP ranks, a norm, is owned by TP rank 0): a stage holds its own layers,
and only a tied model's token embedding is held by two stages of a family (the first, and the last's copy of it as
its output matrix: runtime.model). So every device swaps with each device of another (family, stage) whose owned
elements meet its chunk exactly those elements (by their positions in the whole model's flat vector,
runtime.model.shard_positions) and adds what it receives: its chunk then holds the sum over all families and both
copies, having sent and received only its 1/replicas shard per other holder. Every holder adds the parts in the same
order, by (family, stage), so the copies of an element stay equal to the last bit. An all-gather over the replicas
gives every replica the full gradient back (skipped under ZeRO, whose update needs only its chunk: `summed_chunk`). With
context parallelism the "replicas" here are the dp-cp group's members, replica r's CP rank c being r * cp + c.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm.communicator import CommGroup, Communicator
from comm.plan_groups import stage_chunks
from runtime.model import numbered_shard, positions_of
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
    shards = [
        numbered_shard(model, c.layer_start, c.layer_end, c.first, c.last, tp, recompute)
        for c in stage_chunks(pipeline, index, strategy.virtual_stages)
    ]
    return positions_of(model, shards)


def needs_swaps(model: ModelSpec, strategy: Strategy) -> bool:
    """Whether gradients meet beyond a stage's replicas: several families, or a tied embedding's two copies."""
    return len(strategy.pipelines) > 1 or (model.tied_embeddings and any(len(p.stages) > 1 for p in strategy.pipelines))


@dataclass(frozen=True)
class Holding:
    """What one rank holds after its stage's reduce-scatter: its chunk's positions, and which of them it owns."""

    family: int
    stage: int
    rank: int
    positions: torch.Tensor  # the chunk's elements' positions in the whole model, in flat order
    owned: torch.Tensor  # bool per element: this rank speaks for its (family, stage) at that position


def chunk_bounds(numel: int, index: int, count: int) -> tuple[int, int]:
    """Elements [lo, hi) of replica `index`'s chunk of a flat vector of `numel` over `count` replicas (ZeRO-1's)."""
    size = -(-numel // count)
    return min(numel, index * size), min(numel, (index + 1) * size)


def stage_holdings(
    model: ModelSpec, strategy: Strategy, offsets: dict[str, int], family: int, index: int
) -> list[Holding]:
    """The holding of every rank of one stage."""
    pipeline = strategy.pipelines[family]
    stage = pipeline.stages[index]
    held = []
    tp_positions = [rank_positions(model, strategy, family, index, k) for k in range(stage.tp)]
    for k, positions in enumerate(tp_positions):
        owned = ~torch.isin(positions, torch.cat(tp_positions[:k])) if k else torch.ones_like(positions).bool()
        cp, members = pipeline.context_parallel, pipeline.gradient_ranks  # the DP group: replicas x CP ranks
        for member in range(members):
            lo, hi = chunk_bounds(positions.numel(), member, members)
            rank = stage_rank(offsets, stage, member // cp, k, member % cp, cp)
            held.append(Holding(family, index, rank, positions[lo:hi], owned[lo:hi]))
    return held


def rank_place(strategy: Strategy, offsets: dict[str, int], rank: int) -> tuple[int, int]:
    """(family, stage) of the rank."""
    for family, pipeline in enumerate(strategy.pipelines):
        cp = pipeline.context_parallel
        for index, stage in enumerate(pipeline.stages):
            for k in range(stage.tp):
                for member in range(pipeline.gradient_ranks):
                    if stage_rank(offsets, stage, member // cp, k, member % cp, cp) == rank:
                        return family, index
    raise ValueError(f"rank {rank} holds no stage of the plan")


def may_share(model: ModelSpec, strategy: Strategy, mine: tuple[int, int], other: tuple[int, int]) -> bool:
    """Whether two stages can hold elements of the same position: any two of different families; in one family, a
    tied model's first and last."""
    if mine[0] != other[0]:
        return True
    last = len(strategy.pipelines[mine[0]].stages) - 1
    return model.tied_embeddings and {mine[1], other[1]} == {0, last} and last > 0


@dataclass(frozen=True)
class Swap:
    """With one device of another (family, stage): the elements of my chunk I send (sorted by position) and
    receive."""

    peer: int
    place: tuple[int, int]  # the peer's (family, stage)
    send: torch.Tensor  # indices into my chunk
    receive: torch.Tensor  # indices into my chunk


class ShardedSync:
    """This rank's part of the sharded sync (see the module text)."""

    def __init__(self, model: ModelSpec, strategy: Strategy, offsets: dict[str, int], rank: int, dp: CommGroup) -> None:
        self.place = rank_place(strategy, offsets, rank)
        mine = next(h for h in stage_holdings(model, strategy, offsets, *self.place) if h.rank == rank)
        self.swaps: list[Swap] = []
        for family, pipeline in enumerate(strategy.pipelines):
            for index in range(len(pipeline.stages)):
                if (family, index) == self.place or not may_share(model, strategy, self.place, (family, index)):
                    continue
                for other in stage_holdings(model, strategy, offsets, family, index):
                    send = torch.isin(mine.positions, other.positions) & mine.owned  # what I speak for that it needs
                    receive = torch.isin(mine.positions, other.positions[other.owned])  # what it speaks for, I need
                    if send.any() or receive.any():
                        sent, received = _by_position(mine.positions, send), _by_position(mine.positions, receive)
                        self.swaps.append(Swap(other.rank, (family, index), sent, received))
        self.dp, self.index = dp, dp.ranks.index(rank)

    def sync(self, grads: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """The whole gradient summed over the replicas, the families and a tied matrix's copies (ZeRO-0; ZeRO keeps
        `summed_chunk`)."""
        return all_gathered(self.summed_chunk(grads, comm), grads.numel(), comm, self.dp)

    def summed_chunk(self, grads: torch.Tensor, comm: Communicator) -> torch.Tensor:
        """This replica's chunk of the gradient summed over the replicas, the families and a tied matrix's copies
        (ZeRO-2/3 keep only it)."""
        mine = reduce_scattered(grads, comm, self.dp, self.index)
        received = [torch.empty(s.receive.numel(), dtype=grads.dtype) for s in self.swaps]
        pairs = zip(received, self.swaps, strict=True)
        works = [comm.irecv(buffer, s.peer, SYNC_TAG) for buffer, s in pairs if buffer.numel()]
        works += [comm.isend(mine[s.send].contiguous(), s.peer, SYNC_TAG) for s in self.swaps if s.send.numel()]
        for work in works:
            work.wait()
        parts = [(self.place, None, mine)]
        parts += [(swap.place, swap.receive, part) for swap, part in zip(self.swaps, received, strict=True)]
        total = torch.zeros_like(mine)
        for _, where, values in sorted(parts, key=lambda part: part[0]):  # the same order on every holder
            if where is None:
                total += values
            else:
                total[where] += values
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
