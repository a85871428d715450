"""Checkpoints saved under one plan load under another, bit for bit, and training continues on the same losses."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from profiler.comm_bench import free_port, run_processes  # noqa: E402
from runtime import checkpoint  # noqa: E402
from runtime.execute import RunJob, RunSettings, gathered_results, synthetic_batch  # noqa: E402
from runtime.launch import summarize  # noqa: E402
from runtime.model import ReferenceModel, piece_offsets  # noqa: E402
from specs.cluster import ClusterFile, resolve_cluster  # noqa: E402
from specs.errors import SpecError  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy  # noqa: E402
from tests.test_runtime import CLUSTER, MODEL  # noqa: E402

SEED, BATCH, STEPS_PER_PLAN = 5, 6, 2
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
FAST, SLOW = "fast", "slow"
# Each plan trains two steps from the previous plan's checkpoint and saves its own; every transition below is one
# of the save-under-A / load-under-B cases (the last two on a cluster of one group of four devices). The last
# three plans save in the background (DCP async_save), the first three synchronously
CHAIN: list[tuple[str, Strategy, object]] = [
    (
        "two families",  # the whole model at TP 2 on `fast`; layers 0-1 -> 2-4 on `slow`
        Strategy(
            (
                PipelineStrategy(1, 2, 2, (StageStrategy(FAST, 0, 5, 2, 0),)),
                PipelineStrategy(1, 1, 2, (StageStrategy(SLOW, 0, 2, 1, 0), StageStrategy(SLOW, 2, 5, 1, 1))),
            ),
            "none",
            0,
        ),
        CLUSTER,
    ),
    (
        "one family at TP 2",
        Strategy(
            (PipelineStrategy(1, 2, 3, (StageStrategy(FAST, 0, 2, 2, 0), StageStrategy(SLOW, 2, 5, 2, 0))),), "none", 0
        ),
        CLUSTER,
    ),
    (
        "PP 2 at TP 1, 2 replicas",
        Strategy(
            (PipelineStrategy(2, 1, 3, (StageStrategy(FAST, 0, 2, 1, 0), StageStrategy(SLOW, 2, 5, 1, 0))),), "none", 0
        ),
        CLUSTER,
    ),
    (
        "PP 3 of 1 + 2 + 2 layers, one device idle",
        Strategy(
            (
                PipelineStrategy(
                    1,
                    2,
                    3,
                    (StageStrategy(FAST, 0, 1, 1, 0), StageStrategy(FAST, 1, 3, 1, 1), StageStrategy(SLOW, 3, 5, 1, 0)),
                ),
            ),
            "none",
            0,
        ),
        CLUSTER,
    ),
    (
        "ZeRO-1 over 4 replicas",  # 6 samples as 2+2+1+1 micro-batches of 1
        Strategy((PipelineStrategy(4, 1, 2, (StageStrategy("cpu", 0, 5, 1, 0),), total_microbatches=6),), "none", 1),
        ONE_GROUP,
    ),
    (
        "ZeRO-1 over 3 replicas",  # the shards cut the flat vector at other places, inside rows of the tensors
        Strategy((PipelineStrategy(3, 1, 2, (StageStrategy("cpu", 0, 5, 1, 0),)),), "none", 1),
        ONE_GROUP,
    ),
]


def _chain_rank(rank: int, world: int, port: int, jobs: list[RunJob]) -> None:
    """Every plan of the chain in turn on one set of processes (a spawn costs far more than the training here):
    each job loads the previous job's checkpoint from disk through DCP, exactly as a fresh process would."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))  # fmt: skip
    try:
        for job in jobs:
            results = gathered_results(rank, job)
            if results is not None:
                Path(job.out_dir, "results.json").write_text(json.dumps(results), encoding="utf-8")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def chain(tmp_path_factory) -> Path:
    """Run the chain; plan i's out directory is root/i, its checkpoints root/checkpoints-i."""
    root = tmp_path_factory.mktemp("chain")
    jobs = []
    for i, (_, strategy, cluster) in enumerate(CHAIN):
        (root / str(i)).mkdir()
        settings = RunSettings(
            steps=STEPS_PER_PLAN * (i + 1), seed=SEED, dtype="fp64", timeout_s=60, dump_state=True,
            checkpoint_dir=str(root / f"checkpoints-{i}"), checkpoint_every=STEPS_PER_PLAN, checkpoint_async=i >= 3,
            resume_from=str(checkpoint.step_dir(root / f"checkpoints-{i - 1}", STEPS_PER_PLAN * i)) if i else "",
        )  # fmt: skip
        jobs.append(RunJob(cluster, MODEL, strategy, BATCH, MODEL.seq_length, settings, str(root / str(i))))
    run_processes(_chain_rank, (4, free_port(), jobs), 4, 600, "checkpoint chain")
    return root


def _whole(states: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole model's parameters and both moments from every rank's dump; every holder of an element agrees."""
    n = piece_offsets(MODEL)[-1]
    whole = [torch.full((n,), float("nan"), dtype=torch.float64) for _ in range(3)]
    for state in states:
        lo, hi = state["moments"]
        positions = state["positions"]
        for target, where, values in (
            (whole[0], positions, state["params"]),
            (whole[1], positions[lo:hi], state["exp_avg"]),
            (whole[2], positions[lo:hi], state["exp_avg_sq"]),
        ):
            seen = target[where]
            known = ~seen.isnan()
            assert torch.equal(seen[known], values[known]), "two holders of an element disagree"
            target[where] = values
    for tensor in whole:
        assert not tensor.isnan().any(), "an element of the model is held by no rank"
    return whole[0], whole[1], whole[2]


def _states(out: Path, tag: str) -> list[dict]:
    found = [torch.load(p) for p in sorted(out.glob(f"state-*-{tag}.pt"))]
    assert found, f"no state-*-{tag}.pt in {out}"
    return found


def _check_transition(chain: Path, i: int) -> None:
    """Plan i loaded plan i-1's checkpoint: every parameter and both Adam moments of every rank equal the saved
    state bit for bit (resharded to plan i's layout), the ranks hold the whole model between them, and the
    optimizer's step count came along."""
    saved_at = STEPS_PER_PLAN * i
    expected = _whole(_states(chain / str(i - 1), f"step{saved_at}"))
    loaded = _states(chain / str(i), "loaded")
    for state in loaded:
        lo, hi = state["moments"]
        assert state["optimizer_steps"] == saved_at
        assert torch.equal(state["params"], expected[0][state["positions"]])
        assert torch.equal(state["exp_avg"], expected[1][state["positions"][lo:hi]])
        assert torch.equal(state["exp_avg_sq"], expected[2][state["positions"][lo:hi]])
    assert all(torch.equal(a, b) for a, b in zip(_whole(loaded), expected, strict=True))
    results = json.loads((chain / str(i) / "results.json").read_text())
    assert all(r["first_step"] == saved_at for r in results)


pytestmark = pytest.mark.slow  # the chain runs 4 processes


def test_two_families_to_one_family(chain):
    _check_transition(chain, 1)


def test_tp2_to_tp1(chain):
    _check_transition(chain, 2)


def test_pp2_to_pp3_with_uneven_layers_and_an_idle_device(chain):
    _check_transition(chain, 3)


def test_checkpoint_moves_to_another_cluster(chain):
    _check_transition(chain, 4)


def test_zero1_with_4_replicas_to_3_replicas(chain):
    _check_transition(chain, 5)


def test_losses_across_five_replans_equal_one_uninterrupted_process(chain):
    """Twelve steps over six plans, each resumed from the previous one's checkpoint, against one process training
    the whole model with torch's AdamW for twelve steps: the same loss curve (fp64, different sum orders)."""
    losses = []
    for i in range(len(CHAIN)):
        results = json.loads((chain / str(i) / "results.json").read_text())
        losses += summarize(results, STEPS_PER_PLAN)["losses"]
    expected = _uninterrupted_losses(len(losses))
    assert losses == pytest.approx(expected, rel=1e-9)
    assert expected[-1] < expected[0]  # it trained: a resumption from fresh weights would not match


def _uninterrupted_losses(steps: int) -> list[float]:
    """One process training the whole model with torch's AdamW for `steps` steps: its losses."""
    reference = ReferenceModel(MODEL, SEED).double()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    expected = []
    for step in range(steps):
        tokens = synthetic_batch(MODEL, BATCH, MODEL.seq_length, SEED, step)
        loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        expected.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    return expected


def test_blocks_cover_column_shards_and_zero_slices_as_few_rectangles():
    table = checkpoint.global_tensors(MODEL)
    out = next(t for t in table if t.name == "layers.0.out.weight")  # (h, h): a TP-2 rank holds a column block
    h = MODEL.hidden_size
    rows, cols = np.meshgrid(np.arange(h), np.arange(h // 2, h), indexing="ij")
    positions = (out.start + rows * h + cols).reshape(-1)
    found = checkpoint.blocks(table, positions, np.arange(positions.size))
    assert found == [checkpoint.Block("layers.0.out.weight", (0, h // 2), (h, h // 2), 0)]
    # a ZeRO slice starting mid-row and ending mid-row of a whole tensor: a partial row, full rows, a partial row
    start, stop = out.start + 5, out.start + 3 * h + 7
    found = checkpoint.blocks(table, np.arange(start, stop), np.arange(stop - start))
    assert [(b.offsets, b.sizes) for b in found] == [((0, 5), (1, h - 5)), ((1, 0), (2, h)), ((3, 0), (1, 7))]
    assert sum(b.numel for b in found) == stop - start


def test_a_missing_or_interrupted_checkpoint_is_one_line(tmp_path):
    with pytest.raises(SpecError, match="no such checkpoint directory"):
        checkpoint.resolve(tmp_path / "nowhere")
    with pytest.raises(SpecError, match="no complete checkpoint"):
        checkpoint.resolve(tmp_path)
    interrupted = tmp_path / ".tmp-step-00000004"
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"")
    with pytest.raises(SpecError, match="no complete checkpoint"):  # a save that never committed is not a checkpoint
        checkpoint.resolve(tmp_path)
    with pytest.raises(SpecError, match=r"\.metadata: missing: not a complete checkpoint"):
        checkpoint.resolve(interrupted)
    # beside a complete checkpoint, a save that crashed after writing its data but before its metadata (or before the
    # rename) leaves that one the latest
    complete = checkpoint.step_dir(tmp_path, 2)
    complete.mkdir()
    (complete / checkpoint.METADATA_FILE).write_bytes(b"")
    (complete / checkpoint.INFO_FILE).write_text("{}")
    (interrupted / checkpoint.METADATA_FILE).write_bytes(b"")
    assert checkpoint.resolve(tmp_path) == complete
    half = checkpoint.step_dir(tmp_path, 6)  # a step directory without its description is not complete either
    half.mkdir()
    (half / checkpoint.METADATA_FILE).write_bytes(b"")
    assert checkpoint.resolve(tmp_path) == complete


@pytest.mark.parametrize(("mlp", "tied"), [("swiglu", False), ("gelu", False), ("gelu", True)])
def test_saved_names_are_the_whole_models_tensors(mlp, tied):
    """Each block a TP shard writes is the named tensor of the whole model at its offsets: the names are real (what
    another tool reading the checkpoint gets), for SwiGLU (gate and value rows) and GELU (biases, learned positions,
    a row-parallel bias held by TP rank 0 only); tied (GPT-2's), the last stage's output matrix is the token
    embedding's copy, and no head.output is saved."""
    from runtime.model import StageModule, seeded_pieces, shard_positions
    from runtime.tensor_parallel import TensorParallel

    model = MODEL.model_copy(update={"mlp": mlp, "tied_embeddings": tied})
    reference = ReferenceModel(model, SEED)
    whole = {"embedding.tokens": reference.tokens, "embedding.positions": reference.positions,
             "head.output": None if tied else reference.output}  # fmt: skip
    whole |= {
        f"layers.{i}.{name}": p for i, layer in enumerate(reference.layers) for name, p in layer.named_parameters()
    }
    whole |= {f"head.norm.{name}": p for name, p in reference.norm.named_parameters()}
    table = checkpoint.global_tensors(model)
    assert {t.name for t in table} == {name for name, p in whole.items() if p is not None}
    for start, end in ((0, 2), (2, model.num_layers)):
        first, last = start == 0, end == model.num_layers
        for k in range(2):
            tp = TensorParallel(None, 2, k)
            shard = StageModule(model, seeded_pieces(model, start, end, first, last, SEED), tp, "none")
            flat = torch.cat([p.detach().reshape(-1) for p in shard.parameters() if p.requires_grad])
            positions = shard_positions(model, start, end, first, last, tp, "none").numpy()
            found = checkpoint.blocks(table, positions, np.arange(positions.size))
            assert sum(b.numel for b in found) == flat.numel()
            assert ("embedding.tokens" in {b.name for b in found}) == (first or (last and tied))
            for block in found:
                expected = whole[block.name].detach()[
                    tuple(slice(o, o + n) for o, n in zip(block.offsets, block.sizes))
                ]
                assert torch.equal(
                    flat[block.local_start : block.local_start + block.numel].view(block.sizes), expected
                )


@pytest.mark.parametrize(
    ("strategy", "zero"),
    [
        # TP 2 -> TP 1: the last stage's whole copy of the matrix against the first stage's two vocabulary halves
        (Strategy((PipelineStrategy(1, 2, 3, (StageStrategy("fast", 0, 2, 2, 0), StageStrategy("slow", 2, 5, 1, 0))),),
                  "none", 0), False),
        # 2 replicas of 3 + 2 layers under ZeRO-1 (each replica writes the moments of its slice), 2 chunks per stage
        (Strategy((PipelineStrategy(2, 2, 2, (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0)),
                                    total_microbatches=3),), "none", 1, virtual_stages=2), True),
    ],
)  # fmt: skip
def test_a_tied_matrix_held_by_two_stages_is_written_once(strategy, zero):
    """A tied model's output matrix on a last stage is the token embedding's copy: only the first stage writes it
    (DCP takes duplicate shards silently: a saved checkpoint cannot tell)."""
    from runtime.execute import rank_roles
    from runtime.sync import chunk_bounds, rank_positions

    tied = MODEL.model_copy(update={"tied_embeddings": True})
    weights = np.zeros(piece_offsets(tied)[-1], dtype=int)
    moments = np.zeros_like(weights)
    copies = 0
    for role in rank_roles(CLUSTER, strategy).values():
        positions = rank_positions(tied, strategy, role.family, role.stage_index, role.tp_rank)
        replicas = strategy.pipelines[role.family].replicas
        lo, hi = chunk_bounds(positions.numel(), role.dp_index, replicas) if zero else (0, positions.numel())
        held = checkpoint.rank_holdings(
            tied, strategy, role.family, role.stage_index, role.dp_index, role.tp_rank, (lo, hi), zero
        )
        np.add.at(weights, held.positions[held.write_params], 1)
        np.add.at(moments, held.positions[lo:hi][held.write_moments], 1)
        copies += role.last and not role.first and bool((positions < tied.vocab_size * tied.hidden_size).any())
    assert copies  # a last stage held the matrix's copy
    assert weights.min() == weights.max() == 1 and moments.min() == moments.max() == 1


def test_a_checkpoint_of_the_untied_model_is_refused_for_the_tied_one(tmp_path):
    """A checkpoint records whether its model ties the embedding and output (a tied one has no head.output); one
    without that record was trained untied, as hetplan's runtime trained every model before it tied them."""
    tied = MODEL.model_copy(update={"tied_embeddings": True})
    saved = {"model_identity": checkpoint.model_identity(MODEL)}
    with pytest.raises(SpecError, match="the checkpoint trained an output matrix apart from the embedding, the plan's "
                                        "model ties its embedding and output"):  # fmt: skip
        checkpoint.check_model(saved, tied, tmp_path)
    del saved["model_identity"]["tied_embeddings"]  # an older checkpoint
    with pytest.raises(SpecError, match=r"hetplan-checkpoint\.json: model\.tied_embeddings: the checkpoint trained an"):
        checkpoint.check_model(saved, tied, tmp_path)
    checkpoint.check_model(saved, MODEL, tmp_path)
    with pytest.raises(SpecError, match="trained one matrix for both, the plan's model does not tie"):
        checkpoint.check_model({"model_identity": checkpoint.model_identity(tied)}, MODEL, tmp_path)


def test_a_plan_that_leaves_devices_idle_resumes_onto_the_same_losses(tmp_path):
    """Two stages on `fast`, `slow` idle: every rank writes the optimizer's step count and DCP keeps one rank's,
    here an idle one's, which wrote 0: the resumed run restarted Adam's bias correction (its fourth loss, the first
    after a resumed update, 0.5% off the uninterrupted run's). Two steps, saved, two more resumed: one process's."""
    from planner.plan import LoadedPlan
    from runtime.launch import run_plan
    from specs.training import TrainingSpec

    strategy = Strategy(
        (PipelineStrategy(1, 2, 3, (StageStrategy(FAST, 0, 2, 1, 0), StageStrategy(FAST, 2, 5, 1, 1))),), "none", 0
    )
    plan = LoadedPlan(strategy, MODEL, TrainingSpec(global_batch_size=BATCH, dtype="fp32"), "test plan")
    saved = RunSettings(steps=2, seed=SEED, dtype="fp64", timeout_s=60, checkpoint_dir=str(tmp_path / "checkpoints"),
                        checkpoint_every=2)  # fmt: skip
    first = run_plan(plan, CLUSTER, saved, str(tmp_path))
    assert sum(1 for r in first if r.get("idle")) == 2
    resumed = RunSettings(steps=4, seed=SEED, dtype="fp64", timeout_s=60,
                          resume_from=str(checkpoint.step_dir(tmp_path / "checkpoints", 2)))  # fmt: skip
    (tmp_path / "resumed").mkdir()
    second = run_plan(plan, CLUSTER, resumed, str(tmp_path / "resumed"))
    losses = summarize(first, 2)["losses"] + summarize(second, 2)["losses"]
    assert losses == pytest.approx(_uninterrupted_losses(4), rel=1e-9)
