"""Learned link costs: alpha-beta per link class, and how they grow with the group size, from link profiles.

`hetplan profile-comm` writes `hetplan.links/1` files: measured (collective, ranks, size, time) points. Per link
class a positive linear model (scikit-learn, fitted for relative error) learns
    t = alpha * steps(c, n) + S * factor(c, n) * (beta_c + gamma * log2(n / 2))
over all collectives and group sizes (nccl-tests conventions: factor 2(n-1)/n for all-reduce, (n-1)/n for
reduce-scatter / all-gather; steps 2(n-1) or n-1), so busbw = 1/beta_c at two ranks and the per-byte time grows by
gamma/beta per doubling of ranks. Each collective measured at two sizes or more gets its own beta_c (the link's
bandwidth is all-reduce's, the others' differences `*_extra_s_per_byte`): in three link profiles of this project's
2-core host, one beta for all read Gloo's 4 MiB reduce-scatter between two local processes 37-48% short and its
all-reduce 22-38% long. Send/recv points get their own alpha and bandwidth.

Points measured with their mean time (what a rank waits per operation on average, which is what a step sums) are
fitted on it, else on the median. Points measured between local processes record how many processes computed per
core; each one beyond one per core (x = processes per core - 1) adds x * alpha_load per step and x * beta_load per
byte (and the same for send/recv), two more positive columns of the same fit. Points that timed their ranks' CPU
give the link's CPU share (`cpu_share`), from those with at most one process per core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field
from sklearn.linear_model import LinearRegression

from predictor.comm_model import Link, LinkClass
from profiler.collectives import bus_factor, latency_steps
from specs.device import get_device
from specs.errors import SpecError
from specs.loading import KIND_BY_SCHEMA, check_file_kind, read_mapping, validate

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


class LinkPoint(BaseModel):
    model_config = ConfigDict(extra="ignore")

    collective: Literal["all_reduce", "all_gather", "reduce_scatter", "send_recv"]
    ranks: int = Field(ge=2)
    size_bytes: float = Field(gt=0)
    time_s: float = Field(gt=0)
    correct: bool = True
    mean_time_s: float = Field(default=0.0, ge=0)  # 0: not measured
    processes_per_core: float = Field(default=1.0, gt=0)
    mean_cpu_time_s: float = Field(default=0.0, ge=0)  # a rank's CPU time per operation; 0: not measured

    @property
    def fitted_time_s(self) -> float:
        """The time the fit explains: the mean where it was measured, else the median."""
        return self.mean_time_s or self.time_s

    @property
    def load(self) -> float:
        """Processes per core beyond one."""
        return max(0.0, self.processes_per_core - 1.0)


class LinkFile(BaseModel):
    model_config = ConfigDict(extra="ignore")

    schema_: Literal["hetplan.links/1"] = Field(alias="schema")
    device: str | None = None
    backend: str | None = None
    link_class: LinkClass = "in_node"
    points: list[LinkPoint] = Field(min_length=2)


def load_link_points(path: str | Path) -> tuple[str, LinkClass, list[LinkPoint]]:
    """The device key, link class and measured points of a links file (class in_node unless it says; files
    without a device key are accepted only from Gloo on the CPU, i.e. device `cpu`)."""
    return link_points(read_mapping(Path(path)), str(path))


def link_points(data: dict[str, Any], source: str) -> tuple[str, LinkClass, list[LinkPoint]]:
    """`load_link_points` of a links file's data (`source`: the file, for messages)."""
    kind = KIND_BY_SCHEMA["hetplan.links"]
    if "schema" in data:  # (links files of Gloo on the CPU may have none)
        check_file_kind(data, source, f"{kind} (what `hetplan profile-comm` writes)", (kind,))
    data = dict(data)
    if "link_class" not in data:
        classes = {link.get("link_class") for link in data.get("links", []) if isinstance(link, dict)}
        if len(classes) == 1:
            data["link_class"] = classes.pop()
    parsed = validate(LinkFile, data, source)
    wrong = [p for p in parsed.points if not p.correct]
    if wrong:
        raise SpecError(source, "points", f"{len(wrong)} points are marked incorrect: re-measure the link")
    device = parsed.device or ("cpu" if parsed.backend == "gloo" else None)
    if device is None:
        raise SpecError(source, "device", 'expected the catalog key of the devices measured (e.g. "h100")')
    return get_device(device, source, "device").key, parsed.link_class, parsed.points


def _positive_relative_fit(design: np.ndarray, times: np.ndarray) -> np.ndarray:
    scale = np.where(design.max(axis=0) > 0, design.max(axis=0), 1.0)
    linear = LinearRegression(positive=True, fit_intercept=False)
    linear.fit(design / scale / times[:, None], np.ones_like(times))
    return linear.coef_ / scale


# the least share of a point's time the bytes must explain for the points to measure a bandwidth (a fit of flat times
# put 5e-25 s per byte: a bandwidth of 2e24 B/s, positive, so not refused)
MIN_BYTES_SHARE = 0.01


def fit_link(link_class: LinkClass, points: Sequence[LinkPoint], source: str = "links") -> tuple[Link, float]:
    """The fitted link and the fit's median relative error over the points."""
    collective = [p for p in points if p.collective in COLLECTIVES]
    if len(collective) < 2:
        raise SpecError(source, "points", "expected at least 2 all-reduce/all-gather/reduce-scatter points")
    times = np.array([p.fitted_time_s for p in collective])
    own = [c for c in COLLECTIVES if len({p.size_bytes for p in collective if p.collective == c}) >= 2]
    design, coefficients = _collective_fit(collective, times, own)
    zero = [c for c, beta in zip(own, coefficients[1 : 1 + len(own)], strict=True) if beta <= 0]
    if zero and len(zero) < len(own):  # a collective measured only where latency rules: the others' bytes
        own = [c for c in own if c not in zero]
        design, coefficients = _collective_fit(collective, times, own)
    alpha, *betas, gamma, load_alpha, load_beta = coefficients
    beta = betas[0]
    bytes_share = float(np.max(design[:, 1 : 1 + len(betas)] @ np.array(betas) / times))
    if beta <= 0 or bytes_share < MIN_BYTES_SHARE:
        raise SpecError(source, "points", "the points show no size dependence: measure larger messages")
    extra = {c: float(b - beta) for c, b in zip(own, betas, strict=False)}  # none when one beta is all
    errors = list(np.abs(design @ coefficients - times) / times)
    p2p_alpha = p2p_bw = None
    p2p_load_alpha = p2p_load_beta = 0.0
    p2p = [p for p in points if p.collective == "send_recv"]
    if len(p2p) >= 2:
        p2p_times = np.array([p.fitted_time_s for p in p2p])
        p2p_design = np.array([(1.0, p.size_bytes, p.load, p.size_bytes * p.load) for p in p2p])
        p2p_coefficients = _positive_relative_fit(p2p_design, p2p_times)
        a, b, load_a, load_b = p2p_coefficients
        # no size dependence (latency-bound points): the latency still holds; bytes go at the collectives' rate
        sized = b > 0 and float(np.max(p2p_design[:, 1] * b / p2p_times)) >= MIN_BYTES_SHARE
        p2p_alpha, p2p_bw = float(a), float(1 / b) if sized else None
        p2p_load_alpha, p2p_load_beta = float(load_a), float(load_b)
        errors += list(np.abs(p2p_design @ p2p_coefficients - p2p_times) / p2p_times)
    link = Link(
        link_class,
        bw_bytes_per_s=float(1 / beta),
        alpha_s=float(alpha),
        slowdown_per_doubling=float(gamma / beta),
        p2p_bw_bytes_per_s=p2p_bw,
        p2p_alpha_s=p2p_alpha,
        load_alpha_s=float(load_alpha),
        load_s_per_byte=float(load_beta),
        p2p_load_alpha_s=p2p_load_alpha,
        p2p_load_s_per_byte=p2p_load_beta,
        cpu_share=cpu_share(collective),
        all_gather_extra_s_per_byte=extra.get("all_gather", 0.0),
        reduce_scatter_extra_s_per_byte=extra.get("reduce_scatter", 0.0),
    )
    return link, float(np.median(errors))


def _collective_fit(points: Sequence[LinkPoint], times: np.ndarray, own: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The design and fitted coefficients (alpha, a per-byte time per collective in `own` (one for all when it is
    empty; collectives not in it share the first's), gamma, the load's alpha and per-byte time)."""
    rows = []
    for p in points:
        steps, volume = latency_steps(p.collective, p.ranks), p.size_bytes * bus_factor(p.collective, p.ranks)
        column = own.index(p.collective) if p.collective in own else 0
        volumes = [volume if i == column else 0.0 for i in range(max(1, len(own)))]
        rows.append((steps, *volumes, volume * math.log2(p.ranks / 2), steps * p.load, volume * p.load))
    design = np.array(rows)
    return design, _positive_relative_fit(design, times)


def cpu_share(points: Sequence[LinkPoint]) -> float:
    """The share of an unloaded collective's time its ranks compute (their summed CPU time over their summed mean
    time, over the points measured with at most one process per core that timed their CPU; 0 without any)."""
    timed = [p for p in points if p.mean_cpu_time_s > 0 and p.load == 0]
    if not timed:
        return 0.0
    return min(1.0, sum(p.mean_cpu_time_s for p in timed) / sum(p.fitted_time_s for p in timed))
