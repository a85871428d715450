"""Context parallelism in the runtime: a replica's sequences split over the `cp` ranks of a ring, ring attention.

Causal load balancing (Megatron's layout): the sequence is cut into 2*cp equal chunks and CP rank c holds chunks c and
2cp-1-c, so every rank has the same share of the causal attention's work. The embedding, the rotary tables (or the
learned positions) and the targets use the global positions of those chunks (`ContextParallel.positions`).

Ring attention (`ring_attention`): each rank's queries meet the K/V blocks of every rank of the ring as the blocks
travel around it (cp - 1 exchanges forward, each overlapped with the attention of the block already held), and the
partial results are merged by their log-sum-exp (online softmax). With the load-balanced layout every block is one of
three kinds: the rank's own (causal), an earlier rank's (all queries against its first chunk) or a later rank's (the
second chunk's queries against all of it); nothing else is computed. Each block runs torch's CPU flash-attention
kernel (SDPA's). The backward is flash attention's, block by block, recomputing the probabilities from the merged
output and log-sum-exp; K/V travel the ring again with their gradients beside them, and after the last step one more
exchange brings every rank's K/V gradients home: what the cost model counts (predictor/context_parallel.py). It saves
the rank's own q, K, V, output and log-sum-exp only (autograd through the exchanges would keep every rank's K/V).
Grouped-query attention keeps K/V at their own head count on the wire (repeated per query head only for the kernel).
With TP the ring runs per TP rank over that rank's heads (comm.plan_groups' CP groups).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from comm.backend import CommError
from profiler.layers import DecoderLayer
from specs.model import ModelSpec, Recompute
from specs.training import splits_for_context_parallel


def chunk_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions of the tokens CP rank `cp_rank` holds: chunks cp_rank and 2cp-1-cp_rank of 2*cp (the
    whole sequence without context parallelism)."""
    if cp == 1:
        return torch.arange(seq_length)
    if not splits_for_context_parallel(seq_length, cp):
        raise ValueError(f"a sequence of {seq_length} tokens does not cut into 2 x {cp} equal chunks")
    chunk = seq_length // (2 * cp)
    first, second = cp_rank * chunk, (2 * cp - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


class ContextParallel:
    """One rank's CP ring: `size` ranks, this one is `rank` (its index in the ring); `group` None for CP 1.
    `positions` are the global positions of its tokens in a sequence of `seq_length`."""

    def __init__(
        self, group: dist.ProcessGroup | None, size: int, rank: int, seq_length: int, timeout_s: float = 120.0
    ) -> None:
        self.group, self.size, self.rank = group, size, rank
        self.positions = chunk_positions(seq_length, size, rank)
        self.timeout = timedelta(seconds=timeout_s)
        self.suppressed = False  # speed emulation repeats layer math without the ring
        self.comm_s = 0.0  # time spent waiting for ring exchanges

    @property
    def enabled(self) -> bool:
        return self.size > 1 and not self.suppressed

    @contextmanager
    def suppress(self) -> Iterator[None]:
        self.suppressed = True
        try:
            yield
        finally:
            self.suppressed = False

    def local_tokens(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's tokens of a batch of sequences of seq_length + 1 tokens."""
        return batch[:, :-1][:, self.positions], batch[:, 1:][:, self.positions]

    def start_exchange(self, tensor: torch.Tensor) -> RingExchange:
        """Send `tensor` to the next rank of the ring and receive the previous rank's (same shape) in the
        background."""
        return RingExchange(self, tensor)


class RingExchange:
    """One step of the ring in flight: the send to the next rank and the receive from the previous one."""

    def __init__(self, cp: ContextParallel, tensor: torch.Tensor) -> None:
        self.cp = cp
        self.sent = tensor.contiguous()
        self.received = torch.empty_like(self.sent)
        following = dist.get_global_rank(cp.group, (cp.rank + 1) % cp.size)
        previous = dist.get_global_rank(cp.group, (cp.rank - 1) % cp.size)
        self.works = [
            dist.isend(self.sent, dst=following, group=cp.group),
            dist.irecv(self.received, src=previous, group=cp.group),
        ]

    def wait(self) -> torch.Tensor:
        started = time.perf_counter()
        for work in self.works:
            try:
                finished = work.wait(self.cp.timeout)
            except (RuntimeError, dist.DistBackendError) as err:
                text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CommError(f"CP rank {self.cp.rank}: a ring exchange failed: {text}") from None
            if not finished:
                raise CommError(f"CP rank {self.cp.rank}: a ring exchange did not finish within {self.cp.timeout}")
        self.cp.comm_s += time.perf_counter() - started
        return self.received


def _block(rank: int, source: int, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of the attention of rank `rank`'s queries against rank `source`'s K/V block,
    both of `length` tokens laid out as two chunks (see the module text)."""
    if source == rank:
        return slice(None), slice(None), True
    half = length // 2
    if source < rank:  # both of its chunks come before my second; its first before my first, its second after
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False  # a later rank: only my second chunk sees it, all of it


# torch's CPU flash-attention kernels (what scaled_dot_product_attention runs on the CPU): the forward also returns
# the log-sum-exp of each query's scores, and the backward takes the output and log-sum-exp to recompute the
# probabilities from, so given the merged ones it yields one block's share of the gradients (ring flash attention)
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def _heads(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V (b, kv heads, s, d) repeated for every query head of its group, as SDPA's enable_gqa does."""
    return kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _kv_heads(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """A gradient per query head (b, heads, s, d) summed over each kv head's group."""
    b, heads, s, d = grad.shape
    return grad.view(b, kv_heads, heads // kv_heads, s, d).sum(2)


class _RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence of the ring; q (b, heads, s/cp, d), k and v (b, kv heads, s/cp, d)
    in the load-balanced chunk order."""

    @staticmethod
    def forward(ctx, q, k, v, cp):  # type: ignore[no-untyped-def, override]
        heads, length = q.shape[1], q.shape[2]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32 if q.dtype != torch.float64 else q.dtype)
        held = torch.stack([k, v])
        for step in range(cp.size):
            exchange = cp.start_exchange(held) if step < cp.size - 1 else None
            rows, cols, causal = _block(cp.rank, (cp.rank - step) % cp.size, length)
            key, value = (_heads(t[:, :, cols], heads) for t in held)
            block_out, block_lse = _FLASH(q[:, :, rows], key, value, 0.0, causal)
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            kept, added = torch.exp(lse[:, :, rows] - merged), torch.exp(block_lse - merged)
            out[:, :, rows] = out[:, :, rows] * kept.unsqueeze(-1) + block_out * added.unsqueeze(-1)
            lse[:, :, rows] = merged
            if exchange is not None:
                held = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def, override]
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        heads, kv_heads, length = q.shape[1], k.shape[1], q.shape[2]
        grad_out = grad_out.contiguous()
        grad_q = torch.zeros_like(q)
        held = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V and their gradients so far
        for step in range(cp.size):
            rows, cols, causal = _block(cp.rank, (cp.rank - step) % cp.size, length)
            key, value = (_heads(t[:, :, cols], heads) for t in held[:2])
            block_grads = _FLASH_BACKWARD(
                grad_out[:, :, rows], q[:, :, rows], key, value, out[:, :, rows], lse[:, :, rows], 0.0, causal
            )
            grad_q[:, :, rows] += block_grads[0]
            held[2][:, :, cols] += _kv_heads(block_grads[1], kv_heads)
            held[3][:, :, cols] += _kv_heads(block_grads[2], kv_heads)
            if step < cp.size - 1:
                held = cp.start_exchange(held).wait()
        grads = held[2:] if cp.size == 1 else cp.start_exchange(held[2:]).wait()  # the last block's owner is next
        return grad_q, grads[0], grads[1], None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: ContextParallel) -> torch.Tensor:
    """Causal attention of this rank's queries over the sequence held by the whole ring, in SDPA's layout: q (b,
    heads, s/cp, d), k and v (b, kv heads, s/cp, d) in the load-balanced chunk order; returns (b, heads, s/cp, d).
    Suppressed (speed emulation), the rank's own tokens only."""
    if not cp.enabled:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cp)


class RingAttentionLayer(DecoderLayer):
    """A decoder layer shard whose tokens are one CP rank's: rotary tables at their global positions, attention
    around the ring."""

    def __init__(self, model: ModelSpec, tp: int, recompute: Recompute, cp: ContextParallel) -> None:
        super().__init__(model, tp, recompute)
        self.cp = cp
        self.register_buffer("rotary", self.rotary[:, cp.positions].contiguous(), persistent=False)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = ring_attention(q, k, v, self.cp)
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)
