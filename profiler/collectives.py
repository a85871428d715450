"""nccl-tests conventions for collectives (shared/reference/collectives.md), shared by the comm benchmark and the
predictor's link model: busbw = algbw x factor, and the latency steps of a ring algorithm."""

from __future__ import annotations


def bus_factor(collective: str, ranks: int) -> float:
    """nccl-tests busbw / algbw: 2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter, else 1."""
    if collective == "all_reduce":
        return 2 * (ranks - 1) / ranks
    if collective in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    return 1.0


def latency_steps(collective: str, ranks: int) -> int:
    """Sequential ring steps, each paying the link latency once."""
    if collective == "all_reduce":
        return 2 * (ranks - 1)
    if collective in ("all_gather", "reduce_scatter"):
        return ranks - 1
    return 1
