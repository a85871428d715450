"""The search's settings in one place: how wide and how hard it looks, apart from the problem (CostContext)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ProgressCallback = Callable[[int, int], None]  # (done, total)


@dataclass(frozen=True)
class SearchOptions:
    """Solver settings of planner.search.search (the defaults are the shipped planner's).

    The result: `top_k` plans; `gap`: a candidate must beat the k-th best by this fraction to be solved (0: exact);
    `root_bound`: also prove the least iteration time of the whole space (SearchResult.lower_bound_s; about a second
    search's time on large clusters); `every_group`: only pipelines over every group (the family search's blocks: a
    block that leaves a group idle is another partition's business).
    """

    top_k: int = 1
    gap: float = 0.0
    root_bound: bool = False
    every_group: bool = False
    # interleaved candidates need at least as many micro-batches per replica as stages (an engine's rule:
    # Engine.interleaving_groups_of_stages, Megatron's)
    interleaving_groups_of_stages: bool = False
    # the best distinct candidates re-solved with a recompute mode per stage (0: none). One missed H100 + MI300X /
    # Llama-3-70B's best plan then: 9 stages with one recomputing (87.04 s), whose uniform-mode solution was the 3rd
    # best (recomputing everywhere); the search stopped at one candidate found it, the full search kept 87.47 s (the
    # shapes step below finds 85.99 s, 10 stages, two recomputing)
    per_stage_candidates: int = 4
    # ... then as many shapes again, best bound for per-stage plans first (the scan passes by a shape whose every
    # uniform plan loses: Llama-3 70B on 8 MI300X at ZeRO-3 kept 139.852 s, where 2 stages, one recomputing, take
    # 139.316 s), each in its pipeline orders that can hold the model, the least bottleneck first, at most
    # per_stage_orders of them (every order of four kinds); the shapes are found by tightening at most
    # per_stage_tightenings bounds (loose until tightened: four-vendor-256 / GPT-3 175B has 2,111 below its incumbent
    # on every group, at about 0.5 ms each; four-vendor-256 / Llama-3-70B's 24.37 s plan, 2.8% faster than the
    # scan's, is found from 709 on)
    per_stage_orders: int = 24
    per_stage_tightenings: int = 1024
    # `uneven_batch: exhaustive`: replica counts that do not divide the batch are tried where a group fits one more of
    # up to this many stages (deeper pipelines have long per-replica shares, where whole micro-batches round off little)
    uneven_max_stages_per_group: int = 8
    uneven_candidates: int = 8  # `uneven_batch: refine`: the best even candidates tried at nearby uneven replica counts
    # the per-order memory bounds are bisected keeping the side known infeasible (valid after any number of steps),
    # from the row's bottleneck to the slowest stage at its cap: 2^-12 of that bracket prunes as 2^-20 did (640 vs 638
    # candidates on four-vendor-256 / Llama-3-70B) at 0.7x the time on 8! orders
    order_bound_steps: int = 12
    root_bound_steps: int = 10  # the root bound's memory bisection: to 2^-10 of the bottleneck (it only reports)
    # the sources' whole-layer bottleneck, bisected keeping the side known too small (0: not tightened): 12, to 2^-12
    # of a layer's time, proves the bench plans with the candidates 24 did, the eight kinds' 19 idle-group subsets'
    # sources in 0.8x the time
    whole_layer_steps: int = 12
    # candidates solved before the branch and bound stops and reports the least bound left (SearchResult.note): many
    # distinct groups have orders by the k! with bounds too alike to prune (`plan --max-candidates`; of the bench
    # examples, four-vendor-256 / Llama-3-70B needs 640 to finish, the others at most 122). Stopped over every group,
    # the subsets that leave a group idle get as many again (four-vendor-256 / GPT-3 6.7B: the exact search's plan,
    # idle-group, after 18 more, where the work bound alone left 24.9% unproven)
    max_candidates: int = 2_000
    misfit_candidates: int = 20_000  # when nothing fits: candidates (best time bound first) searched for the closest
    # pipeline families (planner.families)
    plans_per_block: int = 3  # the best plans of each block offered to the batch split
    # the ZeRO stages each family of a family plan may run (its own per family; empty: the training's)
    family_zero_stages: tuple[int, ...] = ()
    refined_partitions: int = 2  # the best partitions whose blocks are searched again near the shares the split chose
    refined_per_stage_candidates: int = 2  # ... with per-stage recompute for this many of each block's best candidates


DEFAULT_OPTIONS = SearchOptions()
