"""The `hetplan` torch.distributed backend: one process group over ranks of several vendor islands.

`register_backend(islands)` tells torch.distributed about the backend; after that `dist.new_group(ranks,
backend="hetplan")` (or `init_process_group("hetplan", ...)`) returns a `HetplanProcessGroup`, so DDP, FSDP and
torch.distributed.pipelining use it unchanged. The group builds its own sub-backends from the group's store, among
the members only (no global `new_group` calls, so nothing has to be created on ranks outside the group):

  inside[island]  the island's native library over the island's members (Gloo when the islands are simulated);
  across[j]       the bridge over rank j of every island (equal islands: shards are all-reduced across them);
  leaders         the bridge over the first rank of every island (unequal islands);
  bridge          the bridge over the whole group (p2p, gathers, broadcasts, and the flat baseline path).

Collectives spanning islands run hierarchically (DESIGN.md): reduce-scatter inside each island, all-reduce of the
shards across islands, all-gather inside; unequal islands reduce to a leader, all-reduce among leaders, broadcast.
The bridge stages through host copies (device -> host -> Gloo over TCP -> host -> device) in chunks, each started
before the previous one is waited on. Every wait is bounded by the group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    ReduceOptions,
    ReduceScatterOptions,
    _create_work_from_future,
)

from comm.vendors import VENDORS
from specs.errors import HetplanError

BACKEND_NAME = "hetplan"
CHUNK_BYTES = 4 * 2**20
_SETTINGS: dict[str, Any] = {"islands": None, "simulated": True, "registered": False}


class CommError(HetplanError):
    """A collective failed or timed out (a peer died or hangs)."""


def register_backend(islands: Sequence[str], simulated: bool = True) -> None:
    """Register (once per process) the `hetplan` backend; `islands[r]` is global rank r's island (a vendor)."""
    unknown = sorted(set(islands) - set(VENDORS))
    if unknown:
        raise CommError(f"unknown island vendor(s) {unknown}; known: {', '.join(VENDORS)}")
    _SETTINGS["islands"] = list(islands)
    _SETTINGS["simulated"] = simulated
    if not _SETTINGS["registered"]:
        devices = sorted({"cpu"} | {VENDORS[name].device_type for name in VENDORS if VENDORS[name].device_type})
        dist.Backend.register_backend(BACKEND_NAME, _create_group, extended_api=True, devices=devices)
        _SETTINGS["registered"] = True


def _native_backend(store: dist.Store, rank: int, size: int, island: str, timeout: timedelta) -> dist.ProcessGroup:
    """The island's own library over `size` ranks of one island."""
    name = "gloo" if _SETTINGS["simulated"] else VENDORS[island].backend
    if name == "gloo":
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    if name == "nccl" and hasattr(dist, "ProcessGroupNCCL"):
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    raise CommError(
        f"the hetplan backend cannot build island {island!r}'s native library {name!r} from a store yet; "
        "create that island's groups with dist.new_group(backend=...) and use Communicator"
    )


def _create_group(options: Any, _pg_options: Any) -> HetplanProcessGroup:
    islands = _SETTINGS["islands"]
    if islands is None:
        raise CommError("the hetplan backend has no island map: call comm.backend.register_backend(islands) first")
    members = list(options.global_ranks_in_group) or list(range(options.group_size))
    return HetplanProcessGroup(
        options.store, options.group_rank, members, [islands[r] for r in members], options.timeout
    )


def _done(result: Any) -> dist.Work:
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class HetplanProcessGroup(dist.ProcessGroup):
    """A process group over `members` (global ranks); `member_islands[i]` is member i's island."""

    def __init__(
        self,
        store: dist.Store,
        group_rank: int,
        members: Sequence[int],
        member_islands: Sequence[str],
        timeout: timedelta,
    ) -> None:
        super().__init__(group_rank, len(members))
        self.group_rank = group_rank
        self.members = list(members)
        self.timeout = timeout
        self.islands: dict[str, list[int]] = {}  # island -> group ranks, in group order
        for index, island in enumerate(member_islands):
            self.islands.setdefault(island, []).append(index)
        self.island = member_islands[group_rank]
        self.island_ranks = self.islands[self.island]
        self.equal_islands = len({len(r) for r in self.islands.values()}) == 1
        self._group_name = ""
        self._group_desc = ""

        def sub(prefix: str, ranks: list[int], make: Callable[..., dist.ProcessGroup]) -> dist.ProcessGroup | None:
            if group_rank not in ranks or len(ranks) < 2:
                return None
            return make(dist.PrefixStore(prefix, store), ranks.index(group_rank), len(ranks))

        def gloo(s: dist.Store, r: int, n: int) -> dist.ProcessGroup:
            return dist.ProcessGroupGloo(s, r, n, timeout)

        def native(s: dist.Store, r: int, n: int) -> dist.ProcessGroup:
            return _native_backend(s, r, n, self.island, timeout)

        if len(self.islands) == 1:
            self.inside = sub(
                "native", self.island_ranks, lambda s, r, n: _native_backend(s, r, n, self.island, timeout)
            )
            self.bridge = self.inside
            self.across: dict[int, dist.ProcessGroup | None] = {}
            self.leaders = None
            return
        self.bridge = sub("bridge", list(range(len(members))), gloo)
        self.inside = sub(f"inside/{self.island}", self.island_ranks, native)
        self.across = {}
        self.leaders = None
        if self.equal_islands:
            j = self.island_ranks.index(group_rank)
            self.across[j] = sub(f"across/{j}", [ranks[j] for ranks in self.islands.values()], gloo)
        else:
            self.leaders = sub("leaders", [ranks[0] for ranks in self.islands.values()], gloo)

    # ---- c10d bookkeeping -----------------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _get_group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_name(self) -> str:
        return self._group_name

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def size(self) -> int:
        return len(self.members)

    def rank(self) -> int:
        return self.group_rank

    @property
    def single_island(self) -> bool:
        return len(self.islands) == 1

    def __repr__(self) -> str:
        return f"HetplanProcessGroup(ranks={self.members}, islands={ {k: len(v) for k, v in self.islands.items()} })"

    # ---- helpers ----------------------------------------------------------------------------------------------
    def _wait(self, work: dist.Work) -> None:
        if not work.wait(self.timeout):
            raise CommError(f"a collective over ranks {self.members} did not finish within {self.timeout}")

    def _staged(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy for the bridge (a separate buffer even on the CPU, as device memory would need)."""
        return tensor.detach().to("cpu", copy=True) if not self.single_island else tensor

    def _bridge_all_reduce(self, host: torch.Tensor, group: dist.ProcessGroup | None, op: dist.ReduceOp) -> None:
        """All-reduce a host tensor over a bridge group in chunks, each started before the previous is waited on."""
        if group is None:
            return
        flat = host.view(-1)
        step = max(1, CHUNK_BYTES // max(1, flat.element_size()))
        options = AllreduceOptions()
        options.reduceOp = op
        works = [group.allreduce([flat[i : i + step]], options) for i in range(0, flat.numel(), step)]
        for work in works:
            self._wait(work)

    def _reduce_in_place(self, tensor: torch.Tensor, op: dist.ReduceOp) -> None:
        if self.single_island:
            if self.inside is not None:
                options = AllreduceOptions()
                options.reduceOp = op
                self._wait(self.inside.allreduce([tensor], options))
            return
        if self.equal_islands and op == dist.ReduceOp.SUM:
            self._hierarchical_sum(tensor)
            return
        # leaders: reduce to the island's first rank, all-reduce among leaders, broadcast back
        leader = self.island_ranks[0]
        if self.inside is not None:
            reduce_options = ReduceOptions()
            reduce_options.reduceOp = op
            reduce_options.rootRank = 0
            self._wait(self.inside.reduce([tensor], reduce_options))
        if self.group_rank == leader:
            host = self._staged(tensor)
            self._bridge_all_reduce(host, self.leaders, op)
            tensor.copy_(host)
        if self.inside is not None:
            broadcast_options = BroadcastOptions()
            broadcast_options.rootRank = 0
            self._wait(self.inside.broadcast([tensor], broadcast_options))

    def _hierarchical_sum(self, tensor: torch.Tensor) -> None:
        """Reduce-scatter inside the island, all-reduce this rank's shard across islands, all-gather inside."""
        size = len(self.island_ranks)
        flat = tensor.reshape(-1)
        padded = torch.zeros(-(-flat.numel() // size) * size, dtype=tensor.dtype, device=tensor.device)
        padded[: flat.numel()] = flat
        shard = torch.empty(padded.numel() // size, dtype=tensor.dtype, device=tensor.device)
        if self.inside is not None:
            self._wait(self.inside._reduce_scatter_base(shard, padded, ReduceScatterOptions()))
        else:
            shard.copy_(padded)
        host = self._staged(shard)
        self._bridge_all_reduce(host, self.across.get(self.island_ranks.index(self.group_rank)), dist.ReduceOp.SUM)
        shard.copy_(host)
        if self.inside is not None:
            self._wait(self.inside._allgather_base(padded, shard, AllgatherOptions()))
        else:
            padded.copy_(shard)
        tensor.copy_(padded[: flat.numel()].view_as(tensor))

    # ---- collectives (c10d's Python ProcessGroup interface) --------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for tensor in tensors:
            self._reduce_in_place(tensor, op)
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def bridged_all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """A flat sum over the whole group through the bridge (no island hierarchy): the baseline path."""
        host = self._staged(tensor)
        self._bridge_all_reduce(host, self.bridge, dist.ReduceOp.SUM)
        tensor.copy_(host)
        return tensor

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        for tensor in tensors:
            if self.bridge is None:
                continue
            host = self._staged(tensor)
            options = BroadcastOptions()
            options.rootRank = opts.rootRank
            self._wait(self.bridge.broadcast([host], options))
            tensor.copy_(host)
        return _done(tensors)

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        for out_list, tensor in zip(outputs, inputs, strict=True):
            if self.bridge is None:
                out_list[0].copy_(tensor)
                continue
            host = self._staged(tensor)
            host_out = [torch.empty_like(host) for _ in out_list]
            self._wait(self.bridge.allgather([host_out], [host]))
            for target, got in zip(out_list, host_out, strict=True):
                target.copy_(got)
        return _done(outputs)

    def _allgather_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> dist.Work:
        return self.allgather([list(output.chunk(self.size()))], [tensor], opts)

    def all_gather_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any = None) -> dist.Work:
        return self._allgather_base(output, tensor, opts)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]], opts: Any) -> dist.Work:
        for output, pieces in zip(outputs, inputs, strict=True):
            summed = torch.cat([p.reshape(-1) for p in pieces])
            self._reduce_in_place(summed, opts.reduceOp)
            output.copy_(summed.chunk(self.size())[self.group_rank].view_as(output))
        return _done(outputs)

    def _reduce_scatter_base(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> dist.Work:
        return self.reduce_scatter([output], [list(tensor.chunk(self.size()))], opts)

    def reduce_scatter_single(self, output: torch.Tensor, tensor: torch.Tensor, opts: Any) -> dist.Work:
        return self._reduce_scatter_base(output, tensor, opts)

    def barrier(self, opts: Any = None) -> dist.Work:
        return self.allreduce([torch.zeros(1)])

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        if self.bridge is None:
            raise CommError(f"send inside a one-rank group {self.members}")
        (tensor,) = tensors
        payload = self._staged(tensor).contiguous()
        return StagedWork(self.bridge.send([payload], dst, tag), self.timeout, self.members)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        if self.bridge is None:
            raise CommError(f"recv inside a one-rank group {self.members}")
        (tensor,) = tensors
        if self.single_island:
            return StagedWork(self.bridge.recv([tensor], src, tag), self.timeout, self.members)
        host = torch.empty_like(tensor, device="cpu")
        return StagedWork(self.bridge.recv([host], src, tag), self.timeout, self.members, host, tensor)


class StagedWork(dist.Work):
    """An asynchronous bridge transfer; a receive copies the host buffer into the caller's tensor on `wait`
    (Gloo's point-to-point works have no future to chain the copy on)."""

    def __init__(
        self,
        work: dist.Work,
        timeout: timedelta,
        members: list[int],
        host: torch.Tensor | None = None,
        target: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.work, self.timeout, self.members = work, timeout, members
        self.host, self.target = host, target
        self.finished = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.finished:
            try:
                finished = self.work.wait(timeout or self.timeout)
            except (RuntimeError, dist.DistBackendError) as err:
                text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CommError(f"a transfer between ranks {self.members} failed: {text}") from None
            if not finished:
                raise CommError(f"a transfer between ranks {self.members} did not finish within {self.timeout}")
            if self.target is not None and self.host is not None:
                self.target.copy_(self.host)
            self.finished = True
        return True

    def is_completed(self) -> bool:
        return self.finished
