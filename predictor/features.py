"""Physical features of one layer pass: the work a learned model turns into seconds and bytes.

A layer's forward or backward pass is described by what any accelerator has to do for it: GEMM FLOPs, attention
FLOPs (a causal flash kernel computes half of 4*b*s^2*q, q = heads x head size), bytes its memory-bound ops move,
and the kernels it launches (its layer kind, pass and recompute mode). Backward does twice the GEMM work, ~2.5x the
attention work (flash backward recomputes the scores) and re-runs the forward work that recompute dropped (DESIGN.md).
These depend only on shapes, so a model fitted on one model's profile predicts another model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from profiler.profile import LayerKind
from specs.model import ModelSpec, Recompute
from specs.training import DTYPE_BYTES

Pass = Literal["forward", "backward"]
PASSES: tuple[Pass, ...] = ("forward", "backward")
ATTENTION_BACKWARD_RATIO = 2.5
GRAD_BYTES = 4  # fp32 gradient of the embedding table

# One launch-overhead column per (layer, pass, recompute): their kernel counts differ and are not shape-dependent.
KERNEL_GROUPS: tuple[tuple[str, Pass, str], ...] = tuple(
    (layer, pass_, mode)
    for layer, modes in (("decoder", ("none", "selective", "full")), ("embedding", ("none",)), ("lm_head", ("none",)))
    for mode in modes
    for pass_ in PASSES
)
WORK_COLUMNS = ("gemm_flops", "attention_flops", "memory_bytes", "memory_bytes_sp")


@dataclass(frozen=True)
class LayerPoint:
    """One layer (TP shard) of one model at one micro-batch size, TP degree and recompute mode."""

    model: ModelSpec
    seq_length: int
    dtype: str
    layer: LayerKind
    micro_batch_size: int
    tp: int
    recompute: Recompute

    @property
    def tokens(self) -> int:
        return self.micro_batch_size * self.seq_length

    @property
    def mode(self) -> Recompute:
        """Recompute applies to decoder layers only."""
        return self.recompute if self.layer == "decoder" else "none"


@dataclass(frozen=True)
class PassWork:
    """Work of one pass. Memory-bound bytes come twice: as if norms and residuals run on every TP rank
    (`memory_bytes`) and as if sequence parallelism splits them (`memory_bytes_sp`); the fit picks whichever
    the measured implementation does."""

    gemm_flops: float
    attention_flops: float
    memory_bytes: float
    memory_bytes_sp: float

    def scaled(self, gemm: float, attention: float, memory: float) -> PassWork:
        return PassWork(
            self.gemm_flops * gemm,
            self.attention_flops * attention,
            self.memory_bytes * memory,
            self.memory_bytes_sp * memory,
        )

    def plus(self, other: PassWork) -> PassWork:
        return PassWork(
            self.gemm_flops + other.gemm_flops,
            self.attention_flops + other.attention_flops,
            self.memory_bytes + other.memory_bytes,
            self.memory_bytes_sp + other.memory_bytes_sp,
        )


def pass_work(point: LayerPoint, pass_: Pass) -> PassWork:
    """FLOPs and memory-bound bytes of one pass of one layer shard."""
    model, tp, tokens = point.model, point.tp, point.tokens
    width = DTYPE_BYTES[point.dtype]
    if point.layer == "decoder":
        forward = PassWork(
            model.layer_gemm_flops(tokens) / tp,
            model.layer_attention_flops(point.micro_batch_size, point.seq_length, causal_kernel=True) / tp,
            2.0 * width * model.layer_elementwise_elements(tokens, tp, sequence_parallel=False),
            2.0 * width * model.layer_elementwise_elements(tokens, tp, sequence_parallel=True),
        )
        if pass_ == "forward":
            return forward
        backward = forward.scaled(2.0, ATTENTION_BACKWARD_RATIO, 2.0)
        if point.mode == "full":
            return backward.plus(forward)
        if point.mode == "selective":
            return backward.plus(forward.scaled(0.0, 1.0, 1.0))
        return backward
    h, vocab = model.hidden_size, model.vocab_size
    if point.layer == "embedding":
        gather = 2.0 * width * tokens * h
        bytes_ = gather if pass_ == "forward" else 2 * gather + 2.0 * GRAD_BYTES * vocab * h / tp  # dense table grad
        return PassWork(0.0, 0.0, bytes_, bytes_)
    gemm = model.lm_head_flops(tokens) / tp
    loss_bytes = 2.0 * width * (3 * tokens * vocab / tp + tokens * h)
    return PassWork(gemm if pass_ == "forward" else 2 * gemm, 0.0, loss_bytes, loss_bytes)


def work_matrix(points: list[LayerPoint], passes: list[Pass]) -> np.ndarray:
    """Rows: points; columns: GEMM FLOPs, attention FLOPs, memory bytes, then one kernel-group indicator each."""
    rows = np.zeros((len(points), len(WORK_COLUMNS) + len(KERNEL_GROUPS)))
    for row, (point, pass_) in enumerate(zip(points, passes, strict=True)):
        work = pass_work(point, pass_)
        rows[row, :4] = (work.gemm_flops, work.attention_flops, work.memory_bytes, work.memory_bytes_sp)
        rows[row, 4 + KERNEL_GROUPS.index((point.layer, pass_, point.mode))] = 1.0
    return rows


def shape_features(points: list[LayerPoint], passes: list[Pass]) -> np.ndarray:
    """Scale-free descriptors for the learned efficiency: log work, arithmetic intensity, per-shard widths,
    micro-batch, TP, and codes for the layer, pass and recompute mode."""
    rows = []
    for point, pass_ in zip(points, passes, strict=True):
        work = pass_work(point, pass_)
        flops = work.gemm_flops + work.attention_flops
        model = point.model
        rows.append(
            (
                np.log10(flops + 1.0),
                np.log10(work.memory_bytes + 1.0),
                np.log10((flops + 1.0) / (work.memory_bytes + 1.0)),
                np.log10(point.tokens),
                np.log10(model.hidden_size / point.tp),
                np.log10(model.ffn_hidden_size / point.tp),
                float(point.micro_batch_size),
                float(point.tp),
                float(("decoder", "embedding", "lm_head").index(point.layer)),
                float(PASSES.index(pass_)),
                float(("none", "selective", "full").index(point.mode)),
            )
        )
    return np.asarray(rows)


def activation_features(point: LayerPoint) -> np.ndarray:
    """Candidate terms of the bytes a layer keeps for backward; a positive linear fit picks the ones the
    implementation has (e.g. whether norms' inputs are split by TP, i.e. sequence parallelism)."""
    model, tp, tokens = point.model, point.tp, point.tokens
    width = DTYPE_BYTES[point.dtype]
    h = model.hidden_size
    if point.layer == "decoder":
        replicated, sharded = model.layer_activation_elements_per_token(point.mode)
        statistics = 4.0 * tokens * model.num_attention_heads / tp if point.mode == "none" else 0.0
        return np.array(
            [width * tokens * replicated, width * tokens * replicated / tp, width * tokens * sharded / tp, statistics]
        )
    if point.layer == "embedding":
        return np.array([width * tokens * h, width * tokens * h / tp, 0.0, 0.0])
    logits = tokens * model.vocab_size / tp
    return np.array([logits * (width + 4), width * tokens * h, 0.0, 0.0])
