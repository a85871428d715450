"""`hetplan run` with checkpoints and restarts through the command line: an injected death on two devices, and a bad
resume refused in one line before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")

from planner.planning import plan as make_plan
from runtime import checkpoint
from specs.training import TrainingSpec
from tests.test_runtime import MODEL


def _two_devices(tmp_path: Path) -> tuple[Path, Path]:
    """A plan of a 2-layer model on two local devices (one emulating half speed), written as `hetplan plan` does."""
    from specs.cluster import ClusterFile, resolve_cluster
    from specs.loading import read_mapping

    groups = "".join(
        f"  - {{name: {name}, device: cpu, nodes: 1, devices_per_node: 1, nics_per_node: 1, nic_gbps: 10{extra}}}\n"
        for name, extra in (("fast", ""), ("slow", ", emulate_speed: 0.5"))
    )
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(f"name: two\ngroups:\n{groups}network: {{topology: clos, inter_group_gbps: 10}}\n")
    spec = resolve_cluster(ClusterFile.model_validate(read_mapping(cluster)), str(cluster))
    model = MODEL.model_copy(update={"num_layers": 2})
    training = TrainingSpec(global_batch_size=4, dtype="fp32", zero_stage=0, micro_batch_sizes=[1])
    plan = tmp_path / "plan.json"
    make_plan(spec, model, training).save(plan)
    return plan, cluster


@pytest.mark.slow
def test_hetplan_run_survives_a_lost_rank_and_refuses_bad_resumes_in_one_line(tmp_path):
    """hetplan run --checkpoint-dir --max-restarts with an injected death: the record tells the interruption; a bad
    resume is one line and exit 2 before any process starts (the command once; each kind at the Python level)."""
    import json
    import shutil

    from specs.errors import SpecError
    from tests.conftest import hetplan

    plan, cluster = _two_devices(tmp_path)
    record_path, root = tmp_path / "run.json", tmp_path / "ck"
    ran = hetplan("run", str(plan), "--cluster", str(cluster), "--steps", "4", "--out", str(record_path),
                  "--checkpoint-dir", str(root), "--checkpoint-every", "2", "--max-restarts", "1",
                  "--inject-failure", "1:4", "--timeout", "60", "--quiet", torch_allowed=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    record = json.loads(record_path.read_text())
    (event,) = record["elastic"]["interruptions"]
    assert event["lost_ranks"] == [1] and event["devices_after"] == 1 and event["resumed_from_step"] == 2
    assert len(record["elastic"]["losses_by_step"]) == 4
    assert [g["name"] for g in record["cluster"]["groups"]] == ["fast"]  # the record is of the cluster that was left
    assert "interrupted: lost rank(s) 1 (slow: device 0 of its node) as step 4 started" in ran.stdout
    # the last attempt trained steps 3 and 4, step 3 its warm-up: the measurement is step 4's (it said "median of
    # steps 2-4")
    assert "(step 4)" in ran.stdout
    from predictor.runs import load_runs

    (run,) = load_runs(record_path)  # `validate` and `fit --runs` read it back (its `elastic` section was refused)
    assert [g.name for g in run.cluster.groups] == ["fast"] and run.measured_iteration_time_s > 0

    refused = hetplan("run", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "x.json"), "--resume",
                      str(root), "--steps", "4", torch_allowed=True)  # fmt: skip
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "at step 4: ask for more --steps" in refused.stderr
    resumed = hetplan("run", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "resumed.json"), "--resume",
                      str(root), "--steps", "6", "--timeout", "60", "--quiet", torch_allowed=True)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    (losses,) = [line for line in resumed.stdout.splitlines() if line.startswith("loss per step")]
    assert losses.startswith("loss per step from step 5 (resumed from step 4's checkpoint): ")
    assert len(losses.split(": ", 1)[1].split(", ")) == 2  # steps 5 and 6, numbered
    assert "loss not checked against one process: resumed from a checkpoint at step 4" in resumed.stdout
    # saving as it goes, 3 saves of which 2 stay: the summary names those on disk (it listed every save), and the
    # losses once, numbered (they were said twice)
    later = tmp_path / "later"
    saving = hetplan("run", str(plan), "--cluster", str(cluster), "--out", str(tmp_path / "saving.json"), "--resume",
                     str(root), "--steps", "7", "--checkpoint-dir", str(later), "--checkpoint-every", "1", "--timeout",
                     "60", "--quiet", torch_allowed=True)  # fmt: skip
    assert saving.returncode == 0, saving.stderr
    assert [int(p.name.removeprefix("step-")) for p in checkpoint.complete_checkpoints(later)] == [6, 7]
    assert "(steps 6, 7 on disk, the last attempt saved 5, 6, 7;" in saving.stdout
    (losses,) = [line for line in saving.stdout.splitlines() if line.startswith("loss per step")]
    assert losses.startswith("loss per step from step 5: ") and len(losses.split(": ", 1)[1].split(", ")) == 3

    model = MODEL.model_copy(update={"num_layers": 2})
    with pytest.raises(SpecError, match=r"hetplan-checkpoint.json: model.num_layers: .* another model"):
        checkpoint.check_resume(root, model.model_copy(update={"num_layers": 3}), 6)
    broken = tmp_path / "broken" / "step-00000004"
    shutil.copytree(checkpoint.step_dir(root, 4), broken)
    (broken / checkpoint.METADATA_FILE).unlink()
    with pytest.raises(SpecError, match=r"\.metadata: missing: not a complete checkpoint"):
        checkpoint.check_resume(broken, model, 6)
    with pytest.raises(SpecError, match="no complete checkpoint"):
        checkpoint.check_resume(broken.parent, model, 6)
    metadata = checkpoint.step_dir(root, 4) / checkpoint.METADATA_FILE
    with pytest.raises(SpecError, match=r"\.metadata: is a file: expected a checkpoint directory"):
        checkpoint.check_resume(metadata, model, 6)
    assert checkpoint.check_resume(root, model, 6)[0] == checkpoint.step_dir(root, 4)
