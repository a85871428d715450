"""Context parallelism in the runtime against one process: ring attention against torch's causal attention on the
whole sequence, and training runs with CP (pipeline stages, TP, replicas with uneven batches, ZeRO-1/2/3, interleaving,
two families, speed emulation) against the single-process reference; `hetplan run` of a CP plan.

Every multi-process part runs in one set of 4 spawned processes (a spawn costs far more than the work here)."""

from __future__ import annotations

import json
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from comm.plan_groups import stage_chunks  # noqa: E402
from profiler.comm_bench import free_port, run_processes  # noqa: E402
from runtime.checkpoint import step_dir  # noqa: E402
from runtime.context_parallel import ContextParallel, chunk_positions, ring_attention  # noqa: E402
from runtime.execute import RunJob, RunSettings, gathered_results, synthetic_batch  # noqa: E402
from runtime.launch import summarize  # noqa: E402
from runtime.model import ReferenceModel, StageModule, gradient_pieces  # noqa: E402
from runtime.tensor_parallel import TensorParallel  # noqa: E402
from specs.cluster import ClusterFile, resolve_cluster  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy, check_strategy  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from tests.test_runtime import CLUSTER, MODEL  # noqa: E402

pytestmark = pytest.mark.slow  # several processes
SEED, BATCH, STEPS, WORLD = 3, 6, 2, 4
GPT = MODEL.model_copy(update={"mlp": "gelu", "num_kv_heads": MODEL.num_attention_heads})  # learned positions
TIED_GPT = GPT.model_copy(update={"tied_embeddings": True})  # GPT-2's: one matrix for the embedding and the output
ONE_GROUP = resolve_cluster(
    ClusterFile.model_validate(
        {
            "name": "four-cpus",
            "groups": [
                {"name": "cpu", "device": "cpu", "nodes": 1, "devices_per_node": 4, "nics_per_node": 1, "nic_gbps": 10}
            ],
            "network": {"topology": "clos", "inter_group_gbps": 10},
        }
    ),
    "test",
)
EMULATED = replace(CLUSTER, groups=(CLUSTER.groups[0], replace(CLUSTER.groups[1], emulate_speed=0.5)))

# ring attention cases: (ring members, sequence length, heads, kv heads); the rings of two run side by side
RING_CASES = {
    "ring of 4, GQA": ((0, 1, 2, 3), 16, 4, 2),
    "ring of 4, MHA": ((0, 1, 2, 3), 16, 4, 4),
    "rings of 2, MQA": (((0, 1), (2, 3)), 12, 4, 1),
    "rings of 2, MHA": (((0, 1), (2, 3)), 8, 2, 2),
}


def _one_stage(group: str, tp: int) -> tuple[StageStrategy, ...]:
    return (StageStrategy(group, 0, MODEL.num_layers, tp, 0),)


# training runs: name -> (cluster, model, strategy)
RUNS: dict[str, tuple[Any, ModelSpec, Strategy]] = {
    # 3 + 2 layers over two groups, each stage's sequences over 2 CP ranks (each sends its tokens' activations to its
    # own CP rank of the next stage), ZeRO-3 over the dp-cp group (weights gathered from the other CP rank), selective
    # recompute repeating the ring, the slow group emulated at half speed (its repeated layer math must not touch the
    # ring)
    "two stages": (
        EMULATED,
        MODEL,
        Strategy(
            (
                PipelineStrategy(
                    1, 2, 3, (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0)), context_parallel=2
                ),
            ),
            "selective",
            3,
        ),
    ),
    # 2 replicas x CP 2 sharing 3 micro-batches of 2 (2 and 1), ZeRO-2 over the 4-rank dp-cp group, full recompute
    "zero-2, replicas, uneven": (
        ONE_GROUP,
        MODEL,
        Strategy(
            (PipelineStrategy(2, 2, 2, _one_stage("cpu", 1), total_microbatches=3, context_parallel=2),), "full", 2
        ),
    ),
    # TP 2 x CP 2 on one stage: a ring per TP rank over its heads (4 heads, 2 kv heads: one kv head per TP rank),
    # full recompute
    "tp2 x cp2": (
        ONE_GROUP,
        MODEL,
        Strategy((PipelineStrategy(1, 2, 3, _one_stage("cpu", 2), context_parallel=2),), "full", 0),
    ),
    # 2 replicas x CP 2 sharing 3 micro-batches of 2 (2 and 1), ZeRO-1 over 4 ranks, 2 interleaved chunks
    "replicas, uneven, interleaved": (
        ONE_GROUP,
        MODEL,
        Strategy(
            (PipelineStrategy(2, 2, 2, _one_stage("cpu", 1), total_microbatches=3, context_parallel=2),),
            "none",
            1,
            virtual_stages=2,
        ),
    ),
    # two families of a GPT-style model (learned positions at the chunks' global positions), 4 + 2 samples, CP 2
    # each: gradients meet across families as shards of the dp-cp groups, ZeRO-1
    "two families, gpt": (
        CLUSTER,
        GPT,
        Strategy(
            (
                PipelineStrategy(1, 2, 2, _one_stage("fast", 1), context_parallel=2),
                PipelineStrategy(1, 1, 2, _one_stage("slow", 1), context_parallel=2),
            ),
            "none",
            1,
        ),
    ),
    # the GPT-style model tying its embedding and output over two stages, CP 2 each: the last stage's copy of the
    # matrix meets the first stage's across the dp-cp groups, ZeRO-1
    "two stages, tied gpt": (
        CLUSTER,
        TIED_GPT,
        Strategy(
            (
                PipelineStrategy(
                    1, 2, 3, (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0)), context_parallel=2
                ),
            ),
            "none",
            1,
        ),
    ),
}


# a checkpoint chain, 2 steps per plan: saved by a CP plan (ZeRO-1 over 2 replicas x 2 CP ranks: each element
# written once), loaded by a plan without CP (TP 2 x 2 replicas, ZeRO-1), whose checkpoint a CP plan (TP 2 x CP 2)
# loads in turn
CHAIN: list[Strategy] = [
    RUNS["replicas, uneven, interleaved"][2],
    Strategy((PipelineStrategy(2, 1, 3, _one_stage("cpu", 2)),), "none", 1),
    RUNS["tp2 x cp2"][2],
]


def _ring_errors(rank: int, groups: dict[tuple[int, ...], dist.ProcessGroup]) -> dict[str, dict[str, float]]:
    """For each case, this rank's largest relative differences from causal SDPA on the whole sequence: output and
    the gradients of q, k, v (a random output gradient), and the output of attention over its own tokens only."""
    errors = {}
    for index, (name, (members, seq_length, heads, kv_heads)) in enumerate(RING_CASES.items()):
        ring = members if isinstance(members[0], int) else next(m for m in members if rank in m)
        torch.manual_seed(index)  # the same whole tensors on every rank
        q = torch.randn(2, heads, seq_length, 8, requires_grad=True)
        k = torch.randn(2, kv_heads, seq_length, 8, requires_grad=True)
        v = torch.randn(2, kv_heads, seq_length, 8, requires_grad=True)
        grad_out = torch.randn(2, heads, seq_length, 8)
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
        expected.backward(grad_out)
        cp = ContextParallel(groups[ring], len(ring), ring.index(rank), seq_length, timeout_s=60)
        mine = cp.positions
        local = [t.detach()[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*local, cp)
        out.backward(grad_out[:, :, mine])
        with cp.suppress():
            alone = ring_attention(*(t.detach() for t in local), cp)

        def error(got: torch.Tensor, want: torch.Tensor) -> float:
            return float((got - want).abs().max() / want.abs().max())

        errors[name] = {
            "out": error(out.detach(), expected.detach()[:, :, mine]),
            **{f"grad_{n}": error(t.grad, w.grad[:, :, mine]) for n, t, w in zip("qkv", local, (q, k, v), strict=True)},
            "own_tokens_only": error(alone, expected.detach()[:, :, mine]),
        }
    return errors


def _all_ranks(rank: int, port: int, out_dir: str, jobs: list[RunJob]) -> None:
    """The ring attention cases, then every training run in turn (each reads what the ones before it wrote), on one
    set of processes."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 1, 2, 3))}
        Path(out_dir, f"ring-{rank}.json").write_text(json.dumps(_ring_errors(rank, groups)), encoding="utf-8")
        for job in jobs:
            results = gathered_results(rank, job)
            if results is not None:
                Path(job.out_dir, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Path:
    """Run everything once; run i's out directory is root/i."""
    root = tmp_path_factory.mktemp("cp")
    settings = RunSettings(steps=STEPS, seed=SEED, dtype="fp64", capture_gradients=True, timeout_s=60)
    jobs = []
    for i, (cluster, model, strategy) in enumerate(RUNS.values()):
        check_strategy(strategy, cluster, model, BATCH)  # layouts the planner could have written
        (root / str(i)).mkdir()
        jobs.append(RunJob(cluster, model, strategy, BATCH, model.seq_length, settings, str(root / str(i))))
    for i, strategy in enumerate(CHAIN):
        check_strategy(strategy, ONE_GROUP, MODEL, BATCH)
        (root / f"chain{i}").mkdir()
        chained = RunSettings(
            steps=STEPS * (i + 1), seed=SEED, dtype="fp64", timeout_s=60, checkpoint_dir=str(root / f"saved{i}"),
            checkpoint_every=STEPS, resume_from=str(step_dir(root / f"saved{i - 1}", STEPS * i)) if i else "",
        )  # fmt: skip
        jobs.append(RunJob(ONE_GROUP, MODEL, strategy, BATCH, MODEL.seq_length, chained, str(root / f"chain{i}")))
    run_processes(_all_ranks, (free_port(), str(root), jobs), WORLD, 300, "context-parallel runs")
    return root


def test_chunks_of_causal_load_balancing():
    assert chunk_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert chunk_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert chunk_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    assert chunk_positions(5, 1, 0).tolist() == [0, 1, 2, 3, 4]
    held = torch.cat([chunk_positions(24, 3, c) for c in range(3)])
    assert sorted(held.tolist()) == list(range(24))
    with pytest.raises(ValueError, match="2 x 4"):
        chunk_positions(12, 4, 0)


@pytest.mark.parametrize("case", list(RING_CASES))
def test_ring_attention_matches_causal_attention_on_the_whole_sequence(ran, case):
    for rank in range(WORLD):
        errors = json.loads((ran / f"ring-{rank}.json").read_text())[case]
        for what in ("out", "grad_q", "grad_k", "grad_v"):
            assert errors[what] < 1e-5, (rank, what, errors)
        # the check can tell: attention over a rank's own tokens alone is wrong for every rank's second chunk
        assert errors["own_tokens_only"] > 1e-2, (rank, errors)


def _reference(model: ModelSpec, steps: int = STEPS) -> tuple[ReferenceModel, list[float]]:
    """`steps` steps of the whole model in this process with torch's AdamW; the model with step 0's gradients."""
    reference = ReferenceModel(model, SEED).double()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    losses, first_grads = [], {}
    for step in range(steps):
        tokens = synthetic_batch(model, BATCH, model.seq_length, SEED, step)
        loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    fresh = ReferenceModel(model, SEED).double()
    for name, p in fresh.named_parameters():
        p.grad = first_grads[name]
    return fresh, losses


@pytest.mark.parametrize("name", list(RUNS))
def test_context_parallel_run_matches_one_process(ran, name):
    """Both steps' losses (step 1's checks the update, ZeRO-1's too) and every rank's step-0 gradients after the
    dp-cp sync against the whole model in one process."""
    _, model, strategy = RUNS[name]
    out_dir = ran / str(list(RUNS).index(name))
    results = json.loads((out_dir / "results.json").read_text())
    reference, losses = _reference(model)
    assert summarize(results, STEPS)["losses"] == pytest.approx(losses, rel=1e-9)
    checked = set()
    for result in results:
        if result.get("idle"):
            continue
        pipeline = strategy.pipelines[result["family"]]
        stage = pipeline.stages[result["stage"]]
        chunks = stage_chunks(pipeline, result["stage"], strategy.virtual_stages)
        expected = {}
        for k, chunk in enumerate(chunks):
            pieces = gradient_pieces(reference, chunk.layer_start, chunk.layer_end, chunk.first, chunk.last)
            module = StageModule(model, pieces, TensorParallel(None, stage.tp, result["tp_rank"]), "none").double()
            prefix = f"chunk{k}." if len(chunks) > 1 else ""
            expected |= {prefix + n: p for n, p in module.named_parameters() if p.requires_grad}
        got = torch.load(out_dir / f"grads-{result['rank']}.pt")
        assert set(got) == set(expected)
        for param, grad in got.items():
            scale = expected[param].abs().max().item() + 1e-12
            assert (grad - expected[param]).abs().max().item() / scale < 1e-7, (result["rank"], param)
        checked.add((result["family"], result["stage"], result["replica"], result["cp_rank"], result["tp_rank"]))
    assert len(checked) == sum(p.stage_devices(s) for p in strategy.pipelines for s in p.stages)
    assert {c[3] for c in checked} == set(range(strategy.context_parallel))


def test_checkpoints_of_context_parallel_plans_load_under_other_plans(ran):
    """Six steps over three plans (CP -> no CP -> CP), each resumed from the previous one's checkpoint: the loss curve
    of one uninterrupted process (a rank that wrote a duplicate, missed or wrong shard would break it)."""
    losses = []
    for i in range(len(CHAIN)):
        results = json.loads((ran / f"chain{i}" / "results.json").read_text())
        assert all(r["first_step"] == STEPS * i for r in results)
        losses += summarize(results, STEPS)["losses"]
    _, expected = _reference(MODEL, STEPS * len(CHAIN))
    assert losses == pytest.approx(expected, rel=1e-9)
    assert expected[-1] < expected[0]


def test_runtime_refuses_sequences_that_do_not_cut_into_the_rings_chunks():
    from planner.plan import LoadedPlan
    from planner.what_if import check_runtime_layout
    from specs.errors import SpecError
    from specs.training import TrainingSpec

    strategy = Strategy((PipelineStrategy(1, 1, BATCH, _one_stage("cpu", 1), context_parallel=4),), "none", 0)
    check_runtime_layout(LoadedPlan(strategy, MODEL, TrainingSpec(global_batch_size=BATCH), "plan.json"))  # 16 = 8 x 2
    odd = TrainingSpec(global_batch_size=BATCH, seq_length=12)
    with pytest.raises(SpecError, match="2 x 4 equal chunks"):
        check_runtime_layout(LoadedPlan(strategy, MODEL, odd, "plan.json"))


def test_hetplan_run_of_a_context_parallel_plan(tmp_path):
    """plan --cp 2 -> run through the CLI on 2 local processes: the record keeps the CP degree, the loss matches one
    process."""
    from tests.conftest import hetplan

    (tmp_path / "model.yaml").write_text(
        "num_layers: 2\nhidden_size: 64\nffn_hidden_size: 128\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
        "vocab_size: 256\nseq_length: 256\nmlp: swiglu\n"
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(
        "name: two\ngroups:\n  - {name: cpu, device: cpu, nodes: 1, devices_per_node: 2, nics_per_node: 1, "
        "nic_gbps: 10}\nnetwork: {topology: clos, inter_group_gbps: 10}\n"
    )
    training = tmp_path / "training.yaml"
    training.write_text("global_batch_size: 4\ndtype: fp32\nrecompute: [none]\nzero_stage: 1\nmicro_batch_sizes: [1]\n")
    plan = tmp_path / "plan.json"
    made = hetplan("plan", "--cluster", str(cluster), "--model", str(tmp_path / "model.yaml"), "--training",
                   str(training), "--cp", "2", "--out", str(plan), "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    record_path = tmp_path / "run.json"
    ran = hetplan("run", str(plan), "--cluster", str(cluster), "--steps", "2", "--out", str(record_path),
                  "--timeout", "60", torch_allowed=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    record = json.loads(record_path.read_text())
    assert [p["context_parallel"] for p in record["strategy"]["pipelines"]] == [2]
    assert len(record["losses"]) == 2 and record["reference_match"]["match"], record["reference_match"]
    assert record["measured_iteration_time_s"] > 0 and record["predicted_iteration_time_s"] > 0
    # the predicted terms are the CP rank's (layer costs at micro-batch b/cp plus the ring): they add up to the step
    [stage] = record["measurements"]["terms"]
    assert sum(t["predicted_s"] for t in stage["terms"].values()) == pytest.approx(record["predicted_iteration_time_s"])


def test_every_element_of_a_context_parallel_plan_is_written_to_a_checkpoint_once():
    """The CP ranks of a replica hold the same weights (and, without ZeRO-1, moments) as its first: only the first of
    the dp-cp group writes them (DCP would take duplicates silently, so the chain above cannot tell)."""
    from runtime import checkpoint
    from runtime.execute import rank_roles
    from runtime.model import piece_offsets
    from runtime.sync import rank_positions

    strategy = RUNS["tp2 x cp2"][2]
    writes = np.zeros(piece_offsets(MODEL)[-1], dtype=int)
    for role in rank_roles(ONE_GROUP, strategy).values():
        numel = rank_positions(MODEL, strategy, role.family, role.stage_index, role.tp_rank).numel()
        held = checkpoint.rank_holdings(
            MODEL, strategy, role.family, role.stage_index, role.dp_index, role.tp_rank, (0, numel), False
        )
        np.add.at(writes, held.positions[held.write_params], 1)
        assert np.array_equal(held.write_moments, held.write_params)
    assert writes.min() == 1 and writes.max() == 1
