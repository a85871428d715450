"""A rank dies mid-run on the cpu-hetero example: the survivors stop, the planner re-plans for three devices, the state
is resharded from the last checkpoint and training goes on along the same loss curve."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from planner.plan import LoadedPlan  # noqa: E402
from planner.planning import plan as make_plan  # noqa: E402
from runtime import checkpoint  # noqa: E402
from runtime.elastic import run_elastic, without_ranks  # noqa: E402
from runtime.execute import RunSettings, synthetic_batch  # noqa: E402
from runtime.launch import run_plan, summarize  # noqa: E402
from runtime.model import ReferenceModel  # noqa: E402
from specs.cluster import load_cluster  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402
from tests.test_runtime import MODEL  # noqa: E402

CLUSTER = load_cluster(Path(__file__).parent.parent / "examples" / "cpu-hetero.yaml")
TRAINING = TrainingSpec(global_batch_size=6, dtype="fp32", micro_batch_sizes=[1, 2])
SEED, STEPS, EVERY, DIES = 7, 6, 2, (3, 3)  # rank 3 (a `slow` device) dies as step 3 starts; checkpoints at 2, 4, 6


def test_without_ranks_shrinks_a_one_node_group_and_drops_a_node_of_a_larger_one():
    smaller, gone = without_ranks(CLUSTER, (3,))
    assert [(g.name, g.nodes, g.devices_per_node) for g in smaller.groups] == [("fast", 1, 2), ("slow", 1, 1)]
    assert gone == ["slow: device 1 of its node"]
    smaller, gone = without_ranks(CLUSTER, (2, 3))
    assert [g.name for g in smaller.groups] == ["fast"]
    two_nodes = load_cluster(Path(__file__).parent.parent / "examples" / "cpu-2x2.yaml")
    smaller, gone = without_ranks(two_nodes, (2,))
    assert [(g.nodes, g.devices_per_node) for g in smaller.groups] == [(1, 2)] and gone == ["cpu: node 1"]


def test_a_restart_takes_the_latest_complete_checkpoint_else_where_the_run_began(tmp_path):
    from runtime.elastic import _restart_point

    assert _restart_point(str(tmp_path / "none"), "") is None  # died before any save was committed: from the seed
    assert _restart_point(str(tmp_path), "/given/step-00000004") == Path("/given/step-00000004")
    (tmp_path / ".tmp-step-00000002").mkdir()  # a background save the dead rank 0 never committed
    assert _restart_point(str(tmp_path), "") is None
    for step in (2, 4):
        done = checkpoint.step_dir(tmp_path, step)
        done.mkdir()
        (done / checkpoint.METADATA_FILE).write_bytes(b"")
        (done / checkpoint.INFO_FILE).write_text("{}")
    assert _restart_point(str(tmp_path), "/given/step-00000004") == checkpoint.step_dir(tmp_path, 4)


def test_the_supervisor_reads_the_whole_progress_lines_of_ranks_that_died_and_clears_them(tmp_path):
    """A rank killed while writing its progress leaves half a line: the supervisor reads the whole ones."""
    from runtime.elastic import _progress_lines

    (tmp_path / "progress-0.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    (tmp_path / "progress-1.jsonl").write_text("")  # set up, no step finished
    assert _progress_lines(tmp_path) == [{"step": 1, "loss": 2.0, "rank": 0}]
    assert not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_rank_dies_the_job_replans_reshards_and_resumes_on_three_ranks(tmp_path):
    first = make_plan(CLUSTER, MODEL, TRAINING)
    plan = LoadedPlan(first.strategy, MODEL, TRAINING, "cpu-hetero plan")
    root = tmp_path / "checkpoints"
    settings = RunSettings(
        steps=STEPS, seed=SEED, dtype="fp64", timeout_s=60, checkpoint_dir=str(root), checkpoint_every=EVERY,
        checkpoint_keep=0, fail_at=DIES,
    )  # fmt: skip
    run = run_elastic(plan, CLUSTER, settings, max_restarts=1, out_dir=str(tmp_path / "out"))

    (event,) = run.interruptions
    assert event["lost_ranks"] == [3] and event["died_at_step"] == 3
    assert event["devices_before"] == 4 and event["devices_after"] == 3 and run.cluster.num_devices == 3
    assert event["resumed_from_step"] == EVERY and event["steps_lost"] == 1  # step 2 ran, was not saved
    assert 0 <= event["detect_s"] < 15 and event["stop_survivors_s"] < 25  # nothing waited for Gloo's 60 s timeout
    assert event["replan_s"] > 0 and 0 < event["reload_s"] < event["respawn_to_loaded_s"]
    assert event["throughput_before_samples_per_s"] > 0 and event["throughput_after_samples_per_s"] > 0
    assert run.plan.strategy != plan.strategy
    assert sorted(run.losses) == list(range(STEPS))

    # the same steps on the re-planned layout from the same checkpoint, uninterrupted
    reference_settings = RunSettings(steps=STEPS, seed=SEED, dtype="fp64", timeout_s=60,
                                     resume_from=str(checkpoint.step_dir(root, EVERY)))  # fmt: skip
    (tmp_path / "reference").mkdir()
    reference = run_plan(run.plan, run.cluster, reference_settings, str(tmp_path / "reference"))
    after = summarize(reference, STEPS - EVERY)["losses"]
    assert [run.losses[s] for s in range(EVERY, STEPS)] == pytest.approx(after, rel=1e-12)

    # and the whole curve, across the death and the re-plan, is one process's training with torch's AdamW
    model = ReferenceModel(MODEL, SEED).double()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    expected = []
    for step in range(STEPS):
        tokens = synthetic_batch(MODEL, TRAINING.global_batch_size, MODEL.seq_length, SEED, step)
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        expected.append(float(loss.detach()))
        optimizer.step()
        optimizer.zero_grad()
    assert [run.losses[s] for s in range(STEPS)] == pytest.approx(expected, rel=1e-9)
