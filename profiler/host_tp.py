"""Time what a tensor-parallel rank computes around each of its collectives, and the collectives themselves, between
real decoder layers on two local processes with Gloo (`hetplan profile` on the CPU; part of the profile's `host`
section, see profiler/host.py). Local runs' TP collectives are predicted from these rather than from the back-to-back
loop of `profile-comm`."""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from profiler.comm_bench import computing_beside, free_port, run_processes
from profiler.layers import DecoderLayer, EnterTensorParallel, LeaveTensorParallel, no_boundary
from profiler.machine import host_cores
from profiler.measure import keep_freed_host_memory
from specs.errors import HetplanError
from specs.model import ModelSpec

TP_LAYERS = 2  # decoder layers of the chain the TP collective overhead is timed on (at most the model's)
TP_COLLECTIVES_PER_LAYER = 4  # 2 in the forward, 2 in the backward (Megatron's f and g at attention and MLP)
TP_TIMEOUT_S = 120.0
TP_MIN_TIME_S = 0.5  # of each timing (a profile makes TP_TIMINGS)
TP_TIMINGS = 3  # at three moments of the profile (median)
TP_PASSES = 3  # interleaved passes over the sizes (a drifting machine spreads over all of them)
# the activation sizes TP collectives are timed at, times the profile's micro-batch: at 1, 2 and 4 a tiny model's
# all-reduces are all latency, and four fits of the line on this 2-core host read 0.7-10000 GB/s; at 1, 4 and 16:
# 0.6-1.1 GB/s
TP_SIZE_FACTORS = (1, 4, 16)
MIN_S_PER_BYTE = 1e-13  # a fitted all-reduce no faster than 10 TB/s (a flat line through noisy points)
MIN_STANDARD_ERROR_S = 1e-7  # a point's standard error no smaller (a weight stays finite when samples agree exactly)
# the standard error of a median of n samples from a normal spread: sqrt(pi / 2) sigma / sqrt(n), and sigma from the
# median absolute deviation: 1.4826 MAD
MEDIAN_SE_PER_MAD = math.sqrt(math.pi / 2) * 1.4826


@dataclass(frozen=True)
class TpCollectiveCosts:
    overhead_s: float  # per collective, what a rank computes around it (may be negative: a fitted intercept)
    overhead_s_per_byte: float  # and per byte of the activation it reduces
    all_reduce_alpha_s: float  # the 2-rank all-reduce's per-step latency
    all_reduce_bw_bytes_per_s: float  # and bus bandwidth
    all_reduce_load_alpha_s: float | None = None  # per busy process per core beyond one: added to the latency
    all_reduce_load_s_per_byte: float | None = None  # and to the time per byte (None: not timed under load)


def median_standard_error_s(samples: list[float]) -> float:
    """The standard error of the median of `samples` (seconds), from their median absolute deviation."""
    middle = statistics.median(samples)
    mad = statistics.median(abs(sample - middle) for sample in samples)
    return max(MEDIAN_SE_PER_MAD * mad / math.sqrt(len(samples)), MIN_STANDARD_ERROR_S)


def weighted_line(
    xs: list[float], ys: list[float], standard_errors: list[float], min_slope: float
) -> tuple[float, float]:
    """(intercept, slope) of the line through (x, y) points weighted by 1 / standard error squared, the slope at
    least `min_slope` (then the intercept is the best one for that slope)."""
    weights = [1.0 / se**2 for se in standard_errors]
    total = sum(weights)
    x_mean = sum(w * x for w, x in zip(weights, xs, strict=True)) / total
    y_mean = sum(w * y for w, y in zip(weights, ys, strict=True)) / total
    spread = sum(w * (x - x_mean) ** 2 for w, x in zip(weights, xs, strict=True))
    slope = sum(w * (x - x_mean) * (y - y_mean) for w, x, y in zip(weights, xs, ys, strict=True)) / spread
    slope = max(slope, min_slope)
    return y_mean - slope * x_mean, slope


class _TimedCollectives:
    """Megatron's TP boundaries over the default process group, as the runtime's (runtime/tensor_parallel.py): `enter`
    is identity forward and all-reduce of the gradient backward, `leave` all-reduces forward and is identity backward;
    `comm_s` adds up the time inside the all-reduces."""

    def __init__(self) -> None:
        self.comm_s = 0.0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        dist.all_reduce(tensor)
        self.comm_s += time.perf_counter() - started
        return tensor

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return EnterTensorParallel.apply(x, self)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        return LeaveTensorParallel.apply(x, self)


def _chain_pass_s(
    layers: list[DecoderLayer], x: torch.Tensor, grad: torch.Tensor, collectives: _TimedCollectives | None
) -> tuple[float, float]:
    """(seconds computing, seconds inside the all-reduces) of one forward and backward of the chain, with the
    collectives at its TP boundaries or (None) without them; wall clock, split as the runtime's timers split a step."""
    for layer in layers:
        layer.enter_tp = collectives.enter if collectives else no_boundary
        layer.leave_tp = collectives.leave if collectives else no_boundary
    waited = collectives.comm_s if collectives else 0.0
    started = time.perf_counter()
    y = x
    for layer in layers:
        y = layer(y)
    y.backward(grad)
    x.grad = None
    comm_s = collectives.comm_s - waited if collectives else 0.0
    return time.perf_counter() - started - comm_s, comm_s


def _tp_collective_worker(
    rank: int,
    port: int,
    model: ModelSpec,
    micro_batch_sizes: list[int],
    seq_length: int,
    dtype: str,
    min_time_s: float,
    out: str,
) -> None:
    """One of two TP ranks: at each micro-batch size, times its layer chain's compute with the collectives at its
    boundaries and without, and the time inside the all-reduces, in passes that visit every size; rank 0 writes the
    medians to `out`."""
    torch.set_num_threads(1)
    keep_freed_host_memory()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=TP_TIMEOUT_S)
    )
    try:
        torch.manual_seed(0)
        torch_dtype = getattr(torch, dtype)
        layers = [DecoderLayer(model, 2).to(torch_dtype) for _ in range(min(TP_LAYERS, model.num_layers))]
        collectives = _TimedCollectives()
        sizes = []
        for micro_batch_size in micro_batch_sizes:
            x = torch.randn(micro_batch_size, seq_length, model.hidden_size, dtype=torch_dtype, requires_grad=True)
            grad = torch.randn_like(x)
            _chain_pass_s(layers, x, grad, collectives)  # warm-up
            alone_s, _ = _chain_pass_s(layers, x, grad, None)
            probe = torch.tensor([min_time_s / TP_PASSES / len(micro_batch_sizes) / max(alone_s, 1e-6)])
            dist.broadcast(probe, 0)  # both ranks make the same number of passes (their collectives pair up)
            sizes.append((x, grad, max(3, math.ceil(float(probe)))))
        timed: list[dict[str, list[float]]] = [{"with_s": [], "without_s": [], "comm_s": []} for _ in sizes]
        for _ in range(TP_PASSES):  # every size in every pass: a drifting machine moves all the sizes, not the slope
            for (x, grad, repeats), times in zip(sizes, timed, strict=True):
                dist.barrier()
                times["without_s"].extend(_chain_pass_s(layers, x, grad, None)[0] for _ in range(repeats))
                dist.barrier()
                for _ in range(repeats):
                    compute, comm = _chain_pass_s(layers, x, grad, collectives)
                    times["with_s"].append(compute)
                    times["comm_s"].append(comm)
        points = [
            {
                "size_bytes": x.numel() * x.element_size(),
                **{key: statistics.median(v) for key, v in times.items()},
                **{key.removesuffix("_s") + "_se_s": median_standard_error_s(v) for key, v in times.items()},
            }
            for (x, _, _), times in zip(sizes, timed, strict=True)
        ]
        if rank == 0:
            Path(out).write_text(json.dumps({"layers": len(layers), "points": points}), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def time_tp_collectives(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: torch.dtype,
    min_time_s: float = TP_MIN_TIME_S,
    busy_processes: int = 0,
) -> dict | None:
    """One timing of TP collectives as a training step meets them on this host (`fit_tp_collective_costs` turns
    timings into costs). Two processes compute a chain of TP 2 layer shards with real Gloo all-reduces at their
    boundaries and without, at 1, 4 and 16 times the micro-batch size, timed as the runtime's timers split a step
    (the time inside the all-reduces is the TP term). The all-reduces are timed between layers (activations fresh
    from compute) rather than back to back as `profile-comm` times them: on a 2-core host the host link fitted from
    `profile-comm` gave 1.7 ms for a 128 KiB all-reduce and 2.2 ms for 512 KiB, and between layers they took 1.1 ms
    and 2.3-2.7 ms. Returns {"layers": chain length, "points": per size its median seconds with, without and inside
    the collectives, and their standard errors, and "processes_per_core" they ran at}; None when the model cannot
    split in two (it has no TP collectives to pay for). `busy_processes`: that many processes compute beside the two
    ranks (the load of a local run with more ranks than cores)."""
    if model.num_kv_heads % 2 or model.ffn_hidden_size % 2 or model.num_attention_heads % 2:
        return None
    with tempfile.TemporaryDirectory(prefix="hetplan-tp-") as scratch:
        out = Path(scratch, "tp.json")
        torch_dtype = str(dtype).removeprefix("torch.")
        sizes = [micro_batch_size * factor for factor in TP_SIZE_FACTORS]
        args = (free_port(), model, sizes, seq_length, torch_dtype, min_time_s, str(out))
        with computing_beside(busy_processes):
            run_processes(_tp_collective_worker, args, 2, TP_TIMEOUT_S * 2, "timing TP collectives on this host")
        timing = json.loads(out.read_text(encoding="utf-8"))
    return {**timing, "processes_per_core": max(1.0, (2 + busy_processes) / host_cores())}


def time_tp_under_load(
    model: ModelSpec,
    micro_batch_size: int,
    seq_length: int,
    dtype: torch.dtype,
    busy_processes: int,
    progress: Callable[[str], None],
) -> list[dict]:
    """The TP collectives timed with `busy_processes` computing beside the ranks ([] when that fails: the unloaded
    timings stand, and the host link's load terms load them)."""
    try:
        timing = time_tp_collectives(model, micro_batch_size, seq_length, dtype, busy_processes=busy_processes)
    except HetplanError as err:
        progress(f"host: {err}; local runs' TP collectives under load will use the link profile's load terms")
        return []
    return [timing] if timing is not None else []


def fit_tp_collective_costs(timings: Sequence[dict], loaded: Sequence[dict] = ()) -> TpCollectiveCosts:
    """Per collective, what a rank computes around it beyond the collective itself (waking from it with cold caches,
    the autograd boundary, the copy it reduces) and the all-reduce's own time: lines through the timed sizes, each
    point the median over the timings (launches at different moments of the profile) and weighted by its standard
    error. The timings differ from one launch to the next by more than within one: five launches on this 2-core host
    read the small runtime-benchmark model's all-reduce at its micro-batch 1.0-1.45 ms and the work around it
    0.27-0.56 ms. And the largest size takes a few passes only: its points spread 3x within a launch, and an
    unweighted line through it moved the intercept by up to 0.2 ms.

    `loaded`: timings with processes computing beside the ranks (more busy processes than cores): the all-reduce's
    line under that load, less the unloaded one, per busy process per core beyond one, is what the load adds to its
    latency and time per byte. Two ranks between layers wait less for a core than `profile-comm`'s back-to-back loop
    under the same load (they sleep in every collective, so the scheduler serves them first on waking): on this
    2-core host with two processes computing beside them, the tiny model's TP all-reduce at its micro-batch took
    2.3-2.4 ms against 1.0-1.1 ms unloaded, where the host link's load terms made it 3.4 ms."""
    overhead_intercept, overhead_slope = _line(timings, "with_s", "without_s", min_slope=0.0)
    comm_intercept, comm_slope = _line(timings, "comm_s", min_slope=MIN_S_PER_BYTE)
    load_alpha = load_per_byte = None
    if loaded:
        excess = statistics.median(timing["processes_per_core"] for timing in loaded) - 1.0
        if excess <= 0:
            raise ValueError("loaded TP timings must have more busy processes than cores")
        loaded_intercept, loaded_slope = _line(loaded, "comm_s", min_slope=MIN_S_PER_BYTE)
        load_alpha = max(0.0, (loaded_intercept - comm_intercept) / 2 / excess)
        load_per_byte = max(0.0, (loaded_slope - comm_slope) / excess)
    # a 2-rank all-reduce of S bytes: 2 latency steps and S bytes at the bus bandwidth (comm_model.all_reduce_time_s)
    return TpCollectiveCosts(
        overhead_s=overhead_intercept,
        overhead_s_per_byte=overhead_slope,
        all_reduce_alpha_s=max(0.0, comm_intercept / 2),
        all_reduce_bw_bytes_per_s=1.0 / comm_slope,
        all_reduce_load_alpha_s=load_alpha,
        all_reduce_load_s_per_byte=load_per_byte,
    )


def _line(timings: Sequence[dict], key: str, minus: str = "", *, min_slope: float) -> tuple[float, float]:
    """(intercept, slope) per collective of `key` (less `minus`) against the activation size: through each size's
    median over the timings, weighted by its standard error."""
    layers = {timing["layers"] for timing in timings}
    if len(layers) != 1:
        raise ValueError(f"TP timings of different chain lengths: {sorted(layers)}")
    collectives = TP_COLLECTIVES_PER_LAYER * layers.pop()
    per_size = list(zip(*(timing["points"] for timing in timings), strict=True))

    def median(points: tuple[dict, ...], field: str) -> float:
        return statistics.median(point[field] for point in points) / collectives if field else 0.0

    def standard_error(points: tuple[dict, ...]) -> float:
        """Of the median over the timings, taken as their mean's."""
        fields = [f.removesuffix("_s") + "_se_s" for f in (key, minus) if f]
        squares = sum(point[field] ** 2 for point in points for field in fields)
        return math.sqrt(squares) / len(points) / collectives

    return weighted_line(
        [float(points[0]["size_bytes"]) for points in per_size],
        [median(points, key) - median(points, minus) for points in per_size],
        [standard_error(points) for points in per_size],
        min_slope=min_slope,
    )
