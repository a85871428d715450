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
    assert 0 <= event["detect_s"] < 5 and event["stop_survivors_s"] < 10  # nothing waited for Gloo's 60 s timeout
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


def _two_devices(tmp_path: Path, layers: int = 2) -> tuple[Path, Path]:
    """A plan of a small model on two local devices (one emulating half speed), through the CLI."""
    from tests.conftest import hetplan

    model = tmp_path / f"model-{layers}.yaml"
    model.write_text(
        f"num_layers: {layers}\nhidden_size: 64\nffn_hidden_size: 128\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
        "vocab_size: 256\nseq_length: 16\nmlp: swiglu\n"
    )
    groups = "".join(
        f"  - {{name: {name}, device: cpu, nodes: 1, devices_per_node: 1, nics_per_node: 1, nic_gbps: 10{extra}}}\n"
        for name, extra in (("fast", ""), ("slow", ", emulate_speed: 0.5"))
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"name: two\ngroups:\n{groups}network: {{topology: clos, inter_group_gbps: 10}}\n")
    training = tmp_path / "training.yaml"
    training.write_text("global_batch_size: 4\ndtype: fp32\nrecompute: [none]\nzero_stage: 0\nmicro_batch_sizes: [1]\n")
    plan = tmp_path / f"plan-{layers}.json"
    made = hetplan("plan", "--cluster", str(cluster), "--model", str(model), "--training", str(training),
                   "--out", str(plan), "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    return plan, cluster


@pytest.mark.slow
def test_hetplan_run_survives_a_lost_rank_and_refuses_bad_resumes_in_one_line(tmp_path):
    """hetplan run --checkpoint-dir --max-restarts with an injected death: the record tells the interruption; then
    resuming from a finished, another model's or an incomplete checkpoint is one line and exit 2, before any
    process starts."""
    import json
    import shutil

    from tests.conftest import hetplan

    plan, cluster = _two_devices(tmp_path)
    record_path, root = tmp_path / "run.json", tmp_path / "ck"
    ran = hetplan("run", str(plan), "--cluster", str(cluster), "--steps", "4", "--out", str(record_path),
                  "--checkpoint-dir", str(root), "--checkpoint-every", "2", "--max-restarts", "1",
                  "--inject-failure", "1:3", "--timeout", "60", "--quiet", torch_allowed=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    record = json.loads(record_path.read_text())
    (event,) = record["elastic"]["interruptions"]
    assert event["lost_ranks"] == [1] and event["devices_after"] == 1 and event["resumed_from_step"] == 2
    assert len(record["elastic"]["losses_by_step"]) == 4
    assert [g["name"] for g in record["cluster"]["groups"]] == ["fast"]  # the record is of the cluster that was left
    assert "interrupted: lost rank(s) 1 (slow: device 0 of its node) as step 4 started" in ran.stdout

    def refused(*args: str) -> str:
        out = hetplan("run", *args, "--cluster", str(cluster), "--out", str(tmp_path / "x.json"), torch_allowed=True)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
        return out.stderr

    assert "at step 4: ask for more --steps" in refused(str(plan), "--resume", str(root), "--steps", "4")
    other, _ = _two_devices(tmp_path, layers=3)
    error = refused(str(other), "--resume", str(root), "--steps", "6")
    assert f"{checkpoint.step_dir(root, 4) / checkpoint.INFO_FILE}: model.num_layers" in error
    assert "another model" in error
    broken = tmp_path / "broken" / "step-00000004"
    shutil.copytree(checkpoint.step_dir(root, 4), broken)
    (broken / checkpoint.METADATA_FILE).unlink()
    assert ".metadata: missing: not a complete checkpoint" in refused(
        str(plan), "--resume", str(broken), "--steps", "6"
    )
    assert "no complete checkpoint" in refused(str(plan), "--resume", str(broken.parent), "--steps", "6")
    assert "no such checkpoint directory" in refused(str(plan), "--resume", str(tmp_path / "nowhere"), "--steps", "6")
