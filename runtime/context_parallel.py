"""Context parallelism in the runtime: a replica's sequences split over the `cp` ranks of a ring, ring attention.

Causal load balancing (Megatron's layout): the sequence is cut into 2*cp equal chunks and CP rank c holds chunks c and
2cp-1-c, so every rank has the same share of the causal attention's work. The embedding, the rotary tables (or the
learned positions) and the targets use the global positions of those chunks (`ContextParallel.positions`).

Ring attention (`ring_attention`): each rank's queries meet the K/V blocks of every rank of the ring as the blocks
travel around it (cp - 1 exchanges forward, each overlapped with the attention of the block already held), and the
partial results are merged by their log-sum-exp (online softmax). With the load-balanced layout every block is one of
three kinds: the rank's own (causal), an earlier rank's (all queries against its first chunk) or a later rank's (the
second chunk's queries against all of it); nothing else is computed. The backward is flash attention's, block by
block, recomputing the probabilities from the saved log-sum-exp; K/V travel the ring again with their gradients
beside them, and after the last step one more exchange brings every rank's K/V gradients home: what the cost model
counts (predictor/context_parallel.py). Grouped-query attention keeps K/V at their own head count on the wire.
With TP the ring runs per TP rank over that rank's heads (comm.plan_groups' CP groups).
"""

from __future__ import annotations

import math
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


def chunk_positions(seq_length: int, cp: int, cp_rank: int) -> torch.Tensor:
    """The global positions of the tokens CP rank `cp_rank` holds: chunks cp_rank and 2cp-1-cp_rank of 2*cp (the
    whole sequence without context parallelism)."""
    if cp == 1:
        return torch.arange(seq_length)
    if seq_length % (2 * cp):
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
        following, previous = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
        self.works = [
            dist.isend(self.sent, group=cp.group, group_dst=following),
            dist.irecv(self.received, group=cp.group, group_src=previous),
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


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """Attention scores of q (b, groups, heads per group, sq, d) against k (b, groups, 1, sk, d), causally masked
    (position i sees keys 0..i, as both are in global order) when asked."""
    scores = q @ k.transpose(-1, -2) * scale
    if causal:
        seen = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores


class _RingAttention(torch.autograd.Function):
    """Causal attention over the whole sequence of the ring; q (b, groups, heads per group, s/cp, d), k and v
    (b, groups, 1, s/cp, d), in a dtype softmax statistics are exact enough in (fp32 or fp64)."""

    @staticmethod
    def forward(ctx, q, k, v, cp):  # type: ignore[no-untyped-def, override]
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[-2]
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)
        held = torch.stack([k, v])
        for step in range(cp.size):
            exchange = cp.start_exchange(held) if step < cp.size - 1 else None
            rows, cols, causal = _block(cp.rank, (cp.rank - step) % cp.size, length)
            scores = _scores(q[..., rows, :], held[0][..., cols, :], causal, scale)
            block_lse = scores.logsumexp(-1)
            block_out = torch.exp(scores - block_lse.unsqueeze(-1)) @ held[1][..., cols, :]
            merged = torch.logaddexp(lse[..., rows], block_lse)
            kept, added = torch.exp(lse[..., rows] - merged), torch.exp(block_lse - merged)
            out[..., rows, :] = out[..., rows, :] * kept.unsqueeze(-1) + block_out * added.unsqueeze(-1)
            lse[..., rows] = merged
            if exchange is not None:
                held = exchange.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp = cp
        return out

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def, override]
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        scale = 1.0 / math.sqrt(q.shape[-1])
        length = q.shape[-2]
        delta = (grad_out * out).sum(-1)  # rowsum(dO * O): softmax's backward term
        grad_q = torch.zeros_like(q)
        held = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # K, V and their gradients so far
        for step in range(cp.size):
            rows, cols, causal = _block(cp.rank, (cp.rank - step) % cp.size, length)
            q_rows, grad_rows = q[..., rows, :], grad_out[..., rows, :]
            key, value = held[0][..., cols, :], held[1][..., cols, :]
            probs = torch.exp(_scores(q_rows, key, causal, scale) - lse[..., rows].unsqueeze(-1))
            held[3][..., cols, :] += (probs.transpose(-1, -2) @ grad_rows).sum(2, keepdim=True)
            grad_scores = probs * (grad_rows @ value.transpose(-1, -2) - delta[..., rows].unsqueeze(-1)) * scale
            grad_q[..., rows, :] += grad_scores @ key
            held[2][..., cols, :] += (grad_scores.transpose(-1, -2) @ q_rows).sum(2, keepdim=True)
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
    b, heads, length, d = q.shape
    groups = k.shape[1]
    exact = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    grouped_q = q.reshape(b, groups, heads // groups, length, d).to(exact)
    out = _RingAttention.apply(grouped_q, k.unsqueeze(2).to(exact), v.unsqueeze(2).to(exact), cp)
    return out.reshape(b, heads, length, d).to(q.dtype)


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
