"""How much busier a pass gets when twice as many processes as cores compute at once, by how many decoder layers
each process's pass runs: the profile times its busy stretch on one decoder layer (profiler/host.py concurrency),
while a run's ranks each run a stage of several layers between their waits.

For each model of the runtime benchmark (bench/runtime_vs_prediction.py) and chain of 1..6 of its decoder layers
(micro-batch 1, sequence 128, fp32, one thread per process): the CPU time per forward + backward pass of one process
alone, and of each of 2 x cores processes computing the same chain at once, in interleaved rounds (alone, together,
alone, ...: each together time against the mean of the alone times around it, so a drifting machine cancels out).
Table + bench/results/busy_stretch_by_layers.json.

Run: python bench/busy_stretch_by_layers.py [--models tiny,small] [--layers 1,2,4,6] [--rounds 2] [--seconds 4]
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


def _chain_worker(size: str, layers: int, seconds: float, start: object, results: object) -> None:
    """Build `layers` decoder layers of the benchmark's `size` model, wait for `start`, then time passes for
    `seconds` on this thread's CPU clock; put the median."""
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
    start.wait()  # type: ignore[attr-defined]
    busy_s = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.thread_time()
        chain.zero_grad(set_to_none=False)
        x.grad = None
        chain(x).backward(grad)
        busy_s.append(time.thread_time() - began)
    results.put(statistics.median(busy_s))  # type: ignore[attr-defined]


def busy_per_pass_s(size: str, layers: int, processes: int, seconds: float) -> float:
    """The median over `processes` processes computing the chain at once of their median busy time per pass."""
    context = mp.get_context("spawn")
    start, results = context.Event(), context.Queue()
    workers = [
        context.Process(target=_chain_worker, args=(size, layers, seconds, start, results), daemon=True)
        for _ in range(processes)
    ]
    for worker in workers:
        worker.start()
    try:
        time.sleep(1.0)
        start.set()  # the workers still building wait for it too: they start timing together
        found = [results.get(timeout=START_TIMEOUT_S + seconds) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    return statistics.median(found)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="tiny,small", help="models of the runtime benchmark")
    parser.add_argument("--layers", default="1,2,4,6", help="decoder layers per pass")
    parser.add_argument("--rounds", type=int, default=2, help="together timings per chain (each between alone ones)")
    parser.add_argument("--seconds", type=float, default=4.0, help="timing span of each measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "busy_stretch_by_layers.json")
    args = parser.parse_args()
    processes = 2 * host_cores()
    rows = []
    print(f"{'model':<6} {'layers':>6} {'alone ms':>9} {f'{processes} procs ms':>12} {'stretch':>8}")
    for size in args.models.split(","):
        for layers in (int(n) for n in args.layers.split(",")):
            alone = [busy_per_pass_s(size, layers, 1, args.seconds)]
            together = []
            for _ in range(args.rounds):
                together.append(busy_per_pass_s(size, layers, processes, args.seconds))
                alone.append(busy_per_pass_s(size, layers, 1, args.seconds))
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
