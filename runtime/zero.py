"""ZeRO-3 (FSDP) in the runtime: a rank holds only its 1/dp shard of its stage's flat parameter vector, and each unit
(the embedding, each decoder layer, the final norm and LM head) has its full weights only while it computes.

The shard is ZeRO-1's chunk of the rank's flat trainable-parameter vector (runtime.sync.chunk_bounds), so the
optimizer, the checkpoints and the gradient sync across pipeline families see the same layout under ZeRO-1, 2 and 3.
Each unit's parameters are views into one flat buffer of the unit; between uses the buffer's storage is resized to
zero bytes (FSDP1's trick), so the views keep their shapes but hold no memory, and tensors autograd saved from them
(the weights a GEMM's backward reads) see the weights again once the buffer is refilled.

A tied model's LM head on the rank of its embedding computes with the embedding unit's matrix: that unit is gathered
and freed with the head's (`Unit.borrowed`), so the head's unit holds only the final norm.

A unit is gathered by a forward pre-hook and freed by a forward hook; the forward hook also puts a hook on the unit's
output, which runs when that output's gradient is complete, i.e. just before the unit's backward (recomputation
included: full recompute re-runs the layer inside its backward, selective recompute reads the saved weights there):
it frees the unit whose backward just finished and gathers this one. The runner frees the last one after each
backward. So at most one unit is gathered at a time (a tied head's with the embedding's). No prefetch: a gather
waits for its pieces.

The gathers are point-to-point, not collectives: replicas with uneven batch shares run different numbers of
micro-batches (and interleaved schedules group them differently), so they gather different units at different times,
and a collective would need every replica to gather the same unit together. Every rank knows every DP peer's schedule
(predictor.schedule.stage_order), so at the start of a step it posts, in each peer's order of gathers, a send of its
piece of each unit the peer will gather; a gather then only receives the pieces from their owners. The sends never
wait, so no schedule can deadlock on them; the step waits for them to complete before the optimizer changes the shard.
The bytes each rank sends per gather are those of a ring all-gather ((n - 1) pieces of its own).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from comm.communicator import CommGroup, Communicator
from predictor.schedule import stage_order
from runtime.model import StageModule, trainable_parameters
from runtime.sync import chunk_bounds

GATHER_TAG = 3  # point-to-point tag of the weight pieces (pipeline activations 0, gradients 1, sharded sync 2)


@dataclass
class Unit:
    """Modules whose parameters are gathered together: elements [start, end) of the rank's flat parameter vector,
    with `buffer` (end - start elements, storage freed between uses) behind the parameters' data; `borrowed`, earlier
    units whose parameters the module also computes with (a tied LM head: the embedding's)."""

    module: nn.Module
    chunk: int
    start: int
    end: int
    buffer: torch.Tensor
    borrowed: list[Unit]

    @property
    def gathered(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    def together(self) -> list[Unit]:
        """The units gathered (and freed) when this one is."""
        return [self, *self.borrowed]


def stage_units(modules: list[StageModule]) -> list[tuple[int, nn.Module]]:
    """(chunk, module) of each unit, in the order of the rank's flat parameter vector."""
    units: list[tuple[int, nn.Module]] = []
    for chunk, module in enumerate(modules):
        parts = [module.embedding, *module.layers, module.head]
        units += [(chunk, part) for part in parts if part is not None]
    return units


def trainable(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


class ShardedParameters:
    """One rank's ZeRO-3 parameters: its shard, the units and their gathers (see the module text)."""

    def __init__(
        self,
        modules: list[StageModule],
        rank: int,
        dp: CommGroup,
        comm: Communicator,
        peer_microbatches: dict[int, int],
        schedule: tuple[int, int, int],
    ) -> None:
        """`peer_microbatches`: every DP member's micro-batch count; `schedule`: (stages p, virtual stages v, this
        stage's index), with which the members' orders of gathers are derived."""
        self.rank, self.dp, self.comm = rank, dp, comm
        self.peer_microbatches, self.schedule = peer_microbatches, schedule
        self.units: list[Unit] = []
        self.backward_unit: Unit | None = None
        self.sends: list[dist.Work] = []
        self.gather_s = 0.0  # time spent receiving pieces (the run record's DP term)
        self.gathered_elements = 0
        self.peak_gathered_elements = 0
        params = trainable_parameters(modules)
        owner: dict[int, Unit] = {}  # a parameter's unit, by id
        in_units = [p for _, part in stage_units(modules) for p in trainable(part)]
        if [id(p) for p in dict.fromkeys(in_units)] != [id(p) for p in params]:
            raise RuntimeError("the units do not hold the rank's parameters in the order of its flat vector")
        self.numel = sum(p.numel() for p in params)
        self.bounds = [chunk_bounds(self.numel, i, len(dp.ranks)) for i in range(len(dp.ranks))]
        self.lo, self.hi = self.bounds[dp.ranks.index(rank)]
        self.shard = torch.empty(self.hi - self.lo, dtype=params[0].dtype)
        start = 0
        with torch.no_grad():  # unit by unit, so that beside the built stage only one unit's copy exists at a time
            for chunk, module in stage_units(modules):
                own = [p for p in trainable(module) if id(p) not in owner]
                borrowed: list[Unit] = []
                for p in trainable(module):
                    if id(p) in owner and all(unit is not owner[id(p)] for unit in borrowed):
                        borrowed.append(owner[id(p)])
                buffer = torch.cat([p.detach().reshape(-1) for p in own])
                unit = Unit(module, chunk, start, start + buffer.numel(), buffer, borrowed)
                lo, hi = max(unit.start, self.lo), min(unit.end, self.hi)
                if lo < hi:
                    self.shard[lo - self.lo : hi - self.lo] = buffer[lo - unit.start : hi - unit.start]
                offset = 0
                for p in own:
                    p.data = buffer[offset : offset + p.numel()].view_as(p)  # the built weights go
                    owner[id(p)] = unit
                    offset += p.numel()
                buffer.untyped_storage().resize_(0)
                self.units.append(unit)
                start = unit.end
        for unit in self.units:
            unit.module.register_forward_pre_hook(lambda module, args, unit=unit: self._gather(unit))
            unit.module.register_forward_hook(lambda module, args, out, unit=unit: self._after_forward(unit, out))

    # ---- the step --------------------------------------------------------------------------------------------
    def post_sends(self) -> None:
        """At the start of a step: this rank's piece of every unit each DP peer will gather, in that peer's order."""
        p, v, index = self.schedule
        for peer in self.dp.ranks:
            if peer == self.rank:
                continue
            for kind, _, chunk in stage_order(p, self.peer_microbatches[peer], v, index):
                units = [u for u in self.units if u.chunk == chunk]
                for unit in units if kind == "forward" else reversed(units):
                    for part in unit.together():
                        lo, hi = max(part.start, self.lo), min(part.end, self.hi)
                        if lo < hi:
                            piece = self.shard[lo - self.lo : hi - self.lo]
                            self.sends.append(self.comm.isend(piece, peer, GATHER_TAG))

    def wait_sends(self) -> None:
        """Before the optimizer changes the shard: every piece sent has been received."""
        for work in self.sends:
            work.wait()
        self.sends.clear()

    def after_backward(self) -> None:
        """The runner's call after a chunk's backward: the last unit it gathered is done."""
        if self.backward_unit is not None:
            self._free(self.backward_unit)
            self.backward_unit = None

    # ---- hooks -----------------------------------------------------------------------------------------------
    def _after_forward(self, unit: Unit, out: torch.Tensor) -> None:
        self._free(unit)
        if out.requires_grad:
            out.register_hook(lambda grad: self._before_backward(unit))

    def _before_backward(self, unit: Unit) -> None:
        self.after_backward()
        self._gather(unit)
        self.backward_unit = unit

    def _gather(self, unit: Unit) -> None:
        for part in unit.together():
            self._fill(part)

    def _fill(self, unit: Unit) -> None:
        """Refill the unit's buffer: this rank's own piece from its shard, the others' received."""
        if unit.gathered:
            raise RuntimeError(f"unit at {unit.start} gathered twice: the order of gathers differs from the peers'")
        started = time.perf_counter()
        unit.buffer.untyped_storage().resize_((unit.end - unit.start) * unit.buffer.element_size())
        works = []
        with torch.no_grad():
            for member, (lo, hi) in zip(self.dp.ranks, self.bounds, strict=True):
                lo, hi = max(unit.start, lo), min(unit.end, hi)
                if lo >= hi:
                    continue
                piece = unit.buffer[lo - unit.start : hi - unit.start]
                if member == self.rank:
                    piece.copy_(self.shard[lo - self.lo : hi - self.lo])
                else:
                    works.append(self.comm.irecv(piece, member, GATHER_TAG))
            for work in works:
                work.wait()
        self.gather_s += time.perf_counter() - started
        self.gathered_elements += unit.end - unit.start
        self.peak_gathered_elements = max(self.peak_gathered_elements, self.gathered_elements)

    def _free(self, unit: Unit) -> None:
        for part in unit.together():
            if part.gathered:
                part.buffer.untyped_storage().resize_(0)
                self.gathered_elements -= part.end - part.start
