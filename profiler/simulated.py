"""Simulated device profiles: a roofline of each layer's kernels with a realistic efficiency curve.

A kernel takes max(FLOPs / achieved FLOP/s, bytes / HBM bandwidth) plus a launch overhead. Achieved FLOP/s of a
GEMM rises with its size, F / (F + F_half) of the device's large-GEMM efficiency, where F_half is the work of
`HALF_EFFICIENCY_S` at peak: small or thin GEMMs (large TP, small micro-batches) run below peak, as measured
GEMM curves do. Attention runs a causal flash kernel (half of the 4*b*s^2*h model FLOPs) at a lower efficiency.
These numbers only stand in until a device is profiled; the planner reads them through the same interface.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import numpy as np

from profiler.profile import DeviceProfile, LayerCost, LayerKind, ProfileEntry
from specs.device import DeviceSpec
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute
from specs.training import DTYPE_BYTES

HALF_EFFICIENCY_S = 4e-6
ATTENTION_EFFICIENCY = 0.7  # flash attention vs large GEMMs on the same device
ATTENTION_BACKWARD_RATIO = 2.5  # flash backward recomputes the scores: ~2.5x forward FLOPs
KERNEL_LAUNCH_S = 5e-6
FORWARD_KERNELS_PER_LAYER = 16
ELEMENTWISE_BW_EFFICIENCY = 0.8


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
    _costs: dict[tuple[str, int, int, str], LayerCost] = field(
        default_factory=dict, init=False, repr=False, compare=False, hash=False
    )

    @property
    def identity(self) -> str:
        return f"simulated {self.device.key} (roofline, noise {self.noise:g}, seed {self.seed})"

    # ---- kernels --------------------------------------------------------------------------------------------
    @property
    def _peak(self) -> float:
        return self.device.peak_flops_for_dtype(self.dtype)

    def _gemm_time_s(self, m: float, n: float, k: float) -> float:
        flops = 2.0 * m * n * k
        peak = self._peak
        achieved = peak * self.device.gemm_efficiency * flops / (flops + peak * HALF_EFFICIENCY_S)
        moved = DTYPE_BYTES[self.dtype] * (m * k + k * n + m * n)
        return max(flops / achieved, moved / self.device.hbm_bw_bytes_per_s)

    def _attention_forward_s(self, micro_batch_size: int, tp: int) -> float:
        flops = self.model.layer_attention_flops(micro_batch_size, self.seq_length, causal_kernel=True) / tp
        peak = self._peak * self.device.gemm_efficiency * ATTENTION_EFFICIENCY
        return flops / (peak * flops / (flops + self._peak * HALF_EFFICIENCY_S))

    def _elementwise_s(self, elements: float) -> float:
        """Memory-bound ops reading and writing `elements` values once each."""
        moved = 2.0 * DTYPE_BYTES[self.dtype] * elements
        return moved / (self.device.hbm_bw_bytes_per_s * ELEMENTWISE_BW_EFFICIENCY)

    # ---- layers ---------------------------------------------------------------------------------------------
    def _decoder_parts(self, micro_batch_size: int, tp: int) -> tuple[float, float, float]:
        """Forward (GEMMs, core attention, elementwise) seconds of one layer shard."""
        model = self.model
        tokens = micro_batch_size * self.seq_length
        h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_size
        up_width = (2 if model.mlp == "swiglu" else 1) * f
        gemms = (
            self._gemm_time_s(tokens, (h + 2 * kv) / tp, h)
            + self._gemm_time_s(tokens, h, h / tp)
            + self._gemm_time_s(tokens, up_width / tp, h)
            + self._gemm_time_s(tokens, h, f / tp)
        )
        sp_tp = tp if self.sequence_parallel else 1
        act_elements = (3 * f if model.mlp == "swiglu" else 2 * f) / tp
        elementwise = self._elementwise_s(tokens * (6 * h / sp_tp + 2 * (h + kv) / tp + act_elements))
        return gemms, self._attention_forward_s(micro_batch_size, tp), elementwise

    def _decoder_cost(self, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        gemms, attention, elementwise = self._decoder_parts(micro_batch_size, tp)
        launches = FORWARD_KERNELS_PER_LAYER * KERNEL_LAUNCH_S
        forward = gemms + attention + elementwise + launches
        backward = 2 * gemms + ATTENTION_BACKWARD_RATIO * attention + 2 * elementwise + 2 * launches
        if recompute == "full":
            backward += forward
        elif recompute == "selective":
            backward += attention + elementwise + launches / 2
        replicated, sharded = self.model.layer_activation_elements_per_token(recompute)
        sp_tp = tp if self.sequence_parallel else 1
        tokens = micro_batch_size * self.seq_length
        activation = DTYPE_BYTES[self.dtype] * tokens * (replicated / sp_tp + sharded / tp)
        if recompute == "none":  # fp32 log-sum-exp of flash attention (selective recomputes attention)
            activation += 4.0 * tokens * self.model.num_attention_heads / tp
        return LayerCost(forward, backward, activation)

    def _embedding_cost(self, micro_batch_size: int, tp: int) -> LayerCost:
        tokens = micro_batch_size * self.seq_length
        h = self.model.hidden_size
        forward = self._elementwise_s(tokens * h / tp) + KERNEL_LAUNCH_S * 2
        backward = 2 * forward
        sp_tp = tp if self.sequence_parallel else 1
        return LayerCost(forward, backward, DTYPE_BYTES[self.dtype] * tokens * h / sp_tp)

    def _lm_head_cost(self, micro_batch_size: int, tp: int) -> LayerCost:
        """Final norm, output projection and cross-entropy (logits upcast to fp32)."""
        tokens = micro_batch_size * self.seq_length
        h, vocab = self.model.hidden_size, self.model.vocab_size
        gemm = self._gemm_time_s(tokens, vocab / tp, h)
        loss = 3 * self._elementwise_s(tokens * vocab / tp) + self._elementwise_s(tokens * h)
        forward = gemm + loss + 6 * KERNEL_LAUNCH_S
        backward = 2 * gemm + loss + 6 * KERNEL_LAUNCH_S
        logits = tokens * vocab / tp * (DTYPE_BYTES[self.dtype] + 4)
        return LayerCost(forward, backward, logits + DTYPE_BYTES[self.dtype] * tokens * h)

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
