"""Checkpoints saved under one plan load under another, bit for bit, and training continues on the same losses."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from planner.plan import LoadedPlan  # noqa: E402
from runtime import checkpoint  # noqa: E402
from runtime.execute import RunSettings  # noqa: E402
from runtime.launch import run_plan, summarize  # noqa: E402
from runtime.model import piece_offsets  # noqa: E402
from specs.cluster import ClusterFile, resolve_cluster  # noqa: E402
from specs.errors import SpecError  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402
from tests.test_runtime import CLUSTER, MODEL  # noqa: E402

SEED, BATCH, STEPS, SAVED_AT = 5, 6, 4, 2
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


def _run(strategy: Strategy, cluster, out: Path, **settings) -> list[dict]:
    out.mkdir()
    plan = LoadedPlan(strategy, MODEL, TrainingSpec(global_batch_size=BATCH, dtype="fp32"), "test plan")
    run = RunSettings(steps=STEPS, seed=SEED, dtype="fp64", timeout_s=60, dump_state=True, **settings)
    return run_plan(plan, cluster, run, str(out))


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


def _save_a_load_b(a: Strategy, b: Strategy, tmp_path: Path, cluster_a=CLUSTER, cluster_b=CLUSTER) -> None:
    """Train A for 4 steps saving at 2 and 4; B loads step 2 and trains steps 2-3. B's loaded state equals A's at
    step 2 bit for bit (every parameter and both Adam moments, resharded), and B's losses equal A's."""
    root = tmp_path / "checkpoints"
    first = _run(a, cluster_a, tmp_path / "a", checkpoint_dir=str(root), checkpoint_every=SAVED_AT)
    saved = checkpoint.step_dir(root, SAVED_AT)
    assert checkpoint.resolve(root) == checkpoint.step_dir(root, STEPS)  # the latest complete one
    second = _run(b, cluster_b, tmp_path / "b", resume_from=str(saved))
    expected = _whole(_states(tmp_path / "a", f"step{SAVED_AT}"))
    loaded = _states(tmp_path / "b", "loaded")
    for state in loaded:
        lo, hi = state["moments"]
        assert state["optimizer_steps"] == SAVED_AT
        assert torch.equal(state["params"], expected[0][state["positions"]])
        assert torch.equal(state["exp_avg"], expected[1][state["positions"][lo:hi]])
        assert torch.equal(state["exp_avg_sq"], expected[2][state["positions"][lo:hi]])
    assert torch.equal(_whole(loaded)[0], expected[0])  # B's ranks hold the whole model between them
    assert all(r["first_step"] == SAVED_AT for r in second)
    losses_a = summarize(first, STEPS)["losses"]
    losses_b = summarize(second, STEPS - SAVED_AT)["losses"]
    assert losses_b == pytest.approx(losses_a[SAVED_AT:], rel=1e-10)
    assert losses_a[SAVED_AT] != pytest.approx(losses_a[0], rel=1e-6)  # the state moved: a stale load would fail


pytestmark = pytest.mark.slow  # every test here runs several processes


def test_pp2_to_pp3_with_uneven_layers_and_an_idle_device(tmp_path):
    a = Strategy(
        (PipelineStrategy(2, 1, 3, (StageStrategy("fast", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 0))),), "none", 0
    )
    stages = (StageStrategy("fast", 0, 1, 1, 0), StageStrategy("fast", 1, 3, 1, 1), StageStrategy("slow", 3, 5, 1, 0))
    b = Strategy((PipelineStrategy(1, 2, 3, stages),), "none", 0)
    _save_a_load_b(a, b, tmp_path)


def test_tp2_to_tp1(tmp_path):
    a = Strategy((PipelineStrategy(1, 2, 3, (StageStrategy("fast", 0, 2, 2, 0), StageStrategy("slow", 2, 5, 2, 0))),),
                 "none", 0)  # fmt: skip
    b = Strategy((PipelineStrategy(2, 1, 3, (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0))),),
                 "none", 0)  # fmt: skip
    _save_a_load_b(a, b, tmp_path)


def test_zero1_with_4_replicas_to_3_replicas(tmp_path):
    # 6 samples as 2+2+1+1 micro-batches of 1 over 4 ZeRO-1 shards, then 2+2+2 over 3: the shards cut the flat
    # vector at other places, inside rows of the tensors
    a = Strategy((PipelineStrategy(4, 1, 2, (StageStrategy("cpu", 0, 5, 1, 0),), total_microbatches=6),), "none", 1)
    b = Strategy((PipelineStrategy(3, 1, 2, (StageStrategy("cpu", 0, 5, 1, 0),)),), "none", 1)
    _save_a_load_b(a, b, tmp_path, ONE_GROUP, ONE_GROUP)


def test_two_families_to_one_family(tmp_path):
    # family 0: the whole model at TP 2 on `fast`; family 1: two stages on `slow`; then one family of 2 replicas of
    # 3 + 2 layers with ZeRO-1
    fast = PipelineStrategy(1, 2, 2, (StageStrategy("fast", 0, 5, 2, 0),))
    slow = PipelineStrategy(1, 1, 2, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1)))
    stages = (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0))
    b = Strategy((PipelineStrategy(2, 1, 3, stages),), "none", 1)
    _save_a_load_b(Strategy((fast, slow), "none", 0), b, tmp_path)


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
