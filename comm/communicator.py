"""One communicator over islands of different vendors: native groups inside an island, a bridge across islands.

Every rank belongs to an island (a vendor's devices that its native library connects). A group inside one island
uses the island's native backend. A group that spans islands runs collectives hierarchically (DESIGN.md): reduce-scatter
inside each island, all-reduce of the shards across islands (rank j of every island together), all-gather inside;
islands of unequal size reduce to a leader, all-reduce among the leaders and broadcast. Cross-island traffic goes
through the bridge: a cross-vendor backend when one is installed (FlagCX), else host staging over Gloo (device ->
host -> TCP -> host -> device, in chunks so copies and transfers overlap). On a CPU-only machine the islands are
simulated: every native library is Gloo and the bridge still stages through separate host buffers.

Every rank must create every group in the same order (torch.distributed's rule), so groups are made in one call,
`create_groups`, from one list that every rank computes the same way. Every wait is bounded by the timeout; a dead or
hung peer becomes a `CommError` naming the operation, the group and the timeout on every surviving rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from comm.vendors import VENDORS, Vendor
from specs.errors import HetplanError

CHUNK_BYTES = 4 * 2**20
# torch 2.13 renamed the tensor forms of reduce-scatter and all-gather; older releases have only the old names
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CommError(HetplanError):
    """A collective failed or timed out (a peer died or hangs)."""


@dataclass
class CommGroup:
    """A group of global ranks; `islands` maps each island in it to its ranks (in group order)."""

    ranks: tuple[int, ...]
    islands: dict[str, tuple[int, ...]]
    native: dist.ProcessGroup | None = None  # the whole group, when it lies in one island
    bridge: dist.ProcessGroup | None = None  # the whole group over the bridge (p2p, gathers, broadcast)
    inside: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)  # per island
    across: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)  # shard j: rank j of every island
    leaders: dist.ProcessGroup | None = None  # rank 0 of every island (unequal islands)

    @property
    def single_island(self) -> bool:
        return len(self.islands) == 1

    @property
    def equal_islands(self) -> bool:
        return len({len(r) for r in self.islands.values()}) == 1


class Communicator:
    """Create with `dist` initialised (Gloo default group); `islands[r]` is rank r's island (a vendor name)."""

    def __init__(self, islands: Sequence[str], timeout_s: float = 60.0, simulated: bool = True) -> None:
        if not dist.is_initialized():
            raise CommError("torch.distributed is not initialised: call init_process_group first")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        if len(islands) != self.world_size:
            raise CommError(f"expected an island for each of {self.world_size} ranks, got {len(islands)}")
        unknown = sorted(set(islands) - set(VENDORS))
        if unknown:
            raise CommError(f"unknown island vendor(s) {unknown}; known: {', '.join(VENDORS)}")
        self.islands = list(islands)
        self.timeout = timedelta(seconds=timeout_s)
        self.simulated = simulated
        self.groups: dict[tuple[int, ...], CommGroup] = {}

    # ---- groups -------------------------------------------------------------------------------------------
    def vendor(self, rank: int) -> Vendor:
        return VENDORS[self.islands[rank]]

    def _native_backend(self, island: str) -> str:
        return "gloo" if self.simulated else VENDORS[island].backend

    def _new(self, ranks: Sequence[int], backend: str) -> dist.ProcessGroup | None:
        """A process group (every rank calls this); None on ranks outside it or for a single rank."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return None
        group = dist.new_group(ranks, timeout=self.timeout, backend=backend)
        return group if self.rank in ranks else None

    def create_groups(self, rank_lists: Sequence[Sequence[int]]) -> list[CommGroup]:
        """Create every group (and its island and bridge subgroups) in one deterministic order on every rank."""
        made = []
        for ranks in rank_lists:
            key = tuple(ranks)
            if key in self.groups:
                made.append(self.groups[key])
                continue
            islands: dict[str, list[int]] = {}
            for rank in key:
                islands.setdefault(self.islands[rank], []).append(rank)
            group = CommGroup(key, {name: tuple(r) for name, r in islands.items()})
            if group.single_island:
                island = next(iter(islands))
                group.native = self._new(key, self._native_backend(island))
            else:
                group.bridge = self._new(key, "gloo")
                for name, members in islands.items():
                    group.inside[name] = self._new(members, self._native_backend(name))
                if group.equal_islands:
                    size = len(next(iter(islands.values())))
                    for j in range(size):
                        group.across[j] = self._new([members[j] for members in islands.values()], "gloo")
                else:
                    group.leaders = self._new([members[0] for members in islands.values()], "gloo")
            self.groups[key] = group
            made.append(group)
        return made

    # ---- helpers ------------------------------------------------------------------------------------------
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

    def _bridge_all_reduce(self, host: torch.Tensor, group: dist.ProcessGroup | None) -> None:
        """All-reduce a host tensor over the bridge in chunks, each started before the previous one is waited on."""
        if group is None:
            return
        flat = host.view(-1)
        step = max(1, CHUNK_BYTES // max(1, flat.element_size()))
        works = [dist.all_reduce(flat[i : i + step], group=group, async_op=True) for i in range(0, flat.numel(), step)]
        for work in works:
            work.wait(self.timeout)

    # ---- collectives --------------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """Sum over the group, in place."""
        try:
            if group.single_island:
                if group.native is not None:
                    dist.all_reduce(tensor, group=group.native)
                return tensor
            island = self.islands[self.rank]
            members = group.islands[island]
            inside = group.inside.get(island)
            if group.equal_islands:
                size = len(members)
                flat = tensor.reshape(-1)
                padded = torch.zeros(-(-flat.numel() // size) * size, dtype=tensor.dtype, device=tensor.device)
                padded[: flat.numel()] = flat
                shard = torch.empty(padded.numel() // size, dtype=tensor.dtype, device=tensor.device)
                if inside is not None:
                    _reduce_scatter(shard, padded, group=inside)
                else:
                    shard.copy_(padded)
                host = self._staged(shard)
                self._bridge_all_reduce(host, group.across.get(members.index(self.rank)))
                shard.copy_(host)
                if inside is not None:
                    _all_gather(padded, shard, group=inside)
                else:
                    padded.copy_(shard)
                tensor.copy_(padded[: flat.numel()].view_as(tensor))
                return tensor
            leader = members[0]
            if inside is not None:
                dist.reduce(tensor, dst=leader, group=inside)
            if self.rank == leader:
                host = self._staged(tensor)
                self._bridge_all_reduce(host, group.leaders)
                tensor.copy_(host)
            if inside is not None:
                dist.broadcast(tensor, src=leader, group=inside)
            return tensor
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all_reduce", group, err) from None

    def bridged_all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """A flat all-reduce of the whole group through the bridge (no island hierarchy), in place: the baseline
        the hierarchical path is compared with."""
        try:
            host = self._staged(tensor)
            self._bridge_all_reduce(host, group.bridge if not group.single_island else group.native)
            tensor.copy_(host)
            return tensor
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("bridged all_reduce", group, err) from None

    def all_gather(self, tensor: torch.Tensor, group: CommGroup) -> list[torch.Tensor]:
        """Every member's tensor, in group order."""
        pg = group.native if group.single_island else group.bridge
        try:
            if pg is None:
                return [tensor.clone()]
            host = tensor if group.single_island else self._staged(tensor)
            out = [torch.empty_like(host) for _ in group.ranks]
            dist.all_gather(out, host, group=pg)
            return [t.to(tensor.device) for t in out]
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("all_gather", group, err) from None

    def reduce_scatter(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
        """This member's 1/n of the sum (tensor's first dimension divisible by the group size)."""
        n = len(group.ranks)
        if tensor.shape[0] % n:
            raise CommError(f"reduce_scatter needs the first dimension ({tensor.shape[0]}) divisible by {n}")
        summed = self.all_reduce(tensor.clone(), group) if not group.single_island else None
        try:
            if summed is not None:
                return summed.chunk(n)[group.ranks.index(self.rank)].clone()
            out = torch.empty_like(tensor.chunk(n)[0])
            if group.native is None:
                return tensor.clone()
            _reduce_scatter(out, tensor, group=group.native)
            return out
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("reduce_scatter", group, err) from None

    def broadcast(self, tensor: torch.Tensor, src: int, group: CommGroup) -> torch.Tensor:
        pg = group.native if group.single_island else group.bridge
        try:
            if pg is not None:
                host = tensor if group.single_island else self._staged(tensor)
                dist.broadcast(host, src=src, group=pg)
                tensor.copy_(host)
            return tensor
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("broadcast", group, err) from None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point-to-point over the bridge (the default group), staged through the host."""
        try:
            dist.send(self._staged(tensor), dst=dst)
        except (RuntimeError, dist.DistBackendError) as err:
            raise CommError(f"rank {self.rank}: send to {dst} failed: {str(err).splitlines()[0]}") from None

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        host = torch.empty_like(tensor, device="cpu")
        try:
            work = dist.irecv(host, src=src)
            if not work.wait(self.timeout):
                raise RuntimeError("timed out")
        except (RuntimeError, dist.DistBackendError) as err:
            raise CommError(
                f"rank {self.rank}: recv from {src} failed within the {self.timeout.total_seconds():g} s timeout: "
                f"{str(err).splitlines()[0]}"
            ) from None
        tensor.copy_(host)
        return tensor

    def barrier(self, group: CommGroup) -> None:
        pg = group.native if group.single_island else group.bridge
        try:
            if pg is not None:
                dist.barrier(group=pg)
        except (RuntimeError, dist.DistBackendError) as err:
            raise self._fail("barrier", group, err) from None
