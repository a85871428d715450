"""Search time and plan quality from 16 to 16,384 devices, 2-4 device types, 24-126 layers, against baselines that
use the same search and cost model but another layer-split rule, and against the best single device type.

Columns: search time of the plan; its iteration time; the fraction of HETHUB's upper bound (sum of each group's best
homogeneous tokens/s) and of the compute bound (every device busy at its profiled speed); the relaxation gap (plan
vs the smallest lower bound over the whole search space, the root of the branch and bound; `root s`: the time to
compute it, the search again keeping every row's bound); then each baseline's throughput relative to the plan.
Table + bench/results/search_scaling.json.

Run: python bench/search_scaling.py [--quick] [--families off|auto|search] [--many-groups]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from planner import build_context, compute_bounds  # noqa: E402
from planner.baselines import SPLITTERS  # noqa: E402
from planner.search import SearchOptions, search  # noqa: E402
from predictor.cost_model import CostContext  # noqa: E402
from specs import load_model, load_training  # noqa: E402
from specs.cluster import ClusterSpec, DeviceGroup  # noqa: E402
from specs.device import get_device  # noqa: E402
from specs.units import gbps_to_bytes_per_s  # noqa: E402

DEVICE_MIX = ["h100", "mi300x", "ascend-910b", "gaudi2"]  # four vendors, in this order
OLD_AND_NEW = ["a100-80gb", "v100"]
CASES = [
    # (devices, device types, model, global batch)
    (16, OLD_AND_NEW, "gpt3-1.7b", 128),
    (64, DEVICE_MIX[:2], "llama2-13b", 256),
    (256, DEVICE_MIX[:3], "llama2-70b", 1024),
    (1024, DEVICE_MIX[:3], "gpt3-175b", 2048),
    (1024, DEVICE_MIX, "llama-140b", 2048),
    (4096, DEVICE_MIX, "gpt3-175b", 4096),
    (16384, DEVICE_MIX[:2], "llama3-405b", 8192),
    (16384, DEVICE_MIX, "llama3-405b", 8192),
]
QUICK = {16, 64, 256, 1024}


def synthetic_cluster(devices: int, kinds: list[str]) -> ClusterSpec:
    """Equal shares of each device type, 8 devices and 8 NICs of 400 Gb/s per node, 200 Gb/s across groups."""
    nodes = devices // (8 * len(kinds))
    groups = tuple(
        DeviceGroup(
            name=kind,
            device=get_device(kind),
            nodes=nodes,
            devices_per_node=8,
            nics_per_node=8,
            nic_bw_bytes_per_s=gbps_to_bytes_per_s(400),
        )
        for kind in kinds
    )
    return ClusterSpec(f"synthetic-{devices}", groups, "rail-optimized", gbps_to_bytes_per_s(200))


def homogeneous_only_tokens_per_s(ctx: CostContext) -> tuple[float, str]:
    """The best plan on a single device type, using only that type's real devices (no scaling up)."""
    best, which = 0.0, "none fits"
    for group in ctx.cluster.groups:
        alone = build_context(ctx.cluster.only(group), ctx.model, ctx.training)
        result = search(alone)
        if result.evaluations and result.evaluations[0].tokens_per_s > best:
            best, which = result.evaluations[0].tokens_per_s, group.name
    return best, which


MANY_GROUPS = [
    # (name, device types, groups per type, nodes per group, model, global batch)
    ("16 groups: 4 types x 4 racks", DEVICE_MIX, 4, 8, "llama-140b", 2048),
    (
        "8 distinct types",
        ["h100", "mi300x", "ascend-910b", "gaudi2", "a100-80gb", "mi250x", "l40s", "v100"],
        1,
        4,
        "llama2-70b",
        1024,
    ),
]

# one case in a fresh process: its search time, peak memory and what the search says it did not cover
MANY_PROBE = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/bench")
from search_scaling import many_groups_cluster
from planner import build_context
from planner.search import search
from specs import load_model, load_training
kinds, per_kind, nodes, model, batch = json.loads(sys.argv[2])
cluster = many_groups_cluster(kinds, per_kind, nodes)
dtype = "fp16" if "v100" in kinds or "l40s" in kinds else "bf16"
ctx = build_context(cluster, load_model(model), load_training(None, {"global_batch_size": batch, "dtype": dtype}))
started = time.perf_counter()
result = search(ctx)
elapsed = time.perf_counter() - started
best = result.evaluations[0] if result.evaluations else None
print(json.dumps({"groups": len(cluster.groups), "devices": cluster.num_devices, "search_time_s": elapsed,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    "iteration_time_s": best.iteration_time_s if best else None, "evaluated": result.evaluated, "note": result.note}))
"""


def many_groups_cluster(kinds: list[str], per_kind: int, nodes: int) -> ClusterSpec:
    """`per_kind` groups (racks) of `nodes` nodes of each device type, 8 devices and NICs of 400 Gb/s per node."""
    groups = tuple(
        DeviceGroup(f"{kind}-{i}", get_device(kind), nodes, 8, 8, gbps_to_bytes_per_s(400))
        for kind in kinds
        for i in range(per_kind)
    )
    return ClusterSpec(f"racks-{len(groups)}", groups, "rail-optimized", gbps_to_bytes_per_s(200))


def many_groups() -> None:
    """Clusters of many groups, each in a fresh process (peak memory is per process)."""
    import subprocess

    rows = []
    for name, kinds, per_kind, nodes, model, batch in MANY_GROUPS:
        args = json.dumps([kinds, per_kind, nodes, model, batch])
        done = subprocess.run(
            [sys.executable, "-c", MANY_PROBE, str(ROOT), args], capture_output=True, text=True, check=True
        )
        row = {"case": name, "model": model, **json.loads(done.stdout)}
        rows.append(row)
        print(
            f"{name:<30} {row['devices']:>6} devices {row['search_time_s']:>7.2f} s {row['peak_rss_mib']:>7.0f} MiB "
            f"iter {row['iteration_time_s']:.2f} s  {row['note']}",
            flush=True,
        )
    out = ROOT / "bench" / "results" / "search_scaling_many_groups.json"
    out.write_text(json.dumps({"rows": rows}, indent=2) + "\n")
    print(f"written {out.relative_to(ROOT)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="only the cases up to 1,024 devices")
    parser.add_argument(
        "--baselines-up-to",
        type=int,
        default=1024,
        help="run the baselines on cases up to this many devices (they search longer than the plan: their worse "
        "incumbents prune less)",
    )
    parser.add_argument(
        "--uneven-batch",
        choices=("off", "refine", "exhaustive"),
        default="off",
        help="replica counts that do not divide the batch (see TrainingSpec.uneven_batch)",
    )
    parser.add_argument(
        "--families",
        choices=("off", "auto", "search"),
        default="auto",
        help="pipeline families of different device mixes (see TrainingSpec.families)",
    )
    parser.add_argument(
        "--many-groups", action="store_true", help="clusters of many groups instead (16 racks, 8 types)"
    )
    args = parser.parse_args()
    if args.many_groups:
        many_groups()
        return
    name = "search_scaling" + ("_quick" if args.quick else "")
    name += "" if args.uneven_batch == "off" else f"_uneven_{args.uneven_batch}"
    name += {"auto": "", "search": "_families", "off": "_one_family"}[args.families]
    out = ROOT / "bench" / "results" / f"{name}.json"
    machine = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count()}
    rows = []
    header = (
        f"{'devices':>7} {'types':>5} {'model':<12} {'layers':>6} {'search s':>8} {'iter s':>8} {'of UB':>6} "
        f"{'of CB':>6} {'gap':>6} {'root s':>6} {'fam':>3} {'uniform':>8} {'FLOPs':>8} {'greedy':>8} {'homog.':>8}"
    )
    print(header)
    print("-" * len(header))
    for devices, kinds, model_key, batch in CASES:
        if args.quick and devices not in QUICK:
            continue
        model = load_model(model_key)
        dtype = "bf16" if all(get_device(kind).supports_bf16 for kind in kinds) else "fp16"
        options = {"global_batch_size": batch, "dtype": dtype, "uneven_batch": args.uneven_batch}
        training = load_training(None, {**options, "families": args.families})
        ctx = build_context(synthetic_cluster(devices, kinds), model, training)
        started = time.perf_counter()
        result = search(ctx)
        search_s = time.perf_counter() - started
        best = result.evaluations[0]
        started = time.perf_counter()  # the gap's root bound: the search again, keeping the least bound of every row
        rooted = search(ctx, SearchOptions(root_bound=True))
        root_s = time.perf_counter() - started
        assert rooted.lower_bound_s is not None and rooted.evaluations[0].strategy == best.strategy
        started = time.perf_counter()
        bounds = compute_bounds(ctx)
        bounds_s = time.perf_counter() - started
        baselines: dict[str, float] = {}
        baseline_s: dict[str, float] = {}
        homogeneous_group = ""
        if devices <= args.baselines_up_to:
            for name, splitter in SPLITTERS.items():
                started = time.perf_counter()
                other = search(ctx, splitter=splitter)
                baseline_s[name] = time.perf_counter() - started
                baselines[name] = other.evaluations[0].tokens_per_s / best.tokens_per_s if other.evaluations else 0.0
            homogeneous, homogeneous_group = homogeneous_only_tokens_per_s(ctx)
            baselines["homogeneous-only"] = homogeneous / best.tokens_per_s
        gap = (best.iteration_time_s - rooted.lower_bound_s) / best.iteration_time_s
        row = {
            "devices": devices,
            "device_types": kinds,
            "model": model_key,
            "layers": model.num_layers,
            "global_batch_size": batch,
            "search_time_s": search_s,
            "bounds_time_s": bounds_s,
            "root_bound_time_s": root_s,
            "iteration_time_s": best.iteration_time_s,
            "tokens_per_s": best.tokens_per_s,
            "mfu": best.mfu,
            "fraction_of_upper_bound": best.tokens_per_s / bounds.upper_bound_tokens_per_s,
            "upper_bound_scaled_groups": list(bounds.scaled_groups),
            "fraction_of_compute_bound": best.tokens_per_s / bounds.compute_bound_tokens_per_s,
            "relaxation_lower_bound_s": rooted.lower_bound_s,
            "relaxation_gap": gap,
            "families": len(best.strategy.pipelines),
            "family_partitions": result.family_partitions,
            "candidates": result.configurations,
            "evaluated": result.evaluated,
            "baseline_throughput_relative_to_plan": baselines,
            "baseline_search_time_s": baseline_s,
            "homogeneous_only_group": homogeneous_group,
        }
        rows.append(row)
        print(
            f"{devices:>7} {len(kinds):>5} {model_key:<12} {model.num_layers:>6} {search_s:>8.2f} "
            f"{best.iteration_time_s:>8.2f} {row['fraction_of_upper_bound']:>6.1%} "
            f"{row['fraction_of_compute_bound']:>6.1%} {gap:>6.1%} {root_s:>6.2f} {len(best.strategy.pipelines):>3} "
            + " ".join(
                f"{baselines[name]:>8.1%}" if name in baselines else f"{'-':>8}"
                for name in ("uniform", "datasheet-flops", "greedy", "homogeneous-only")
            ),
            flush=True,
        )
        out.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    print("baselines: throughput relative to the plan (100% = as fast; 0% = the rule found nothing that fits)")
    print(f"written {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
