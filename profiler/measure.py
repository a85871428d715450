"""Measure layers on the local accelerator: forward/backward time, activation bytes, peak memory.

Timing: warm-up runs, then timed runs of forward and of backward, each bracketed by a device synchronisation
(CUDA/ROCm, XPU and NPU expose the same `torch.<device>.synchronize`; the CPU needs none) and a monotonic clock (on
the CPU with one thread, the process's busy time: what the layer costs on a core of its own, whatever else the
machine runs meanwhile; how processes share the cores is measured and modelled apart, profiler/host.py),
collected in several interleaved passes over all entries; the median of the samples is the entry's time, min and
max its spread. Activation bytes are what autograd saves
for backward, counted with saved-tensor hooks (unique storages, parameters and buffers excluded), so the number
means the same on every device. Sizes that run out of memory are recorded with `fits: false`.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

try:
    import torch
    from torch import nn
except ImportError as err:  # pragma: no cover - exercised only without torch
    from specs.errors import TorchMissingError

    raise TorchMissingError("`hetplan profile`") from err

from profiler.layers import DecoderLayer, Embedding, LMHead
from profiler.profile import DeviceProfile, LayerKind, ProfileEntry
from specs.errors import SpecError
from specs.model import RECOMPUTE_MODES, ModelSpec, Recompute

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HOST_MEMORY_SHARE = 0.8  # of the available memory a profiled layer may take (torch and the timings need the rest)


@dataclass(frozen=True)
class LayerMeasurement:
    forward_time_s: float
    backward_time_s: float
    forward_time_min_s: float
    forward_time_max_s: float
    backward_time_min_s: float
    backward_time_max_s: float
    activation_bytes: float
    peak_memory_bytes: float | None
    repeats: int


# device types torch knows only once a vendor package is installed (cuda and xpu are always known)
DEVICE_PACKAGES = {"npu": "Ascend NPUs need torch_npu installed"}


def resolve_device(name: str) -> torch.device:
    """'auto' picks the first accelerator torch can see (CUDA/ROCm, XPU, Ascend NPU), else the CPU."""
    if name != "auto":
        try:
            device = torch.device(name)
        except RuntimeError:
            kind = name.split(":")[0]
            if kind in DEVICE_PACKAGES:
                raise SpecError(
                    "--device", "", f"{name!r} is not available on this machine ({DEVICE_PACKAGES[kind]})"
                ) from None
            raise SpecError("--device", "", f"expected auto, cpu, cuda:N, xpu:N or npu:N, got {name!r}") from None
        backend = getattr(torch, device.type, None)
        if device.type != "cpu" and not (backend is not None and backend.is_available()):
            raise SpecError("--device", "", f"{name!r} is not available on this machine")
        return device
    for kind in ("cuda", "xpu", "npu"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            return torch.device(kind, 0)
    return torch.device("cpu")


def profile_target(
    device: str, dtype: str, as_device: str | None, threads: int | None = None
) -> tuple[torch.device, str, str]:
    """What `hetplan profile` measures: the torch device (`resolve_device`), the dtype ('auto': fp32 on the CPU,
    which runs it well, bf16 on accelerators) and the catalog key the profile stands for (`as_device`, else cpu or
    the device type); `threads` caps torch's CPU threads."""
    from specs.device import get_device

    torch_device = resolve_device(device)
    if threads is not None:
        torch.set_num_threads(threads)
    chosen_dtype = ("fp32" if torch_device.type == "cpu" else "bf16") if dtype == "auto" else dtype
    key = get_device(as_device, "--as-device", "").key if as_device else torch_device.type
    return torch_device, chosen_dtype, key


def available_host_memory_bytes() -> int | None:
    """MemAvailable of /proc/meminfo (what can be allocated without swapping); None where the file is not there."""
    try:
        for line in Path("/proc/meminfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_layer_fits_host(
    model: ModelSpec, seq_length: int, dtype: str, micro_batch: int, tp: int, recompute: Recompute = "none"
) -> None:
    """Refuse in one line a CPU profile whose largest layer (the fewest TP ranks, the most micro-batches, the mode
    that recomputes least of those profiled) would not fit this machine's available memory: it swapped at "starting"
    until stopped."""
    from profiler.simulated import SimulatedDevice
    from specs.device import get_device
    from specs.training import DTYPE_BYTES

    available = available_host_memory_bytes()
    if available is None:
        return
    layer = SimulatedDevice(get_device("cpu"), model, seq_length, dtype).layer_cost(
        "decoder", micro_batch, tp, recompute
    )
    needed = model.layer_params() / tp * DTYPE_BYTES[dtype] * 2 + layer.activation_bytes  # weights and gradients too
    if needed > HOST_MEMORY_SHARE * available:
        remedies = ["smaller micro-batches (--micro-batches)"] if micro_batch > 1 else []
        remedies += ["more TP ranks (--tp)"] + (
            ["full recompute alone (--recompute full)"] if recompute != "full" else []
        )
        remedies += ["a shorter sequence (--seq-len)"]
        raise SpecError(
            "--model",
            model.key,
            f"one decoder layer at micro-batch {micro_batch}, TP {tp} and recompute {recompute} needs about "
            f"{needed / 2**30:,.1f} GiB (weights, gradients, activations), more than {HOST_MEMORY_SHARE:.0%} of the "
            f"{available / 2**30:,.1f} GiB this machine has available: profile {', '.join(remedies[:-1])} or "
            f"{remedies[-1]}",
        )


def synchronize(device: torch.device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


_MALLOPT_MMAP_THRESHOLD = -3
_MALLOPT_TRIM_THRESHOLD = -1
# blocks at least this large get pages of their own (mmap) that every free hands back: the whole heap if glibc
# takes it (2.35 and later), else its old ceiling on 64-bit (32 MiB: larger tensors still fault in fresh pages)
_MMAP_THRESHOLDS_BYTES = (2**30, 32 * 2**20)
_TRIM_THRESHOLD_BYTES = 2**30


@functools.cache
def keep_freed_host_memory() -> str:
    """Make glibc reuse freed host memory instead of returning it to the OS after every tensor.

    GPU runtimes cache device memory, so a training step does not pay for fresh allocations; glibc by default
    hands large blocks back and page-faults them in again on the next step, which makes CPU timings slow and
    noisy (an optimizer step over a 20M-parameter shard takes 2.5x as long). Every process that is timed calls
    it, the profile's and the local run's ranks alike, so that both pay the same. Returns what was done, for the
    environment record ('' where glibc is absent or refuses); done once per process."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return ""
    if not libc.mallopt(_MALLOPT_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES):
        return ""
    for threshold in _MMAP_THRESHOLDS_BYTES:
        if libc.mallopt(_MALLOPT_MMAP_THRESHOLD, threshold):
            trim_mib = _TRIM_THRESHOLD_BYTES // 2**20
            return f"glibc: mmap threshold {threshold // 2**20} MiB, trim threshold {trim_mib} MiB"
    return ""


def _reset_peak(device: torch.device) -> None:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(backend, "reset_peak_memory_stats"):
        backend.reset_peak_memory_stats(device)


def _peak_bytes(device: torch.device) -> float | None:
    backend = getattr(torch, device.type, None)
    if device.type != "cpu" and hasattr(backend, "max_memory_allocated"):
        return float(backend.max_memory_allocated(device))
    return None


def saved_activation_bytes(module: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Run a forward pass and count the bytes autograd keeps for backward (unique storages, no parameters)."""
    owned = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    seen: set[int] = set()
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in owned and pointer not in seen:
            seen.add(pointer)
            total += storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return out, float(total)


@dataclass
class _Samples:
    forward_s: list[float]
    backward_s: list[float]
    activation_bytes: float
    peak_memory_bytes: float | None

    def summary(self) -> LayerMeasurement:
        return LayerMeasurement(
            forward_time_s=statistics.median(self.forward_s),
            backward_time_s=statistics.median(self.backward_s),
            forward_time_min_s=min(self.forward_s),
            forward_time_max_s=max(self.forward_s),
            backward_time_min_s=min(self.backward_s),
            backward_time_max_s=max(self.backward_s),
            activation_bytes=self.activation_bytes,
            peak_memory_bytes=self.peak_memory_bytes,
            repeats=len(self.forward_s),
        )


def layer_clock(device: torch.device) -> Callable[[], float]:
    """The clock a layer is timed on: busy time (time.process_time) on the CPU with one torch thread, where the wall
    clock would also count the time the scheduler gives the core to other processes; else the wall clock."""
    return time.process_time if device.type == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


def _sample_layer(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    warmup: int,
    repeats: int,
    min_time_s: float,
    max_repeats: int,
) -> _Samples:
    device = next((t.device for t in example_inputs), torch.device("cpu"))
    inputs = [t.detach().requires_grad_(t.is_floating_point()) for t in example_inputs]

    def forward() -> torch.Tensor:
        return module(*inputs)

    out, activation_bytes = saved_activation_bytes(module, forward)
    grad = torch.randn_like(out) if out.dim() > 0 else None
    out.backward(grad)
    _reset_peak(device)
    clock = layer_clock(device)
    forward_times: list[float] = []
    backward_times: list[float] = []
    index = 0
    while index < warmup + repeats or (
        sum(forward_times) + sum(backward_times) < min_time_s and len(forward_times) < max_repeats
    ):
        for t in inputs:
            t.grad = None
        # Gradient buffers persist across steps, as in training (Megatron's main_grad buffers): backward
        # accumulates into them instead of allocating (and page-faulting) fresh ones every run.
        module.zero_grad(set_to_none=False)
        synchronize(device)
        started = clock()
        out = forward()
        synchronize(device)
        middle = clock()
        out.backward(grad)
        synchronize(device)
        ended = clock()
        if index >= warmup:
            forward_times.append(middle - started)
            backward_times.append(ended - middle)
        index += 1
    return _Samples(forward_times, backward_times, activation_bytes, _peak_bytes(device))


def profile_layer(
    module: nn.Module,
    example_inputs: Sequence[torch.Tensor],
    *,
    warmup: int = 2,
    repeats: int = 5,
    min_time_s: float = 0.25,
    max_repeats: int = 200,
) -> LayerMeasurement:
    """Time forward and backward of any module on its inputs' device, and count its saved activations.

    Runs at least `repeats` timed iterations and keeps going (up to `max_repeats`) until `min_time_s` of
    measurements are collected, so short kernels get enough samples for a stable median. A non-scalar output is
    back-propagated with a fixed random gradient; a scalar (a loss) with 1. On the CPU, freed host memory is
    kept for reuse (see `keep_freed_host_memory`), as a GPU's caching allocator would.
    """
    if next((t.device.type for t in example_inputs), "cpu") == "cpu":
        keep_freed_host_memory()
    return _sample_layer(
        module, example_inputs, warmup=warmup, repeats=repeats, min_time_s=min_time_s, max_repeats=max_repeats
    ).summary()


def _entries(
    plan: Sequence[tuple[LayerKind, int, int, Recompute]], samples: dict[int, _Samples], no_fit: set[int]
) -> list[ProfileEntry]:
    """The profile's entries in `plan`'s order: the measured ones summarised, those that ran out of memory as such
    (an interrupted profile leaves the rest out)."""
    entries = []
    for index, (layer, size, tp, mode) in enumerate(plan):
        if index in no_fit:
            entries.append(ProfileEntry(layer=layer, micro_batch_size=size, tp=tp, recompute=mode, fits=False))
        elif index in samples:
            measured = samples[index].summary()
            entries.append(ProfileEntry(layer=layer, micro_batch_size=size, tp=tp, recompute=mode, **measured.__dict__))
    return entries


def pass_speeds(per_pass_s: dict[int, list[float]]) -> list[float]:
    """How long each pass over the entries took against the entries' medians over the passes (the median over the
    entries timed in every pass; [] with fewer than two passes). Where the machine's speed moves by tens of percent
    over seconds, the passes disagree: on one shared host the runtime benchmark's tiny model's four passes (a few
    seconds each) read 0.78-1.10, its 10x model's (a minute) 0.97-1.03."""
    count = max((len(times) for times in per_pass_s.values()), default=0)
    complete = [times for times in per_pass_s.values() if len(times) == count]
    if count < 2 or not complete:
        return []
    return [statistics.median(times[i] / statistics.median(times) for times in complete) for i in range(count)]


def pass_drift(speeds: Sequence[float]) -> float:
    """The slowest pass over the fastest, less 1 (0 without passes)."""
    return max(speeds) / min(speeds) - 1.0 if speeds and min(speeds) > 0 else 0.0


def _is_out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def build_layer(
    model: ModelSpec,
    layer: LayerKind,
    micro_batch_size: int,
    seq_length: int,
    tp: int,
    recompute: Recompute,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[nn.Module, list[torch.Tensor]]:
    """The module and seeded example inputs for one profile entry."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    shape_model = model.model_copy(update={"seq_length": max(seq_length, model.seq_length)})
    if layer == "decoder":
        module: nn.Module = DecoderLayer(shape_model, tp, recompute)
        inputs = [torch.randn(micro_batch_size, seq_length, model.hidden_size, generator=generator)]
    elif layer == "embedding":
        module = Embedding(shape_model, tp)
        inputs = [torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator)]
    else:
        module = LMHead(shape_model, tp)
        inputs = [
            torch.randn(micro_batch_size, seq_length, model.hidden_size, generator=generator),
            torch.randint(0, model.vocab_size, (micro_batch_size, seq_length), generator=generator),
        ]
    module = module.to(device=device, dtype=dtype)
    moved = [t.to(device=device, dtype=dtype) if t.is_floating_point() else t.to(device) for t in inputs]
    return module, moved


def environment(device: torch.device, dtype: str) -> dict[str, object]:
    name = platform.processor() or platform.machine()
    if device.type != "cpu":
        backend = getattr(torch, device.type)
        name = backend.get_device_name(device) if hasattr(backend, "get_device_name") else device.type
    vendor = "cpu"
    if device.type == "cuda":
        vendor = "amd" if getattr(torch.version, "hip", None) else "nvidia"
    elif device.type in ("xpu", "npu"):
        vendor = {"xpu": "intel", "npu": "huawei"}[device.type]
    return {
        "device": str(device),
        "device_name": name,
        "vendor": vendor,
        "torch": torch.__version__,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "clock": "busy (process CPU time)" if layer_clock(device) is time.process_time else "wall",
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def profile_model(
    model: ModelSpec,
    *,
    device: torch.device,
    device_key: str,
    dtype: str,
    seq_length: int,
    micro_batch_sizes: Sequence[int],
    tp_degrees: Sequence[int],
    recompute_modes: Sequence[Recompute] = RECOMPUTE_MODES,
    warmup: int = 1,
    repeats: int = 8,
    passes: int = 4,
    min_time_s: float = 0.3,
    progress: Callable[[int, int, str], None] | None = None,
) -> DeviceProfile:
    """Measure every (layer, micro-batch, TP, recompute) entry; Ctrl-C stops and keeps what was measured."""
    allocator = keep_freed_host_memory() if device.type == "cpu" else ""
    model.check_tp_degrees(tp_degrees)
    plan: list[tuple[LayerKind, int, int, Recompute]] = []
    for tp in tp_degrees:
        for size in micro_batch_sizes:
            plan += [("decoder", size, tp, mode) for mode in recompute_modes]
            plan += [("embedding", size, tp, "none"), ("lm_head", size, tp, "none")]
    interrupted = False
    torch_dtype = TORCH_DTYPES[dtype]
    if plan:  # wake up thread pools, allocators and kernel caches before the first timed entry
        layer, size, tp, mode = plan[0]
        module, inputs = build_layer(model, layer, size, seq_length, tp, mode, device, torch_dtype)
        profile_layer(module, inputs, warmup=1, repeats=3, min_time_s=0.5)
    # Several interleaved passes: a drift of the machine's speed (shared hosts drift by tens of percent over
    # seconds) spreads over all entries instead of biasing whichever entry ran during it.
    samples: dict[int, _Samples] = {}
    per_pass_s: dict[int, list[float]] = {}  # per entry, each pass's forward + backward (medians of that pass)
    no_fit: set[int] = set()
    steps = passes * len(plan)
    reached = 0  # the timings made (the progress counts timings: every entry once per pass)
    for step in range(steps):
        reached = step
        index = step % len(plan)
        layer, size, tp, mode = plan[index]
        if index in no_fit:
            continue
        if progress is not None:
            progress(step, steps, f"pass {step // len(plan) + 1}/{passes} {layer} b={size} tp={tp} {mode}")
        try:
            module, inputs = build_layer(model, layer, size, seq_length, tp, mode, device, torch_dtype)
            taken = _sample_layer(
                module,
                inputs,
                warmup=warmup,
                repeats=max(1, repeats // passes),
                min_time_s=min_time_s / passes,
                max_repeats=200,
            )
        except KeyboardInterrupt:
            interrupted = True
            break
        except (RuntimeError, MemoryError) as err:
            if not (isinstance(err, MemoryError) or _is_out_of_memory(err)):
                raise
            no_fit.add(index)
            continue
        per_pass_s.setdefault(index, []).append(
            statistics.median(taken.forward_s) + statistics.median(taken.backward_s)
        )
        if index in samples:
            samples[index].forward_s += taken.forward_s
            samples[index].backward_s += taken.backward_s
        else:
            samples[index] = taken
    entries = _entries(plan, samples, no_fit)
    if progress is not None:
        progress(reached if interrupted else steps, steps, "interrupted" if interrupted else "layers done")
    env = environment(device, dtype)
    env.update(
        {
            "warmup": warmup,
            "repeats": repeats,
            "passes": passes,
            "min_time_s": min_time_s,
            "interrupted": interrupted,
            "host_allocator": allocator or "default",
            "pass_speeds": [round(speed, 3) for speed in pass_speeds(per_pass_s)],
        }
    )
    return DeviceProfile(
        source="measured",
        device={"key": device_key, "name": str(env["device_name"]), "vendor": str(env["vendor"])},
        model=model.model_dump(exclude={"aliases", "source"}),
        dtype=dtype,
        seq_length=seq_length,
        entries=entries,
        environment=env,
    )
