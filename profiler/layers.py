"""The torch layers hetplan profiles and (later) runs: one definition for both.

Built from a ModelSpec: a Llama-style decoder layer (RMSNorm, grouped-query attention with RoPE through
`scaled_dot_product_attention`, SwiGLU MLP) or a GPT-style one (LayerNorm, multi-head attention, GELU MLP), the
embedding and the LM head with its loss. `tp` builds the shard one tensor-parallel rank computes (heads/t, ffn/t,
vocab/t) so a single device can time a TP-t layer; the collectives are modelled separately. Megatron's TP boundaries
(f and g, over any group with an `all_reduce`) are here too: the runtime's ranks and the profiler's timing of TP
collectives between layers (profiler/host.py) use the same ones.

Recompute modes (what is saved for backward; see ModelSpec.layer_activation_elements_per_token):
  none       plain autograd;
  selective  keep the layer input, Q/K/V, the post-attention residual and the MLP up-projection output; norms,
             core attention and the MLP activation are recomputed inside the next GEMM's backward
             (`recomputed_linear`);
  full       keep only the layer input (reentrant checkpoint, so saved-tensor hooks see what it keeps).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("profiling and running layers") from err

from specs.model import ModelSpec, Recompute


class _RecomputedLinear(torch.autograd.Function):
    """y = fn(*inputs) @ W^T + b, saving only `inputs`: fn is re-run in backward to get the GEMM input."""

    @staticmethod
    def forward(ctx, fn, weight, bias, *inputs):  # type: ignore[no-untyped-def, override]
        ctx.fn = fn
        ctx.has_bias = bias is not None
        ctx.save_for_backward(weight, *inputs)
        with torch.no_grad():
            return F.linear(fn(*inputs), weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def, override]
        weight, *inputs = ctx.saved_tensors
        detached = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        with torch.enable_grad():
            gemm_input = ctx.fn(*detached)
        grad_input = grad_out @ weight
        grad_weight = grad_out.reshape(-1, grad_out.shape[-1]).t() @ gemm_input.reshape(-1, gemm_input.shape[-1])
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.has_bias else None
        torch.autograd.backward(gemm_input, grad_input)
        return (None, grad_weight.to(weight.dtype), grad_bias, *[x.grad for x in detached])


def recomputed_linear(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor, ...], linear: nn.Linear
) -> torch.Tensor:
    return _RecomputedLinear.apply(fn, linear.weight, linear.bias, *inputs)


def rotary_tables(seq_length: int, head_dim: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin for RoPE (theta 10000), stacked: (2, s, d/2)."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_length, device=device, dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()]).to(dtype)


def apply_rotary(x: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (first half, second half) of the last dimension; `tables` broadcast against x."""
    cos, sin = tables[0], tables[1]
    first, second = x.chunk(2, dim=-1)
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def no_boundary(x: torch.Tensor) -> torch.Tensor:
    """A TP boundary of one shard timed alone (or TP 1): identity both ways."""
    return x


class AllReduces(Protocol):
    """A TP group's all-reduce (the runtime's process group, or the profiler's timed one)."""

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...


class VocabGroup(AllReduces, Protocol):
    """A TP group the vocabulary is split over: its sum all-reduce and its max all-reduce (both in place)."""

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor: ...


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over tokens whose logits are split by vocabulary across a TP group, Megatron's way: the
    logits' max, the sum of the shifted exponentials and the target's logit, each all-reduced over `group` (None:
    the shard is timed alone). The runtime's head and the profile's LMHead both compute it, so the profile times the
    arithmetic the ranks run: on the runtime bench's models torch's fused F.cross_entropy read 13-30% faster forward
    and 1-20% slower backward for the same loss."""

    @staticmethod
    def forward(ctx, logits, targets, start: int, group: VocabGroup | None):  # type: ignore[no-untyped-def, override]
        logits = logits if logits.dtype == torch.float64 else logits.float()
        top = logits.max(dim=-1).values
        if group is not None:
            group.all_reduce_max(top)
        shifted = logits - top.unsqueeze(-1)
        exp = shifted.exp()
        total = exp.sum(dim=-1)
        if group is not None:
            total = group.all_reduce(total)
        local = targets - start
        inside = (local >= 0) & (local < logits.shape[-1])
        index = local.clamp(0, logits.shape[-1] - 1)
        target_logit = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1) * inside
        if group is not None:
            group.all_reduce(target_logit)
        ctx.save_for_backward(exp, total, index, inside)
        return (total.log() - target_logit).mean()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        exp, total, index, inside = ctx.saved_tensors
        softmax = exp / total.unsqueeze(-1)
        softmax.scatter_add_(-1, index.unsqueeze(-1), -inside.to(softmax.dtype).unsqueeze(-1))
        return softmax * (grad / exp.shape[0]), None, None, None


class EnterTensorParallel(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the input gradient backward (a replicated activation meets a
    column-parallel GEMM)."""

    @staticmethod
    def forward(ctx, x, group: AllReduces):  # type: ignore[no-untyped-def, override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return ctx.group.all_reduce(grad.clone()), None


class LeaveTensorParallel(torch.autograd.Function):
    """Megatron's g: all-reduce of a row-parallel GEMM's partial output forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group: AllReduces):  # type: ignore[no-untyped-def, override]
        return group.all_reduce(x.clone())

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def, override]
        return grad, None


ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


def adamw_update(
    weights: torch.Tensor,
    grads: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    learning_rate: float,
    weight_decay: float,
) -> None:
    """One AdamW update (torch's, decoupled weight decay) of flat `weights` in place from `grads`, `step` counting
    from 1: the runtime's optimizer step, and what the profile times of it (profiler/host.py optimizer_costs)."""
    beta1, beta2 = ADAM_BETAS
    with torch.no_grad():
        weights.mul_(1 - learning_rate * weight_decay)
        exp_avg.lerp_(grads, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grads, grads, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**step)).add_(ADAM_EPS)
        weights.addcdiv_(exp_avg, denom, value=-learning_rate / (1 - beta1**step))


class DecoderLayer(nn.Module):
    """One transformer layer shard for TP rank 0 of `tp`."""

    def __init__(self, model: ModelSpec, tp: int = 1, recompute: Recompute = "none") -> None:
        super().__init__()
        if not model.splits_for_tp(tp):
            raise ValueError(f"tp {tp} must divide kv heads {model.num_kv_heads} and ffn {model.ffn_hidden_size}")
        self.llama = model.mlp == "swiglu"
        self.recompute = recompute
        h, d = model.hidden_size, model.head_size
        self.heads = model.num_attention_heads // tp
        self.kv_heads = model.num_kv_heads // tp
        self.head_dim = d
        self.ffn = model.ffn_hidden_size // tp
        bias = not self.llama
        norm = (lambda: nn.RMSNorm(h, eps=1e-5)) if self.llama else (lambda: nn.LayerNorm(h, eps=1e-5))
        self.attention_norm = norm()
        self.mlp_norm = norm()
        self.qkv = nn.Linear(h, (self.heads + 2 * self.kv_heads) * d, bias=bias)
        self.out = nn.Linear(self.heads * d, h, bias=bias)
        self.up = nn.Linear(h, (2 if self.llama else 1) * self.ffn, bias=bias)
        self.down = nn.Linear(self.ffn, h, bias=bias)
        self.register_buffer(
            "rotary", rotary_tables(model.seq_length, d, torch.device("cpu"), torch.float32), persistent=False
        )
        # tensor-parallel boundaries (identity when profiling one shard; the runtime sets Megatron's f and g:
        # enter = identity forward / all-reduce backward, leave = all-reduce forward / identity backward)
        self.enter_tp: Callable[[torch.Tensor], torch.Tensor] = no_boundary
        self.leave_tp: Callable[[torch.Tensor], torch.Tensor] = no_boundary

    # pieces, each a function of tensors so they can be recomputed
    def _split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, s, _ = qkv.shape
        d = self.head_dim
        q, k, v = qkv.split([self.heads * d, self.kv_heads * d, self.kv_heads * d], dim=-1)
        q, k, v = (t.view(b, s, -1, d) for t in (q, k, v))
        if self.llama:
            # RoPE in (b, s, heads, d) layout: attention then returns its output in that layout too, so the output
            # projection reads it without a copy. V is copied out so the QKV output itself is not kept alive.
            tables = self.rotary[:, :s, None, :].to(q.dtype)
            q, k, v = apply_rotary(q, tables), apply_rotary(k, tables), v.contiguous()
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

    def _core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads)
        b, _, s, _ = out.shape
        return out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim)

    def _activation(self, up: torch.Tensor) -> torch.Tensor:
        if self.llama:
            gate, value = up.chunk(2, dim=-1)
            return F.silu(gate) * value
        return F.gelu(up, approximate="tanh")

    def _attention_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter_tp(self.attention_norm(x))

    def _mlp_input(self, x: torch.Tensor) -> torch.Tensor:
        return self.enter_tp(self.mlp_norm(x))

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._split_heads(self.qkv(self._attention_input(x)))
        x = x + self.leave_tp(self.out(self._core_attention(q, k, v)))
        return x + self.leave_tp(self.down(self._activation(self.up(self._mlp_input(x)))))

    def _forward_selective(self, x: torch.Tensor) -> torch.Tensor:
        qkv = recomputed_linear(self._attention_input, (x,), self.qkv)
        q, k, v = self._split_heads(qkv)
        x = x + self.leave_tp(recomputed_linear(self._core_attention, (q, k, v), self.out))
        up = recomputed_linear(self._mlp_input, (x,), self.up)
        return x + self.leave_tp(recomputed_linear(self._activation, (up,), self.down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._forward, x, use_reentrant=True)
        if self.recompute == "selective" and torch.is_grad_enabled():
            return self._forward_selective(x)
        return self._forward(x)


class Embedding(nn.Module):
    """Vocabulary-parallel token embedding shard (+ learned positions for GPT-style models)."""

    def __init__(self, model: ModelSpec, tp: int = 1) -> None:
        super().__init__()
        self.tokens = nn.Embedding(math.ceil(model.vocab_size / tp), model.hidden_size)
        self.positions = nn.Embedding(model.seq_length, model.hidden_size) if model.mlp == "gelu" else None

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        local = token_ids % self.tokens.num_embeddings
        x = self.tokens(local)
        if self.positions is not None:
            x = x + self.positions(torch.arange(token_ids.shape[1], device=token_ids.device))
        return x


class LMHead(nn.Module):
    """Final norm, vocabulary-parallel output projection and cross-entropy over the local vocabulary shard."""

    def __init__(self, model: ModelSpec, tp: int = 1) -> None:
        super().__init__()
        h = model.hidden_size
        self.norm = nn.RMSNorm(h, eps=1e-5) if model.mlp == "swiglu" else nn.LayerNorm(h, eps=1e-5)
        self.output = nn.Linear(h, math.ceil(model.vocab_size / tp), bias=False)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.output(self.norm(x))
        local = targets % self.output.out_features
        return VocabParallelCrossEntropy.apply(logits.view(-1, logits.shape[-1]), local.view(-1), 0, None)
