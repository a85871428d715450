"""One step of a local run as its processes share the host's cores: a fluid simulation of the schedule.

Every (family, stage, replica) of the strategy is an actor of TP processes that runs, in the runtime's order
(predictor.schedule.stage_order), its forward and backward passes; each pass computes (busy), then, on a group that
emulates a slower device, keeps computing for (1/speed - 1) times the wall time that took (the runtime's emulator is
timed by the wall clock), then waits for its TP collectives (asleep). A forward waits for the previous stage's forward
of the same micro-batch plus the boundary transfer, a backward for the next stage's backward. Each step starts with
making the batch (busy) and ends with the actor's exposed DP sync (its host work around a sync across families busy,
its transfers asleep), its optimizer step (busy) and, under ZeRO-1/2, the gather of the updated weight shards (asleep,
once its replicas have updated theirs: the runtime gathers after the update); an actor starts its sync once the actors
it syncs with have finished their passes: those holding some of the same layers (the replicas of its stage, and stages
of other families over common layers; with interleaving, the layers its chunks hold), as a rank's gradient collectives
wait for their partners only; its sync ends when theirs do (across families, a rank's sum waits for the other families'
ranks to send it theirs: on the benchmark's two-family runs, the TP pair's sync ended within 8% of a step of the TP 1
ranks', where syncing on its own it was simulated to end 12-23% of a step before). (The analytic model,
cost_model.evaluate, keeps one flush after every family's passes: where the simulation decides a local run's
prediction, a stage that finishes early syncs and steps early.)

A wait on the links (TP collectives, DP sync transfers) takes the time of the load while it waits: a link's time is
linear in the processes computing per core (Link.under_load, measured with busy processes beside the ranks), so the
wait runs between its time with the links unloaded (one process per core) and with every process busy, by the
processes computing or waiting on the links at each moment (`unloaded`: the evaluation with unloaded links). On the
benchmark's tiny two-family run, the TP pair's last backward, with the TP 1 ranks asleep in their sync, took 18 ms
where its loaded waits alone were 34 ms: a fixed loaded wait put that case 17-22% above the measured step. A rank in
a collective also computes (Gloo's reductions and copies: the link's measured CPU share of its unloaded time,
Link.cpu_share, 0.6 for 2-rank collectives on the benchmark host): it takes that share of a core, after the prompt
actors, from the processes computing beside it.

The busy processes share the cores: with n of them on C cores each computes at min(1, C / n) of a core, slowed by the
measured busy stretch of n processes computing at once (HostCosts.busy_stretch). Sleeping processes leave the cores to
the others. When the host's ranks outnumber its cores, every forward and backward also pays the measured cold start
of a pass after another process used its core (HostCosts.cold_forward_s, cold_backward_s): on the benchmark's 2-core
host with four ranks, a tiny stage's passes took 15% more CPU time than with two, a 10x stage's 1.5% more.
TP ranks are served first (`prompt`): they sleep in a collective after every fraction of a millisecond of compute,
so the scheduler owes them time and runs them ahead of the processes that never sleep, through their optimizer step
and sync too (the time owed carries over); prompt processes share the cores among themselves and the
others share what they leave. Not while they spin for a slower device's emulation: the emulator never sleeps, so it
is owed nothing and shares the cores with the others (on the benchmark's emulated two-family runs, the TP 1 ranks
computed their first forward at about half a core while the pair spun: 38 ms for 18 ms alone; served first, the
spinning pair left them no core for its whole first pass, 56 ms, and the small model's step was simulated 18-29%
above the measured). (On the benchmark's tiny two-family run, four processes on two cores, the TP pair's
compute took about 1.6x its time alone and the TP 1 ranks beside it about 2.1x: fair shares would slow both 2x.
Over the benchmark's six two-family cases, serving the pair first put the predictions within 12% of the measured
steps; fair shares, up to 26% below; serving it first only while it computes its passes, up to 17% below.) This is
what the analytic 1F1B formula cannot see: a rank that finishes early gives its core to those still computing, and
ranks that compute at the same time slow each other. Each actor's CPU time is counted as a run record measures a
rank's (per process: its share of a core while it computes or spins, its collectives' CPU share while it waits on the
links), so that a CPU-bound run's disagreement with the simulation has an address in CPU time too. Inputs are an
evaluation of the strategy with its compute unstretched (per micro-batch costs, transfers and syncs). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from predictor.context import CostContext
from profiler.profile import HostCosts
from specs.layout import PipelineStrategy, chunk_layer_counts

if TYPE_CHECKING:
    from predictor.evaluation import Evaluation

EPSILON_S = 1e-12
CPU_TERMS = ("tp_comm", "dp_sync", "optimizer")  # the measured CPU terms the simulation also accounts apart


@dataclass
class Phase:
    """A piece of an actor's step: `busy_s` of work at full speed, a `spin` of the emulator (spin_factor x the wall
    time the previous phase's work took), a `sleep_s` of wall time, or the `barrier` after the passes; it may first
    wait for a pass (`after`: family, replica, kind, micro-batch, model chunk) plus `delay_s`, and `finishes` the pass
    it completes."""

    busy_s: float = 0.0
    spin_factor: float = 0.0
    sleep_s: float = 0.0
    unloaded_share: float | None = None  # a wait on the links: its time unloaded / with every process busy
    barrier: str = ""  # "passes": waits for its partners' passes; "synced": for their syncs; "updated": for its
    # replicas' optimizer steps
    after: tuple[object, ...] | None = None
    delay_s: float = 0.0
    finishes: tuple[object, ...] | None = None
    wall_s: float = 0.0  # the wall time its work took
    kind: str = ""  # the run record's event it belongs to: batch, forward, backward, dp_sync or optimizer
    event: int = 0  # which of the actor's events (a pass's compute, spin and TP waits are one)


@dataclass
class Actor:
    """A (family, stage, replica): `processes` TP ranks running `phases` in order."""

    processes: int
    shares_host: bool
    phases: list[Phase]
    prompt: bool = False  # owed time by the scheduler, which serves it first (module docstring)
    layers: frozenset[int] = frozenset()  # the decoder layers it holds (-1: the embedding, tied to the LM head)
    partners: tuple[int, ...] = ()  # the actors it syncs gradients with, itself included
    where: tuple[int, int, int] = (0, 0, 0)  # family, stage position, replica
    position: int = 0
    state: str = "ready"  # ready, busy, spin, sleep, waiting, done
    remaining_s: float = 0.0
    started_s: float = 0.0
    unloaded_share: float | None = None  # of the sleep it is in (Phase.unloaded_share; None: not on the links)
    link_cpu_share: float = 0.0  # the share of its links' unloaded time a collective computes (Link.cpu_share)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds per process, by the run record's CPU terms

    def reached(self, barrier: str) -> bool:
        """It is at that barrier or past it (finished its passes, its sync or its optimizer step)."""
        return self.state == "done" or any(phase.barrier == barrier for phase in self.phases[: self.position + 1])


@dataclass(frozen=True)
class StepSimulation:
    time_s: float  # the step, from its start to the last actor's optimizer step
    mean_busy_processes: float  # processes computing or waiting for a core on the host, averaged over the step
    # traced: per actor, {"family", "stage", "replica", "events": [[kind, start s, end s], ...]} as the run record's
    # measured timeline lays out a rank's step (a wait for a neighbour before a pass is a "wait")
    timeline: tuple[dict[str, object], ...] = ()


def _actors(
    ctx: CostContext,
    evaluation: Evaluation,
    batch_s: float,
    host: HostCosts | None = None,
    unloaded: Evaluation | None = None,
) -> list[Actor]:
    from predictor.schedule import forward_share, stage_order

    strategy = evaluation.strategy
    v = strategy.virtual_stages
    cold = cold_starts(ctx, evaluation, host)
    actors = []
    for family, pipeline in enumerate(strategy.pipelines):
        indices = [i for i, s in enumerate(evaluation.stages) if s.family == family]
        p = len(indices)
        held = held_layers(pipeline, v, ctx.model.tied_embeddings)
        one_way = [evaluation.stages[i].p2p_time_s for i in indices]
        for position, index in enumerate(indices):
            evaluated = evaluation.stages[index]
            group = ctx.cluster.group(evaluated.stage.group)
            speed = group.emulate_speed
            compute = evaluated.compute_time_s - evaluated.tp_comm_time_s - evaluated.sharded_exposed_time_s
            waits = evaluated.tp_comm_time_s + evaluated.sharded_exposed_time_s
            alone = evaluated if unloaded is None else unloaded.stages[index]
            waits_share = _share(alone.tp_comm_time_s + alone.sharded_exposed_time_s, waits)
            share = forward_share(ctx, evaluation, index)
            prompt = evaluated.stage.tp > 1 and waits > EPSILON_S  # sleeps in a TP collective every layer
            actor_shares_host = group.device.key in ctx.host
            host_link = ctx.links.get(f"{group.device.key}/host")
            link_cpu_share = host_link.cpu_share if host_link is not None else 0.0
            for replica, microbatches in enumerate(pipeline.replica_microbatches()):
                phases = [Phase(busy_s=batch_s, kind="batch")]
                for event, (kind, j, k) in enumerate(stage_order(p, microbatches, v, position), start=1):
                    chunk = k * p + position
                    if kind == "forward":
                        after = (family, replica, "forward", j, chunk - 1) if chunk > 0 else None
                        delay = one_way[(chunk - 1) % p] if chunk > 0 else 0.0
                    else:
                        last = chunk == p * v - 1
                        after = None if last else (family, replica, "backward", j, chunk + 1)
                        delay = 0.0 if last else one_way[chunk % p]
                    busy = (share if kind == "forward" else 1 - share) * compute / v
                    # a group emulating a slower device computes the real part, then spins (1/speed - 1) x its wall
                    work = busy * speed + (cold[kind] if actor_shares_host else 0.0)
                    phases.append(Phase(busy_s=work, after=after, delay_s=delay, kind=kind, event=event))
                    if speed < 1.0:
                        phases.append(Phase(spin_factor=1.0 / speed - 1.0, kind=kind, event=event))
                    finishes = (family, replica, kind, j, chunk)
                    tp_wait = Phase(
                        sleep_s=waits / 2 / v, unloaded_share=waits_share, finishes=finishes, kind=kind, event=event
                    )
                    phases.append(tp_wait)
                sync = len(phases)
                phases.append(Phase(barrier="passes", kind="dp_sync", event=sync))
                phases.append(Phase(busy_s=evaluated.sync_host_time_s, kind="dp_sync", event=sync))  # indexing, copies
                gather = evaluated.gather_exposed_time_s
                exposed = evaluated.dp_exposed_time_s - evaluated.sync_host_time_s - gather
                exposed_share = _share(alone.dp_exposed_time_s - alone.sync_host_time_s - alone.gather_exposed_time_s,
                                       exposed)  # fmt: skip
                phases.append(Phase(sleep_s=exposed, unloaded_share=exposed_share, kind="dp_sync", event=sync))
                # its sync ends with its partners' (across families, it waits for theirs to send it their sums)
                phases.append(Phase(barrier="synced", kind="dp_sync", event=sync))
                phases.append(Phase(busy_s=evaluated.optimizer_time_s, kind="optimizer", event=sync + 1))
                if gather > EPSILON_S:  # ZeRO-1/2: the updated shards gathered once its replicas have updated theirs
                    phases.append(Phase(barrier="updated", kind="optimizer", event=sync + 1))
                    gather_share = _share(alone.gather_exposed_time_s, gather)
                    phases.append(Phase(sleep_s=gather, unloaded_share=gather_share, kind="optimizer", event=sync + 1))
                actors.append(
                    Actor(
                        evaluated.stage.tp,
                        actor_shares_host,
                        phases,
                        prompt,
                        held[position],
                        where=(family, position, replica),
                        link_cpu_share=link_cpu_share if actor_shares_host else 0.0,
                    )
                )
    for actor in actors:
        actor.partners = tuple(j for j, other in enumerate(actors) if actor.layers & other.layers)
    return actors


def _share(unloaded_s: float, loaded_s: float) -> float:
    """A link wait's time with the host unloaded as a share of its time with every process busy, in (0, 1]."""
    return min(1.0, max(EPSILON_S, unloaded_s) / loaded_s) if loaded_s > EPSILON_S else 1.0


def cold_starts(ctx: CostContext, evaluation: Evaluation, host: HostCosts | None) -> dict[str, float]:
    """The busy seconds each forward and backward pass adds when the host's ranks outnumber its cores: every pass
    then starts after other ranks computed on its core (it waited for a neighbour, or was preempted), with their data
    in its caches (HostCosts.cold_forward_s, cold_backward_s; none with a core per rank)."""
    ranks = sum(
        stage.stage.tp * len(evaluation.strategy.pipelines[stage.family].replica_microbatches())
        for stage in evaluation.stages
        if ctx.cluster.group(stage.stage.group).device.key in ctx.host
    )
    if host is None or ranks <= host.cores:
        return {"forward": 0.0, "backward": 0.0}
    return {"forward": host.cold_forward_s, "backward": host.cold_backward_s}


def held_layers(pipeline: PipelineStrategy, virtual_stages: int, tied_embeddings: bool) -> list[frozenset[int]]:
    """Per stage of the family, the decoder layers its model chunks hold (specs.layout.chunk_layer_counts: with
    interleaving a stage keeps its layer count, not its layer ids), and -1 for the embedding on the first chunk and,
    tied, on the last (their gradients are summed between the two stages)."""
    p, v = len(pipeline.stages), virtual_stages
    counts = chunk_layer_counts(pipeline, v)
    starts = [sum(counts[:c]) for c in range(p * v)]
    held: list[frozenset[int]] = []
    for position in range(p):
        chunks = [k * p + position for k in range(v)]
        layers = {layer for c in chunks for layer in range(starts[c], starts[c] + counts[c])}
        if 0 in chunks or (tied_embeddings and p * v - 1 in chunks):
            layers.add(-1)
        held.append(frozenset(layers))
    return held


def simulate_step(
    ctx: CostContext,
    evaluation: Evaluation,
    host: HostCosts,
    batch_s: float,
    trace: bool = False,
    unloaded: Evaluation | None = None,
) -> StepSimulation:
    """The step of `evaluation` (compute unstretched, links loaded by every process: `ctx.processes_per_core`) with
    its host processes sharing `host.cores` cores; each rank first makes the step's batch (`batch_s`, busy).
    `unloaded`: the same evaluation with the links unloaded, so that a wait on the links takes the time of the load
    while it waits (module docstring). `trace`: with every actor's events (StepSimulation.timeline)."""
    actors = _actors(ctx, evaluation, batch_s, host, unloaded)
    full_load = ctx.processes_per_core
    traced: list[list[tuple[tuple[str, int], float, float]]] = [[] for _ in actors]
    done: dict[tuple[object, ...], float] = {}
    now = 0.0
    busy_integral = 0.0
    stretches: dict[int, float] = {}  # busy stretch by processes computing at once
    for actor in actors:
        _advance(actor, actors, done, now)
    while True:
        moved = True
        while moved:  # a finished pass or an opened barrier may let waiting actors go on, and those others
            moved = False
            for actor in actors:
                if actor.state == "waiting":
                    where = actor.position
                    _advance(actor, actors, done, now)
                    moved = moved or actor.position != where or actor.state != "waiting"
        active = [a for a in actors if a.state in ("busy", "spin", "sleep")]
        if not active:
            if any(a.state == "waiting" for a in actors):
                raise RuntimeError("the step simulation is stuck: a pass waits for one that never runs")
            break
        computing = sum(a.processes for a in active if a.state in ("busy", "spin") and a.shares_host)
        if computing not in stretches:
            stretches[computing] = host.busy_stretch(computing) if computing else 1.0
        speeds, cores_used = _speeds(active, host.cores, stretches[computing], full_load)
        step = min(a.remaining_s / speed for a, speed in zip(active, speeds, strict=True) if speed > 0)
        busy_integral += computing * step
        for actor, used in zip(active, cores_used, strict=True):
            if used > 0:
                term = _cpu_term(actor)
                actor.cpu_s[term] = actor.cpu_s.get(term, 0.0) + used * step
        if trace:
            for actor, events in zip(actors, traced, strict=True):
                _extend(events, _event_of(actor), now, now + step)
        now += step
        for actor, speed in zip(active, speeds, strict=True):
            actor.remaining_s -= step * speed
        for actor in active:
            if actor.remaining_s <= EPSILON_S:
                if actor.state == "busy":
                    actor.phases[actor.position].wall_s = now - actor.started_s
                actor.state = "ready"
                _advance(actor, actors, done, now)
    timeline = _timeline(actors, traced) if trace else ()
    return StepSimulation(now, busy_integral / now if now > 0 else 0.0, timeline)


def _advance(actor: Actor, actors: list[Actor], done: dict[tuple[object, ...], float], now: float) -> None:
    """Start the actor's next piece of work, sleep or wait at `now`, skipping what is finished (`done`: when each
    finished pass ended)."""
    while actor.position < len(actor.phases):
        phase = actor.phases[actor.position]
        if phase.barrier:
            # once reached, for good; a weight gather waits for the replicas only (other families hold theirs)
            family = actor.where[0]
            waits_for = [j for j in actor.partners if phase.barrier != "updated" or actors[j].where[0] == family]
            if not all(actors[j].reached(phase.barrier) for j in waits_for):
                actor.state = "waiting"
                return
        elif phase.after is not None:
            if phase.after not in done:
                actor.state = "waiting"
                return
            ready = done[phase.after] + phase.delay_s
            phase.after = None
            if ready > now + EPSILON_S:
                actor.state, actor.remaining_s, actor.unloaded_share = "sleep", ready - now, None
                return
            continue
        elif phase.busy_s > EPSILON_S:
            actor.state, actor.remaining_s, actor.started_s = "busy", phase.busy_s, now
            phase.busy_s = 0.0
            return
        elif phase.spin_factor > 0:
            wall = actor.phases[actor.position - 1].wall_s * phase.spin_factor
            phase.spin_factor = 0.0
            if wall > EPSILON_S:
                actor.state, actor.remaining_s = "spin", wall
                return
            continue
        elif phase.sleep_s > EPSILON_S:
            actor.state, actor.remaining_s = "sleep", phase.sleep_s
            actor.unloaded_share = phase.unloaded_share
            phase.sleep_s = 0.0
            return
        if phase.finishes is not None:
            done[phase.finishes] = now
        actor.position += 1
    actor.state = "done"


def _speeds(active: list[Actor], cores: int, stretch: float, full_load: float) -> tuple[list[float], list[float]]:
    """How fast each active actor's piece goes, and the share of a core each of its processes takes meanwhile: busy
    ones at their share of the cores slowed by the busy `stretch` (prompt actors take the cores first, then the ranks
    in a collective what it computes, the others share what is left); waits on the links by the load
    (`_wait_speed`), computing their link's CPU share; other sleeps and spins at 1 (a spinning emulator takes its
    share of the cores as the other busy ones)."""
    sharing = [a for a in active if a.state in ("busy", "spin") and a.shares_host]
    computing = sum(a.processes for a in sharing)
    served_first = [a.prompt and a.state == "busy" for a in active]  # a spinning emulator is owed nothing
    first = sum(a.processes for a, is_first in zip(active, served_first, strict=True) if is_first and a.shares_host)
    on_links = [a for a in active if a.shares_host and a.state == "sleep" and a.unloaded_share is not None]
    load = max(1.0, (computing + sum(a.processes for a in on_links)) / cores)
    # a collective computes its link's CPU share of its unloaded time, spread over the time it takes now
    in_collectives = sum(a.processes * _collective_cpu(a, load, full_load) for a in on_links)
    prompt_share = min(1.0, cores / first) if first else 1.0
    left = max(0.0, cores - first - in_collectives)
    rest_share = min(1.0, left / (computing - first)) if computing > first else 1.0
    speeds, cores_used = [], []
    for actor, is_first in zip(active, served_first, strict=True):
        core_share = prompt_share if is_first else rest_share
        if actor.shares_host and actor.state == "busy":
            speeds.append(core_share / stretch)
            cores_used.append(core_share)
        else:
            speeds.append(_wait_speed(actor, load, full_load))
            spinning = actor.shares_host and actor.state == "spin"
            cores_used.append(core_share if spinning else _collective_cpu(actor, load, full_load))
    return speeds, cores_used


def _collective_cpu(actor: Actor, load: float, full_load: float) -> float:
    """The share of a core each process of an actor waiting on the links computes (Gloo's reductions and copies):
    its link's CPU share of the wait's unloaded time, spread over the time the wait takes under `load`."""
    if not actor.shares_host or actor.state != "sleep" or actor.unloaded_share is None:
        return 0.0
    return actor.link_cpu_share * actor.unloaded_share * _wait_speed(actor, load, full_load)


def _cpu_term(actor: Actor) -> str:
    """The run record's CPU term (runtime/launch.py `_measured_cpu`) the actor's CPU time falls in now: `tp_comm`,
    `dp_sync`, `optimizer`, or `compute` (the passes and making the batch)."""
    phase = actor.phases[actor.position]
    if phase.kind in ("forward", "backward") and actor.state == "sleep" and actor.unloaded_share is not None:
        return "tp_comm"
    return phase.kind if phase.kind in ("dp_sync", "optimizer") else "compute"


def _wait_speed(actor: Actor, load: float, full_load: float) -> float:
    """How fast a sleeping actor's wait on the links passes (1 for other sleeps and spins). A link's time is linear
    in its load (Link.under_load: processes computing per core, the communicating ones among them, at least one);
    here the processes computing or waiting on the links (whose collectives compute too) per core, from the wait's
    unloaded share at one per core to all of it at `full_load`, every process's."""
    share = actor.unloaded_share
    if actor.state != "sleep" or share is None or share >= 1.0 or full_load <= 1.0:
        return 1.0
    loaded_part = min(1.0, (load - 1.0) / (full_load - 1.0))
    return 1.0 / (share + (1.0 - share) * loaded_part)


def _timeline(
    actors: list[Actor], traced: list[list[tuple[tuple[str, int], float, float]]]
) -> tuple[dict[str, object], ...]:
    """Each actor's traced events as the run record writes them."""
    return tuple(
        {
            "family": actor.where[0],
            "stage": actor.where[1],
            "replica": actor.where[2],
            "events": [[kind, start, end] for (kind, _), start, end in events],
            # per process, as the run record's measured CPU terms: the whole step and the terms the simulation has
            "cpu_s": {"step": sum(actor.cpu_s.values())} | {t: actor.cpu_s.get(t, 0.0) for t in CPU_TERMS},
        }
        for actor, events in zip(actors, traced, strict=True)
    )


def _event_of(actor: Actor) -> tuple[str, int] | None:
    """The run record's event the actor is in now: its phase's, or a wait for a neighbour before a pass starts."""
    if actor.state == "done" or actor.position >= len(actor.phases):
        return None
    phase = actor.phases[actor.position]
    # a pass's compute phase (the one that finishes nothing) waits or sleeps only for its dependency
    if phase.kind in ("forward", "backward") and actor.state in ("waiting", "sleep") and phase.finishes is None:
        return ("wait", phase.event)
    return (phase.kind, phase.event)


def _extend(
    events: list[tuple[tuple[str, int], float, float]], event: tuple[str, int] | None, start: float, end: float
) -> None:
    if event is None or end - start <= EPSILON_S:
        return
    if events and events[-1][0] == event:  # an event's key never comes back once left
        events[-1] = (event, events[-1][1], end)
    else:
        events.append((event, start, end))
