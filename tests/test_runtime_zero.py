"""ZeRO-2 and ZeRO-3 in the runtime against one process: losses, step-0 gradients and final parameters of plans
with 2 DP replicas (uneven batches, pipeline stages, interleaving, TP 2, two families), what a ZeRO-3 rank holds
between steps, checkpoints that resume onto the same loss curve; and FP8 refused by the CPU runtime in one line."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from comm.plan_groups import stage_chunks  # noqa: E402
from profiler.comm_bench import free_port, run_processes  # noqa: E402
from runtime import checkpoint  # noqa: E402
from runtime.execute import RunJob, RunSettings, gathered_results, synthetic_batch  # noqa: E402
from runtime.launch import summarize  # noqa: E402
from runtime.model import ReferenceModel, StageModule, piece_offsets, seeded_pieces, tie_output  # noqa: E402
from runtime.sync import chunk_bounds  # noqa: E402
from runtime.tensor_parallel import TensorParallel  # noqa: E402
from runtime.zero import stage_units, trainable  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy  # noqa: E402
from specs.model import ModelSpec  # noqa: E402
from tests.test_checkpoint import ONE_GROUP  # noqa: E402
from tests.test_runtime import (  # noqa: E402
    BATCH,
    CLUSTER,
    MODEL,
    ODD_VOCAB,
    SEED,
    STEPS,
    TIED,
    compare_with_one_process,
)

pytestmark = pytest.mark.slow  # one set of 4 processes runs every plan below

FAST, SLOW = StageStrategy("fast", 0, 3, 1, 0, "full"), StageStrategy("slow", 3, 5, 1, 0, "selective")
SLOW_PLAIN = StageStrategy("slow", 3, 5, 1, 0)
# name -> (strategy, cluster); each trains STEPS steps from the seed, saves a checkpoint after the last one
PLANS: dict[str, tuple[Strategy, object]] = {
    # 3 + 2 layers, 2 replicas sharing 3 micro-batches of 2 as 2 + 1, full recompute on `fast`, selective on `slow`
    "zero2 uneven pp": (Strategy((PipelineStrategy(2, 2, 2, (FAST, SLOW), total_microbatches=3),), "none", 2), CLUSTER),
    "zero3 uneven pp": (Strategy((PipelineStrategy(2, 2, 2, (FAST, SLOW), total_microbatches=3),), "none", 3), CLUSTER),
    # the same with 2 chunks per stage: the replicas' schedules group their micro-batches differently
    "zero3 uneven interleaved": (
        Strategy(
            (PipelineStrategy(2, 2, 2, (StageStrategy("fast", 0, 3, 1, 0), SLOW_PLAIN), total_microbatches=3),),
            "selective",
            3,
            virtual_stages=2,
        ),
        CLUSTER,
    ),
    # the whole model at TP 2 in each of 2 replicas, 3 micro-batches of 1 each (vocabulary-parallel embedding/head)
    "zero3 tp2": (Strategy((PipelineStrategy(2, 1, 3, (StageStrategy("cpu", 0, 5, 2, 0),)),), "none", 3), ONE_GROUP),
    # family 0: 2 replicas of the whole model on `fast` sharing 3 samples as 2 + 1 (sharded); family 1: layers 0-1 ->
    # 2-4 on `slow`, 3 samples; gradients meet across families as shards
    "zero3 two families": (
        Strategy(
            (
                PipelineStrategy(2, 1, 2, (StageStrategy("fast", 0, 5, 1, 0),), total_microbatches=3),
                PipelineStrategy(1, 1, 3, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1))),
            ),
            "full",
            3,
        ),
        CLUSTER,
    ),
    # family 0 as above under ZeRO-2; family 1: the whole model at TP 2
    "zero2 two families tp2": (
        Strategy(
            (
                PipelineStrategy(2, 1, 2, (StageStrategy("fast", 0, 5, 1, 0),), total_microbatches=3),
                PipelineStrategy(1, 1, 3, (StageStrategy("slow", 0, 5, 2, 0),)),
            ),
            "none",
            2,
        ),
        CLUSTER,
    ),
    # a model tying its embedding and output (TIED): the whole model at TP 2 in each of 2 replicas, its LM head
    # computing with the embedding unit's matrix
    "tied zero3 tp2": (
        Strategy((PipelineStrategy(2, 1, 3, (StageStrategy("cpu", 0, 5, 2, 0),)),), "none", 3),
        ONE_GROUP,
    ),
    # the same with a vocabulary of 255: the TP ranks' units differ by a row (128 and 127 rows each)
    "odd vocab tied zero3 tp2": (
        Strategy((PipelineStrategy(2, 1, 3, (StageStrategy("cpu", 0, 5, 2, 0),)),), "none", 3),
        ONE_GROUP,
    ),
    # tied, 3 + 2 layers, 2 replicas: the last stage's copy of the matrix sharded as well
    "tied zero3 uneven pp": (
        Strategy((PipelineStrategy(2, 2, 2, (FAST, SLOW), total_microbatches=3),), "none", 3),
        CLUSTER,
    ),
    # tied, one stage of 2 chunks in each of 2 replicas: the head in chunk 1 gathers chunk 0's embedding unit
    "tied zero3 interleaved one stage": (
        Strategy((PipelineStrategy(2, 1, 3, (StageStrategy("cpu", 0, 5, 1, 0),)),), "none", 3, virtual_stages=2),
        ONE_GROUP,
    ),
    # tied: family 0 the matrix on its first stage and a copy on its last (the checkpoint writes it once), family 1 one
    # matrix per replica (sharded)
    "tied zero3 two families": (
        Strategy(
            (
                PipelineStrategy(1, 1, 3, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1))),
                PipelineStrategy(2, 1, 2, (StageStrategy("fast", 0, 5, 1, 0),), total_microbatches=3),
            ),
            "none",
            3,
        ),
        CLUSTER,
    ),
}
# name -> (plan whose checkpoint it loads, plan it runs under): 2 more steps each
RESUMED = {
    "zero3 resumed": ("zero3 uneven pp", "zero3 uneven pp"),
    "zero2 resumed under zero3 tp2": ("zero2 uneven pp", "zero3 tp2"),
    "tied resumed under two families": ("tied zero3 tp2", "tied zero3 two families"),
    "odd vocab resumed under two families": ("odd vocab tied zero3 tp2", "tied zero3 two families"),
}


def model_of(name: str) -> ModelSpec:
    return ODD_VOCAB if name.startswith("odd vocab") else TIED if name.startswith("tied") else MODEL


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The one-process references here are tiny: on a loaded machine, torch's second OpenMP thread only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_all(rank: int, world: int, port: int, jobs: list[RunJob]) -> None:
    """Every job in turn on one set of processes (a spawn costs more than these trainings)."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        for job in jobs:
            results = gathered_results(rank, job)
            if results is not None:
                Path(job.out_dir, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()


def _directory(root: Path, name: str) -> Path:
    return root / name.replace(" ", "-")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Every plan's run in root/<name>, its checkpoints in root/<name>/checkpoints."""
    root = tmp_path_factory.mktemp("zero")
    jobs = []
    for name, (strategy, cluster) in PLANS.items():
        out = _directory(root, name)
        out.mkdir()
        settings = RunSettings(
            steps=STEPS, seed=SEED, dtype="fp64", timeout_s=60, capture_gradients=True, dump_state=True,
            checkpoint_dir=str(out / "checkpoints"), checkpoint_every=STEPS,
        )  # fmt: skip
        jobs.append(RunJob(cluster, model_of(name), strategy, BATCH, MODEL.seq_length, settings, str(out)))
    for name, (saved, plan) in RESUMED.items():
        out = _directory(root, name)
        out.mkdir()
        strategy, cluster = PLANS[plan]
        resume = checkpoint.step_dir(_directory(root, saved) / "checkpoints", STEPS)
        settings = RunSettings(steps=2 * STEPS, seed=SEED, dtype="fp64", timeout_s=60, resume_from=str(resume))
        jobs.append(RunJob(cluster, model_of(name), strategy, BATCH, MODEL.seq_length, settings, str(out)))
    run_processes(_run_all, (4, free_port(), jobs), 4, 300, "ZeRO plans")
    return root


def _reference_training(steps: int, model: ModelSpec = MODEL) -> tuple[list[float], torch.Tensor]:
    """The whole model in this process with torch's AdamW: the losses, and the parameters after `steps` steps as
    one flat vector in piece order (the positions runtime.model.shard_positions gives)."""
    reference = ReferenceModel(model, SEED).double()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    losses = []
    for step in range(steps):
        tokens = synthetic_batch(model, BATCH, model.seq_length, SEED, step)
        loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    output = [] if model.tied_embeddings else [reference.output]
    ordered = [reference.tokens, *reference.layers.parameters(), *reference.norm.parameters(), *output]
    return losses, torch.cat([p.detach().reshape(-1) for p in ordered])


def _check_final_parameters(out: Path, expected: torch.Tensor, model: ModelSpec = MODEL) -> None:
    """Every rank's parameters after the last step (its dump at the checkpoint) against the expected whole model,
    and every element of the model held by some rank."""
    covered = torch.zeros(piece_offsets(model)[-1], dtype=torch.bool)
    dumps = sorted(out.glob(f"state-*-step{STEPS}.pt"))
    assert dumps, f"no state dumps in {out}"
    for path in dumps:
        state = torch.load(path)
        difference = (state["params"] - expected[state["positions"]]).abs().max().item()
        assert difference / expected.abs().max().item() < 1e-9, path.name
        covered[state["positions"]] = True
    assert covered.all(), "an element of the model is held by no rank"


@pytest.mark.parametrize("name", list(PLANS))
def test_zero_plan_matches_one_process(runs, name):
    """Both steps' losses and every rank's step-0 summed gradient (tests/test_runtime.py's tolerances), and the
    parameters after the last update, against one process with torch's AdamW."""
    strategy, _ = PLANS[name]
    out = _directory(runs, name)
    results = json.loads((out / "results.json").read_text())
    model = model_of(name)
    compare_with_one_process(strategy, results, out, model)
    _, expected = _reference_training(STEPS, model)
    _check_final_parameters(out, expected, model)
    assert not torch.equal(expected, _reference_training(0, model)[1])  # the updates moved the weights


def _unit_sizes(strategy: Strategy, result: dict, model: ModelSpec = MODEL) -> tuple[list[int], list[int]]:
    """Parameter elements of each unit (embedding, layer, head) of a rank's chunks: its own, and those a gather of
    it holds (a tied LM head's, with the embedding's matrix)."""
    pipeline = strategy.pipelines[result["family"]]
    stage = pipeline.stages[result["stage"]]
    modules = [
        StageModule(model, seeded_pieces(model, c.layer_start, c.layer_end, c.first, c.last, SEED),
                    TensorParallel(None, stage.tp, result["tp_rank"]), "none")
        for c in stage_chunks(pipeline, result["stage"], strategy.virtual_stages)
    ]  # fmt: skip
    tie_output(model, modules)
    embedding = modules[0].embedding
    embedding_elements = sum(p.numel() for p in trainable(embedding)) if embedding is not None else 0
    seen: set[int] = set()
    own, gathered = [], []
    for _, unit in stage_units(modules):
        params = trainable(unit)
        own.append(sum(p.numel() for p in params if id(p) not in seen))
        borrows = any(id(p) in seen for p in params)  # the tied matrix: the embedding unit comes along
        gathered.append(own[-1] + (embedding_elements if borrows else 0))
        seen.update(id(p) for p in params)
    return own, gathered


@pytest.mark.parametrize("name", [name for name in PLANS if PLANS[name][0].zero_stage == 3])
def test_zero3_ranks_hold_a_shard_of_their_weights_between_steps(runs, name):
    """After a step a sharded rank's memory holds its 1/dp chunk of the stage's parameters and nothing of the units'
    buffers; while computing it held one unit's full weights at a time."""
    strategy, _ = PLANS[name]
    results = json.loads((_directory(runs, name) / "results.json").read_text())
    sharded = 0
    for result in results:
        if result.get("idle"):  # a device the plan leaves idle
            continue
        pipeline = strategy.pipelines[result["family"]]
        if pipeline.replicas == 1:  # nothing to shard over: the whole stage
            assert result["held_parameter_elements"] == result["parameters"]
            continue
        sharded += 1
        lo, hi = chunk_bounds(result["parameters"], result["replica"], pipeline.replicas)
        assert result["held_parameter_elements"] == hi - lo < result["parameters"], result
        units, gathered = _unit_sizes(strategy, result, model_of(name))
        assert sum(units) == result["parameters"] and len(units) > 1
        assert result["peak_gathered_elements"] == max(gathered)
    assert sharded >= 2


def test_zero2_ranks_keep_their_whole_weights(runs):
    results = json.loads((_directory(runs, "zero2 uneven pp") / "results.json").read_text())
    assert all(r["held_parameter_elements"] == r["parameters"] for r in results)


@pytest.mark.parametrize("name", list(RESUMED))
def test_a_sharded_checkpoint_resumes_onto_the_same_losses(runs, name):
    """Two more steps from a ZeRO-3 checkpoint (under its own plan) and from a ZeRO-2 one (under a ZeRO-3 plan at
    TP 2): the loss curve of one process training four steps uninterrupted."""
    results = json.loads((_directory(runs, name) / "results.json").read_text())
    assert all(r["first_step"] == STEPS for r in results)
    model = model_of(name)
    expected, _ = _reference_training(2 * STEPS, model)
    losses = summarize(results, STEPS)["losses"]
    assert losses == pytest.approx(expected[STEPS:], rel=1e-9)
    # it trained: fresh weights would not give these losses on these batches
    fresh = ReferenceModel(model, SEED).double()
    batches = [synthetic_batch(model, BATCH, model.seq_length, SEED, step) for step in range(STEPS, 2 * STEPS)]
    untrained = [float(fresh(tokens[:, :-1], tokens[:, 1:]).detach()) for tokens in batches]
    assert losses != pytest.approx(untrained, rel=1e-6)


def test_fp8_is_refused_by_the_cpu_runtime_in_one_line_and_runs_in_bf16_when_asked(tmp_path):
    """`hetplan run` on an fp8 plan: one line on stderr naming the FP8 accelerators and the way out, exit 2, before
    any process starts (the library refuses it too); the way out, --dtype bf16, trains the plan's layout in bf16."""
    from planner.plan import load_plan
    from planner.planning import plan as make_plan
    from runtime.launch import run_plan
    from specs.cluster import load_cluster
    from specs.errors import SpecError
    from specs.training import TrainingSpec
    from tests.conftest import hetplan

    cluster = tmp_path / "cluster.yaml"
    groups = "".join(
        f"  - {{name: {name}, device: cpu, nodes: 1, devices_per_node: 1, nics_per_node: 1, nic_gbps: 10}}\n"
        for name in ("fast", "slow")
    )
    cluster.write_text(f"name: two\ngroups:\n{groups}network: {{topology: clos, inter_group_gbps: 10}}\n")
    training = TrainingSpec(global_batch_size=4, dtype="fp8", micro_batch_sizes=[1])
    plan = tmp_path / "plan.json"
    make_plan(load_cluster(cluster), MODEL.model_copy(update={"num_layers": 2}), training).save(plan)
    record = tmp_path / "run.json"
    refused = hetplan("run", str(plan), "--cluster", str(cluster), "--out", str(record), torch_allowed=True)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    for needed in ("fp8", "FP8-capable accelerator", "H100", "MI300X", "Gaudi2", "--dtype bf16"):
        assert needed in lines[0], lines[0]
    assert not record.exists()
    with pytest.raises(SpecError, match="FP8-capable accelerator"):
        run_plan(load_plan(plan), load_cluster(cluster), RunSettings(dtype="fp8"))

    ran = hetplan("run", str(plan), "--cluster", str(cluster), "--out", str(record), "--dtype", "bf16", "--steps",
                  "1", "--timeout", "60", "--quiet", torch_allowed=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    written = json.loads(record.read_text())
    assert written["measurements"]["dtype"] == "bf16" and written["training"]["dtype"] == "bf16"
    assert written["reference_match"]["match"], written["reference_match"]
