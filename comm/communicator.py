"""One communicator over islands of different vendors: native groups inside an island, a bridge across islands.

Every rank belongs to an island (a vendor's devices that its native library connects). A group inside one island
uses the island's native backend. A group that spans islands is a `hetplan` backend group (comm/backend.py): its
collectives run hierarchically over the island libraries and the bridge, and, being a registered torch.distributed
backend, the same group serves DDP, FSDP and pipelining. On a CPU-only machine the islands are simulated: every
native library is Gloo and the bridge still stages through separate host buffers.

Every rank must create every group in the same order (torch.distributed's rule), so groups are made in one call,
`create_groups`, from one list that every rank computes the same way. Every wait is bounded by the timeout; a dead or
hung peer becomes a `CommError` naming the operation, the group and the timeout on every surviving rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from comm.backend import BACKEND_NAME, CommError, HetplanProcessGroup, StagedWork, register_backend
from comm.vendors import VENDORS, Vendor

__all__ = ["CommError", "CommGroup", "Communicator"]
_FAILURES = (RuntimeError, dist.DistBackendError, CommError)
# torch 2.13 renamed the tensor form of reduce-scatter; older releases have only the old name
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommGroup:
    """A group of global ranks; `islands` maps each island in it to its ranks (in group order). `process_group` is
    the native group (one island) or a `hetplan` backend group (several); None on ranks outside it."""

    ranks: tuple[int, ...]
    islands: dict[str, tuple[int, ...]]
    process_group: dist.ProcessGroup | None = None

    @property
    def single_island(self) -> bool:
        return len(self.islands) == 1


class Communicator:
    """Create with `dist` initialised (Gloo default group); `islands[r]` is rank r's island (a vendor name)."""

    def __init__(self, islands: Sequence[str], timeout_s: float = 60.0, simulated: bool = True) -> None:
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised: call init_process_group first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if len(islands) != self.world_size:
            raise CommError(f"expected an island for each of {self.world_size} ranks, got {len(islands)}")
        register_backend(islands, simulated)
        self.islands = list(islands)
        self.timeout = timedelta(seconds=timeout_s)
        self.simulated = simulated
        self.groups: dict[tuple[int, ...], CommGroup] = {}

    # ---- groups -------------------------------------------------------------------------------------------
    def vendor(self, rank: int) -> Vendor:
        return VENDORS[self.islands[rank]]

    def create_groups(self, rank_lists: Sequence[Sequence[int]]) -> list[CommGroup]:
        """Create every group in one deterministic order on every rank (ranks outside a group call too)."""
        made = []
        for ranks in rank_lists:
            key = tuple(ranks)
            if key not in self.groups:
                islands: dict[str, list[int]] = {}
                for rank in key:
                    islands.setdefault(self.islands[rank], []).append(rank)
                group = CommGroup(key, {name: tuple(r) for name, r in islands.items()})
                if len(key) > 1:
                    backend = BACKEND_NAME
                    if group.single_island:
                        backend = "gloo" if self.simulated else VENDORS[self.islands[key[0]]].backend
                    made_group = dist.new_group(list(key), timeout=self.timeout, backend=backend)
                    group.process_group = made_group if self.rank in key else None
                self.groups[key] = group
            made.append(self.groups[key])
        return made

    def _fail(self, op: str, group: CommGroup, err: BaseException) -> CommError:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return CommError(
            f"rank {self.rank}: {op} over ranks {list(group.ranks)} failed within the "
            f"{self.timeout.total_seconds():g} s timeout (a peer died or hangs?): {text}"
        )

    @staticmethod
    def _staged(tensor: torch.Tensor) -> torch.Tensor:
        """A host copy for the bridge (a separate buffer even on the CPU, as device memory would need)."""
        return tensor.detach().to("cpu", copy=True)

    # ---- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """Sum over the group, in place (hierarchically when it spans islands)."""
        try:
            if group.process_group is not None:
                dist.all_reduce(tensor, group=group.process_group)
            return tensor
        except _FAILURES as err:
            raise self._fail("all_reduce", group, err) from None

    def bridged_all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """A flat all-reduce of the whole group through the bridge (no island hierarchy), in place: the baseline
        the hierarchical path is compared with."""
        try:
            pg = group.process_group
            if isinstance(pg, HetplanProcessGroup):
                pg.bridged_all_reduce(tensor)
            elif pg is not None:
                host = self._staged(tensor)
                dist.all_reduce(host, group=pg)
                tensor.copy_(host)
            return tensor
        except _FAILURES as err:
            raise self._fail("bridged all_reduce", group, err) from None

    def all_gather(self, tensor: torch.Tensor, group: CommGroup) -> list[torch.Tensor]:
        """Every member's tensor, in group order."""
        try:
            if group.process_group is None:
                return [tensor.clone()]
            out = [torch.empty_like(tensor) for _ in group.ranks]
            dist.all_gather(out, tensor, group=group.process_group)
            return out
        except _FAILURES as err:
            raise self._fail("all_gather", group, err) from None

    def reduce_scatter(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """This member's 1/n of the sum (tensor's first dimension divisible by the group size)."""
        n = len(group.ranks)
        if tensor.shape[0] % n:
            raise CommError(f"reduce_scatter needs the first dimension ({tensor.shape[0]}) divisible by {n}")
        try:
            if group.process_group is None:
                return tensor.clone()
            out = torch.empty_like(tensor.chunk(n)[0])
            _reduce_scatter(out, tensor.contiguous(), group=group.process_group)
            return out
        except _FAILURES as err:
            raise self._fail("reduce_scatter", group, err) from None

    def broadcast(self, tensor: torch.Tensor, src: int, group: CommGroup) -> torch.Tensor:
        try:
            if group.process_group is not None:
                dist.broadcast(tensor, src=src, group=group.process_group)
            return tensor
        except _FAILURES as err:
            raise self._fail("broadcast", group, err) from None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point over the default group (staged through the host across islands), bounded by the timeout."""
        self.isend(tensor, dst).wait()

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.irecv(tensor, src).wait()
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> dist.Work:
        """Start a send over the default group (staged through the host when `dst` is on another island); messages
        between two ranks match receives of the same tag in order."""
        payload = tensor.detach().contiguous() if self.islands[dst] == self.islands[self.rank] else self._staged(tensor)
        try:
            return StagedWork(dist.isend(payload, dst=dst, tag=tag), self.timeout, [self.rank, dst])
        except _FAILURES as err:
            raise CommError(f"rank {self.rank}: send to {dst} failed: {str(err).splitlines()[0]}") from None

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> dist.Work:
        """Start a receive into `tensor` (through a host buffer across islands); `wait()`, bounded by the timeout,
        completes it."""
        same_island = self.islands[src] == self.islands[self.rank]
        buffer = tensor if same_island else torch.empty_like(tensor, device="cpu")
        try:
            work = dist.irecv(buffer, src=src, tag=tag)
        except _FAILURES as err:
            raise CommError(f"rank {self.rank}: recv from {src} failed: {str(err).splitlines()[0]}") from None
        if same_island:
            return StagedWork(work, self.timeout, [src, self.rank])
        return StagedWork(work, self.timeout, [src, self.rank], buffer, tensor)

    def barrier(self, group: CommGroup) -> None:
        try:
            if group.process_group is not None:
                dist.barrier(group=group.process_group)
        except _FAILURES as err:
            raise self._fail("barrier", group, err) from None
