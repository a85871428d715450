"""Simulated device profiles: a roofline of each layer's kernels with a realistic efficiency curve.

A kernel takes max(FLOPs / achieved FLOP/s, bytes / HBM bandwidth) plus a launch overhead. Achieved FLOP/s of a
GEMM is the device's large-GEMM efficiency times two fall-offs, each per device (specs/catalog/devices.yaml): with
its work, F / (F + peak * gemm_ramp_us) (small GEMMs are launch- and wave-bound), and with its thinnest dimension,
d / (d + gemm_tile) (thin GEMMs, e.g. at large TP, waste the matrix units' tiles; the tiles are larger on AMD, Ascend
and Gaudi than on NVIDIA). fp8 (Transformer Engine): GEMMs at the FP8 peak on 1-byte operands, each GEMM input cast
(amax + scale: one more elementwise pass), attention and everything else in bf16. Otherwise the peak is the training
dtype's: 16-bit tensor peak, or for fp32 the TF32/XF32 peak when
the training allows it (`fp32_matmul: tf32`), else IEEE fp32. Every non-matmul op runs at HBM bandwidth. Attention
runs a causal flash kernel (half of the 4*b*s^2*h model FLOPs) at a lower efficiency. These numbers only stand in
until a device is profiled; the planner reads them through the same interface.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from profiler.profile import DeviceProfile, LayerCost, LayerKind, ProfileEntry
from specs.device import DeviceSpec
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute
from specs.training import DTYPE_BYTES

ATTENTION_EFFICIENCY = 0.7  # flash attention vs large GEMMs on the same device
# Materialized attention (Korthikanti et al. 2022): per score element the forward writes the scores (2 B), reads and
# writes the softmax (4 B) and writes the dropout mask and output (3 B); it keeps 5 B per element for backward.
SCORE_BYTES_FORWARD = 9.0
SCORE_BYTES_SAVED = 5.0
ATTENTION_BACKWARD_RATIO = 2.5  # flash backward recomputes the scores: ~2.5x forward FLOPs
KERNEL_LAUNCH_S = 5e-6
FORWARD_KERNELS_PER_LAYER = 16
ELEMENTWISE_BW_EFFICIENCY = 0.8


def analytic_activation_bytes(
    model: ModelSpec,
    seq_length: int,
    dtype: str,
    layer: LayerKind,
    micro_batch_size: int,
    tp: int,
    recompute: Recompute,
    sequence_parallel: bool = True,
    flash_attention: bool = True,
) -> float:
    """Bytes one layer (TP shard) keeps for backward per micro-batch, from the model's shapes (no measurement).

    Decoder: the saved tensors of `ModelSpec.layer_activation_elements_per_token`, plus flash attention's fp32
    log-sum-exp when attention is not recomputed. Embedding: its output. LM head: bf16 and fp32 logits and the
    final norm's input."""
    tokens = micro_batch_size * seq_length
    width = DTYPE_BYTES[dtype]
    sp_tp = tp if sequence_parallel else 1
    if layer == "decoder":
        replicated, sharded = model.layer_activation_elements_per_token(recompute)
        activation = width * tokens * (replicated / sp_tp + sharded / tp)
        if recompute == "none":  # selective and full recompute the attention and drop its scores or statistics
            if flash_attention:  # fp32 log-sum-exp per head and token
                activation += 4.0 * tokens * model.num_attention_heads / tp
            else:  # Korthikanti et al.'s 5as/h term
                activation += SCORE_BYTES_SAVED * tokens * seq_length * model.num_attention_heads / tp
        return activation
    if layer == "embedding":
        return width * tokens * model.hidden_size / sp_tp
    logits = tokens * model.vocab_size / tp * (width + 4)
    return logits + width * tokens * model.hidden_size


@dataclass(frozen=True)
class SimulatedDevice:
    """Layer costs of one device type for one model, from its datasheet (no hardware needed)."""

    device: DeviceSpec
    model: ModelSpec
    seq_length: int
    dtype: str = "bf16"
    noise: float = 0.0
    seed: int = 0
    sequence_parallel: bool = True
    flash_attention: bool = True
    fp32_matmul: str = "ieee"
    _costs: dict[tuple[str, int, int, str], LayerCost] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    @property
    def identity(self) -> str:
        kernel = "" if self.flash_attention else ", materialized attention"
        tf32 = ", tf32 matmuls" if self.dtype == "fp32" and self.fp32_matmul == "tf32" else ""
        return f"simulated {self.device.key} (roofline{kernel}{tf32}, noise {self.noise:g}, seed {self.seed})"

    # ---- kernels --------------------------------------------------------------------------------------------
    @property
    def _peak(self) -> float:
        return self.device.peak_flops_for_dtype(self.dtype, self.fp32_matmul)

    def _size_efficiency(self, flops: float) -> float:
        """The fall-off of small kernels: F / (F + peak * ramp)."""
        return flops / (flops + self._peak * self.device.gemm_ramp_us * 1e-6)

    def _gemm_time_s(self, m: float, n: float, k: float) -> float:
        flops = 2.0 * m * n * k
        thinnest = min(m, n, k)
        thin = thinnest / (thinnest + self.device.gemm_tile)
        achieved = self._peak * self.device.gemm_efficiency * self._size_efficiency(flops) * thin
        operand_bytes = 1 if self.dtype == "fp8" else DTYPE_BYTES[self.dtype]
        moved = operand_bytes * (m * k + k * n) + DTYPE_BYTES[self.dtype] * m * n
        time_s = max(flops / achieved, moved / self.device.hbm_bw_bytes_per_s)
        if self.dtype == "fp8":  # the input cast to fp8 (read 16-bit, write 8-bit, amax reduction)
            time_s += 3 * m * k / (self.device.hbm_bw_bytes_per_s * ELEMENTWISE_BW_EFFICIENCY)
        return time_s

    @property
    def _attention_peak(self) -> float:
        """Attention runs in bf16 also when the GEMMs run in fp8."""
        return self.device.peak_flops_per_s if self.dtype == "fp8" else self._peak

    def _attention_forward_s(self, micro_batch_size: int, tp: int) -> float:
        flops = self.model.layer_attention_flops(micro_batch_size, self.seq_length, self.flash_attention) / tp
        if not self.flash_attention:  # two batched GEMMs over the whole score matrix, then memory-bound softmax
            scores = micro_batch_size * self.model.num_attention_heads / tp * self.seq_length**2
            bw = self.device.hbm_bw_bytes_per_s * ELEMENTWISE_BW_EFFICIENCY
            return flops / (self._attention_peak * self.device.gemm_efficiency) + SCORE_BYTES_FORWARD * scores / bw
        peak = self._attention_peak * self.device.gemm_efficiency * ATTENTION_EFFICIENCY
        return flops / (peak * self._size_efficiency(flops))

    def _elementwise_s(self, elements: float) -> float:
        """Memory-bound ops reading and writing `elements` values once each."""
        moved = 2.0 * DTYPE_BYTES[self.dtype] * elements
        return moved / (self.device.hbm_bw_bytes_per_s * ELEMENTWISE_BW_EFFICIENCY)

    # ---- layers ---------------------------------------------------------------------------------------------
    def _decoder_parts(self, micro_batch_size: int, tp: int) -> tuple[float, float, float]:
        """Forward (GEMMs, core attention, elementwise) seconds of one layer shard."""
        model = self.model
        tokens = micro_batch_size * self.seq_length
        h, f, q, kv = model.hidden_size, model.ffn_hidden_size, model.q_size, model.kv_size
        up_width = (2 if model.mlp == "swiglu" else 1) * f
        gemms = (
            self._gemm_time_s(tokens, (q + 2 * kv) / tp, h)
            + self._gemm_time_s(tokens, h, q / tp)
            + self._gemm_time_s(tokens, up_width / tp, h)
            + self._gemm_time_s(tokens, h, f / tp)
        )
        elementwise = self._elementwise_s(model.layer_elementwise_elements(tokens, tp, self.sequence_parallel))
        return gemms, self._attention_forward_s(micro_batch_size, tp), elementwise

    def _decoder_cost(self, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        gemms, attention, elementwise = self._decoder_parts(micro_batch_size, tp)
        launches = FORWARD_KERNELS_PER_LAYER * KERNEL_LAUNCH_S
        forward = gemms + attention + elementwise + launches
        attention_backward = ATTENTION_BACKWARD_RATIO if self.flash_attention else 2.0
        backward = 2 * gemms + attention_backward * attention + 2 * elementwise + 2 * launches
        if recompute == "full":
            backward += forward
        elif recompute == "selective":
            backward += attention + elementwise + launches / 2
        activation = analytic_activation_bytes(
            self.model,
            self.seq_length,
            self.dtype,
            "decoder",
            micro_batch_size,
            tp,
            recompute,
            self.sequence_parallel,
            self.flash_attention,
        )
        return LayerCost(forward, backward, activation)

    def _embedding_cost(self, micro_batch_size: int, tp: int) -> LayerCost:
        tokens = micro_batch_size * self.seq_length
        h = self.model.hidden_size
        forward = self._elementwise_s(tokens * h / tp) + KERNEL_LAUNCH_S * 2
        backward = 2 * forward
        activation = analytic_activation_bytes(
            self.model, self.seq_length, self.dtype, "embedding", micro_batch_size, tp, "none", self.sequence_parallel
        )
        return LayerCost(forward, backward, activation)

    def _lm_head_cost(self, micro_batch_size: int, tp: int) -> LayerCost:
        """Final norm, output projection and cross-entropy (logits upcast to fp32)."""
        tokens = micro_batch_size * self.seq_length
        h, vocab = self.model.hidden_size, self.model.vocab_size
        gemm = self._gemm_time_s(tokens, vocab / tp, h)
        loss = 3 * self._elementwise_s(tokens * vocab / tp) + self._elementwise_s(tokens * h)
        forward = gemm + loss + 6 * KERNEL_LAUNCH_S
        backward = 2 * gemm + loss + 6 * KERNEL_LAUNCH_S
        activation = analytic_activation_bytes(
            self.model, self.seq_length, self.dtype, "lm_head", micro_batch_size, tp, "none", self.sequence_parallel
        )
        return LayerCost(forward, backward, activation)

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        key = (layer, micro_batch_size, tp, recompute)
        cost = self._costs.get(key)
        if cost is None:
            cost = self._costs[key] = self._exact_cost(layer, micro_batch_size, tp, recompute)
        return cost

    def _exact_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        if layer == "decoder":
            cost = self._decoder_cost(micro_batch_size, tp, recompute)
        elif layer == "embedding":
            cost = self._embedding_cost(micro_batch_size, tp)
        else:
            cost = self._lm_head_cost(micro_batch_size, tp)
        if self.noise <= 0:
            return cost
        key = f"{self.seed}/{self.device.key}/{layer}/{micro_batch_size}/{tp}/{recompute}".encode()
        factors = np.random.default_rng(zlib.crc32(key)).lognormal(0.0, self.noise, size=2)
        return LayerCost(cost.forward_time_s * factors[0], cost.backward_time_s * factors[1], cost.activation_bytes)

    # ---- export ---------------------------------------------------------------------------------------------
    def to_profile(
        self, micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8), tp_degrees: tuple[int, ...] = (1, 2, 4, 8)
    ) -> DeviceProfile:
        """Tabulate the simulated costs in the profile JSON shape."""
        entries = []
        for tp in tp_degrees:
            for size in micro_batch_sizes:
                for layer, modes in (("decoder", RECOMPUTE_MODES), ("embedding", ("none",)), ("lm_head", ("none",))):
                    for mode in modes:
                        cost = self.layer_cost(layer, size, tp, mode)  # type: ignore[arg-type]
                        entries.append(
                            ProfileEntry(
                                layer=layer,  # type: ignore[arg-type]
                                micro_batch_size=size,
                                tp=tp,
                                recompute=mode,  # type: ignore[arg-type]
                                forward_time_s=cost.forward_time_s,
                                backward_time_s=cost.backward_time_s,
                                activation_bytes=cost.activation_bytes,
                            )
                        )
        return DeviceProfile(
            source="simulated",
            device={"key": self.device.key, "name": self.device.name, "vendor": self.device.vendor},
            model=self.model.model_dump(exclude={"aliases", "source"}),
            dtype=self.dtype,
            seq_length=self.seq_length,
            entries=entries,
            environment={"generator": "hetplan roofline simulation", "noise": self.noise, "seed": self.seed},
        )
