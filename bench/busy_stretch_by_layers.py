"""How much busier a pass gets when twice as many processes as cores compute at once, by how many decoder layers
each process's pass runs: the profile times its busy stretch on one decoder layer (profiler/host.py concurrency),
while a run's ranks each run a stage of several layers between their waits.

For each model of the runtime benchmark (bench/runtime_vs_prediction.py) and chain of 1..6 of its decoder layers
(micro-batch 1, sequence 128, fp32, one thread per process): the CPU time per forward + backward pass of one process
alone, and with 2 x cores processes computing the same chain at once: the same processes throughout, in alternating
phases (one computes alone, all compute, alone, ...: each together time against the mean of the alone times around
it, so a drifting machine cancels out).
Table + bench/results/busy_stretch_by_layers.json.

Run: python bench/busy_stretch_by_layers.py [--models tiny,small] [--layers 1,2,4,6] [--rounds 4] [--seconds 2]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from profiler.machine import host_cores  # noqa: E402

WARMUP_PASSES = 3
START_TIMEOUT_S = 120.0


def _chain_worker(
    size: str, layers: int, index: int, phases: object, stop: object, ready: object, results: object
) -> None:
    """Build `layers` decoder layers of the benchmark's `size` model; then, until `stop`, compute while the phase
    asks this worker to (worker 0 in every phase, the others only in "together" phases), timing each pass on this
    thread's CPU clock; worker 0 puts its (phase, busy seconds) list."""
    import torch
    from runtime_vs_prediction import SEQ_LENGTH, model_spec

    from profiler.layers import DecoderLayer
    from profiler.measure import keep_freed_host_memory

    torch.set_num_threads(1)
    keep_freed_host_memory()
    model = model_spec(size)
    torch.manual_seed(0)
    chain = torch.nn.Sequential(*[DecoderLayer(model) for _ in range(layers)])
    x = torch.randn(1, SEQ_LENGTH, model.hidden_size, requires_grad=True)
    grad = torch.randn_like(x)
    for _ in range(WARMUP_PASSES):
        chain(x).backward(grad)
    ready.put(index)  # type: ignore[attr-defined]
    timed: list[tuple[int, float]] = []
    while not stop.is_set():  # type: ignore[attr-defined]
        phase = phases.value  # type: ignore[attr-defined]
        if phase < 0 or (index > 0 and phase % 2 == 0):  # even phases: worker 0 alone
            time.sleep(0.002)
            continue
        began = time.thread_time()
        chain.zero_grad(set_to_none=False)
        x.grad = None
        chain(x).backward(grad)
        if phases.value == phase:  # type: ignore[attr-defined]  # a pass that straddles a switch is left out
            timed.append((phase, time.thread_time() - began))
    if index == 0:
        results.put(timed)  # type: ignore[attr-defined]


def alone_and_together_s(size: str, layers: int, processes: int, rounds: int, phase_s: float) -> list[float]:
    """Worker 0's median busy time per pass in alternating phases, alone, together, alone, ... (2 x rounds + 1
    phases of `phase_s`, the same processes throughout), as a list by phase."""
    context = mp.get_context("spawn")
    phases, stop, ready, results = context.Value("i", -1), context.Event(), context.Queue(), context.Queue()
    workers = [
        context.Process(target=_chain_worker, args=(size, layers, index, phases, stop, ready, results), daemon=True)
        for index in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        for _ in workers:
            ready.get(timeout=START_TIMEOUT_S)
        for phase in range(2 * rounds + 1):
            phases.value = phase
            time.sleep(phase_s)
        stop.set()
        timed = results.get(timeout=START_TIMEOUT_S)
    finally:
        stop.set()
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return [statistics.median(t for p, t in timed if p == phase) for phase in range(2 * rounds + 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,small", help="models of the runtime benchmark")
    parser.add_argument("--layers", default="1,2,4,6", help="decoder layers per pass")
    parser.add_argument("--rounds", type=int, default=4, help="together phases per chain (each between alone ones)")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each phase")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "busy_stretch_by_layers.json")
    args = parser.parse_args()
    processes = 2 * host_cores()
    rows = []
    print(f"{'model':<6} {'layers':>6} {'alone ms':>9} {f'{processes} procs ms':>12} {'stretch':>8}")
    for size in args.models.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            by_phase = alone_and_together_s(size, layers, processes, args.rounds, args.seconds)
            alone, together = by_phase[0::2], by_phase[1::2]
            stretches = [busy / ((a + b) / 2) for busy, a, b in zip(together, alone, alone[1:], strict=False)]
            row = {
                "model": size,
                "layers": layers,
                "alone_ms": 1e3 * statistics.median(alone),
                "together_ms": 1e3 * statistics.median(together),
                "processes": processes,
                "busy_stretch": statistics.median(stretches),
                "stretch_readings": stretches,
            }
            rows.append(row)
            print(
                f"{size:<6} {layers:>6} {row['alone_ms']:>9.2f} {row['together_ms']:>12.2f} "
                f"{row['busy_stretch']:>8.3f}",
                flush=True,
            )
    host = {"machine": platform.machine(), "cores": host_cores(), "node": platform.node()}
    args.out.write_text(json.dumps({"host": host, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"written {args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}")


if __name__ == "__main__":
    main()
