"""Re-planning: cluster changes parse strictly, the old plan is adapted when it still fits, and warm-starting never
changes the optimum."""

from __future__ import annotations

import json

import pytest

from planner import load_plan, plan
from planner.replan import CHANGE_FLAGS, adapt_strategy, cancelled_changes, changed_cluster, replan
from predictor.predictor import default_predictor
from specs import load_cluster, load_model, load_training
from specs.errors import SpecError
from tests.conftest import EXAMPLES

CLUSTER = EXAMPLES / "a100-v100-32.yaml"


def test_cluster_changes_parse_and_check():
    cluster = load_cluster(CLUSTER)
    smaller = changed_cluster(cluster, ["node:a100/1"], [])
    assert smaller.group("a100").nodes == 1 and smaller.num_devices == cluster.num_devices - 8
    assert [g.name for g in changed_cluster(cluster, ["group:v100:2"], []).groups] == ["a100"]
    assert changed_cluster(cluster, [], ["group:v100:3"]).group("v100").nodes == 5
    for without, add, message in (
        (["node:a100/2"], [], "nodes 0..1"),
        (["node:h100/0"], [], "no group 'h100'"),
        (["group:a100:3"], [], "only 2 nodes"),
        (["a100"], [], "expected node:GROUP/NUMBER or group:NAME:COUNT"),
        ([], ["node:a100/0"], "expected group:NAME:COUNT"),
        (["group:a100:2", "group:v100:2"], [], "no nodes would be left"),
    ):
        with pytest.raises(SpecError, match=message):
            changed_cluster(cluster, without, add)


@pytest.mark.parametrize(
    ("without", "add", "expected"),
    [
        (["group:v100:-1"], [], "--without: group:v100:-1: expected a count of nodes from 1 to 2 (the nodes group "
         "'v100' has), got -1"),
        (["group:v100:0"], [], "--without: group:v100:0: expected a count of nodes from 1 to 2 (the nodes group "
         "'v100' has), got 0"),
        ([], ["group:v100:-1"], "--add: group:v100:-1: expected a count of nodes of at least 1, got -1"),
        (["node:v100/-1"], [], "--without: node:v100/-1: group 'v100' has nodes 0..1"),
    ],
)  # fmt: skip
def test_a_negative_or_zero_count_of_nodes_is_named_with_the_counts_expected(without, add, expected):
    """`--without group:v100:-1` got the form's message ("expected node:GROUP/NUMBER or group:NAME:COUNT"), as if
    the form were wrong rather than the count."""
    with pytest.raises(SpecError) as caught:
        changed_cluster(load_cluster(CLUSTER), without, add, names=CHANGE_FLAGS)  # as `hetplan replan` says them
    assert str(caught.value) == expected


def test_changes_that_cancel_out_are_said_and_a_cluster_left_unchanged_is_refused():
    """`replan --add group:v100:1 --without group:v100:1` re-planned the very cluster of the plan without a word
    ("throughput +0.0%"). A failed node replaced by a new one is a change: the plan runs on other nodes (the new
    one numbered after the last), which the re-planned plan records for its launch."""
    cluster = load_cluster(CLUSTER)
    without, add = ["group:v100:1"], ["group:v100:1"]
    with pytest.raises(SpecError) as caught:
        cancelled_changes(cluster, changed_cluster(cluster, without, add), without, add)
    assert str(caught.value) == (
        "--without/--add: --without group:v100:1 and --add group:v100:1 cancel out (group v100 keeps its 2 nodes): "
        "the cluster is unchanged (nothing to re-plan)"
    )
    without = ["node:v100/0"]
    replaced = changed_cluster(cluster, without, add)
    assert replaced.group("v100").node_numbers == [1, 2] and replaced == cluster  # costs as before, other nodes
    assert cancelled_changes(cluster, replaced, without, add) == []
    without, add = ["group:v100:1", "node:a100/1"], ["group:v100:1"]  # the A100 node's loss stays
    assert cancelled_changes(cluster, changed_cluster(cluster, without, add), without, add) == [
        "--without group:v100:1 and --add group:v100:1 cancel out (group v100 keeps its 2 nodes)"
    ]
    without, add = ["group:v100:2"], ["group:v100:1"]  # one node fewer: no remark
    assert cancelled_changes(cluster, changed_cluster(cluster, without, add), without, add) == []


def test_replan_after_losing_a_node_equals_a_fresh_plan_and_is_warm_started():
    cluster = load_cluster(CLUSTER)
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    old = plan(cluster, model, training)
    smaller = changed_cluster(cluster, ["node:v100/0"], [])
    result = replan(smaller, model, training, old.strategy)
    fresh = plan(smaller, model, training)
    assert result.plan.evaluation.iteration_time_s == pytest.approx(fresh.evaluation.iteration_time_s, rel=1e-12)
    assert result.adapted is not None
    assert result.plan.evaluation.iteration_time_s <= result.adapted.iteration_time_s
    assert result.plan.search_stats["warm_started"] is True
    # a cluster the API changed (not a cluster file's as it is): its nodes alone, no claim that nothing changed
    assert old.search_stats["cluster_changes"] == [] and old.search_stats["cluster_nodes"]["v100"] == [0, 1]
    for changed in (fresh, result.plan):
        assert "cluster_changes" not in changed.search_stats and changed.search_stats["cluster_nodes"]["v100"] == [1]


def test_a_plan_made_for_an_engine_is_replanned_within_that_engine():
    """Planned for DeepSpeed (no TP, even batches, one family), then an A100 node is lost: the new plan is one
    DeepSpeed runs as planned and says so, where the unrestricted re-plan of the same plan uses TP 2."""
    from planner.engine_space import engine_lost
    from specs.engines import get_engine

    cluster = load_cluster(CLUSTER)
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    deepspeed = get_engine("deepspeed")
    old = plan(cluster, model, training, engine=deepspeed)
    smaller = changed_cluster(cluster, ["node:a100/0"], [])
    kept = replan(smaller, model, old.context.training, old.strategy, engine=deepspeed)
    assert engine_lost(kept.plan.strategy, deepspeed) == []
    assert kept.plan.search_stats["engine"] == "deepspeed" and kept.plan.search_stats["warm_started"] is False
    assert kept.plan.context.training.uneven_batch == "off"  # the plan records what DeepSpeed runs
    free = replan(smaller, model, old.context.training, old.strategy)
    assert engine_lost(free.plan.strategy, deepspeed) != []
    assert free.plan.evaluation.iteration_time_s <= kept.plan.evaluation.iteration_time_s
    # the old plan shrunk to the cluster, shown beside the new one, is said to be one the engine cannot run
    assert kept.adapted is not None
    assert list(kept.adapted_engine_lost) == engine_lost(kept.adapted.strategy, deepspeed)
    assert free.adapted_engine_lost == ()  # no engine to keep to


def test_an_engine_plan_shrunk_to_uneven_batches_is_said_to_be_one_the_engine_cannot_run():
    """Megatron plan on the 768-device example, two AMD nodes lost: the shrunk old plan splits the batch unevenly
    (28 replicas), which Megatron cannot run; the replan line said nothing, and the shrunk plan looked faster than
    the engine's new one for no reason given."""
    from planner.engine_space import engine_lost
    from report.replanning import replan_lines, replan_summary
    from specs.engines import get_engine

    cluster = load_cluster(CLUSTER.parent / "hethub-768.yaml")
    model = load_model("llama2-70b")
    megatron = get_engine("megatron")
    old = plan(cluster, model, load_training(None, {"global_batch_size": 768}), engine=megatron)
    (used,) = {s.group for s in old.strategy.pipelines[0].stages}  # Megatron's plan: one vendor's group
    smaller = changed_cluster(cluster, [f"group:{used}:2"], [])
    kept = replan(smaller, model, old.context.training, old.strategy, engine=megatron)
    assert kept.adapted is not None and kept.adapted.strategy.pipelines[0].uneven
    assert any(line.startswith("uneven batch shares") for line in kept.adapted_engine_lost)
    assert engine_lost(kept.plan.strategy, megatron) == []
    lines = replan_lines(replan_summary(cluster, smaller, old.evaluation, kept), kept.replan_time_s)
    said = next(i for i, line in enumerate(lines) if line.startswith("old plan shrunk to fit"))
    assert lines[said + 1].strip().startswith("which megatron cannot run as shrunk: uneven batch shares")


@pytest.mark.slow
def test_replan_command_keeps_the_plans_engine(tmp_path):
    from tests.conftest import hetplan

    made = hetplan("plan", "--cluster", str(CLUSTER), "--model", "gpt3-1.7b", "--global-batch", "64", "--dtype",
                   "fp16", "--engine", "deepspeed", "--out", str(tmp_path / "plan.json"), "--quiet")  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = hetplan("replan", str(tmp_path / "plan.json"), "--cluster", str(CLUSTER), "--without", "node:a100/0",
                     "--out", str(tmp_path / "new.json"), "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["engine"] == "deepspeed"
    assert json.loads((tmp_path / "new.json").read_text())["search"]["engine"] == "deepspeed"


def test_the_engine_a_plan_was_made_for_is_read_back(tmp_path):
    from planner.plan import load_plan
    from specs.engines import get_engine

    cluster = load_cluster(CLUSTER)
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    made = plan(cluster, load_model("gpt3-1.7b"), training, engine=get_engine("deepspeed"))
    made.save(tmp_path / "plan.json")
    assert load_plan(tmp_path / "plan.json").engine == "deepspeed"
    body = json.loads((tmp_path / "plan.json").read_text())
    body["search"]["engine"] = 3
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(SpecError, match="search.engine"):
        load_plan(tmp_path / "bad.json")


def test_adapted_plan_keeps_the_stages_with_fewer_replicas():
    cluster = load_cluster(CLUSTER)
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    old = plan(cluster, model, training).strategy
    smaller = changed_cluster(cluster, ["node:a100/0"], [])
    ctx = default_predictor().context(smaller, model, training)
    adapted = adapt_strategy(ctx, old)
    assert adapted is not None  # the plan is dp 16 x [a100 | v100]: dp 8 fits on one A100 node
    new_pipeline, old_pipeline = adapted.strategy.pipelines[0], old.pipelines[0]
    assert new_pipeline.replicas < old_pipeline.replicas
    assert [(s.group, s.layer_start, s.layer_end, s.tp) for s in new_pipeline.stages] == [
        (s.group, s.layer_start, s.layer_end, s.tp) for s in old_pipeline.stages
    ]
    assert adapted.fits


@pytest.mark.slow
def test_lost_nodes_keep_the_numbers_of_the_nodes_left():
    """`--without node:GROUP/N` names the cluster file's node N: the nodes left keep their numbers (a second loss is
    named by its number, not its new position), nodes added are numbered after the highest, `group:NAME:COUNT`
    takes the last ones."""
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    lost = changed_cluster(cluster, ["node:ascend/17"], [])
    assert lost.group("ascend").node_numbers == [*range(17), *range(18, 80)] and lost.group("amd").node_ids == ()
    again = changed_cluster(lost, ["node:ascend/18"], ["group:ascend:2"])
    assert again.group("ascend").node_numbers == [*range(17), *range(19, 82)]
    gone = r": node:ascend/17: group 'ascend' has nodes 0\.\.16, 18\.\.79$"
    with pytest.raises(SpecError, match=r"^changed_cluster\(\): without" + gone):  # the Python API's words
        changed_cluster(lost, ["node:ascend/17"], [])
    with pytest.raises(SpecError, match="^--without" + gone):  # `hetplan replan`'s (it said --without to Python too)
        changed_cluster(lost, ["node:ascend/17"], [], names=CHANGE_FLAGS)
    assert changed_cluster(lost, ["group:ascend:3"], []).group("ascend").node_numbers == [*range(17), *range(18, 77)]


def test_a_node_lost_in_an_earlier_replan_keeps_its_number():
    """A second re-plan that adds a node after the first lost the group's highest one: made from the cluster file
    with the first re-plan's recorded changes (`earlier`), the new node is numbered after the lost one; from the
    first re-plan's cluster alone, the lost node's number would be given again (a launch would name it)."""
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    first = [(["node:ascend/79"], [])]
    again = changed_cluster(cluster, [], ["group:ascend:1"], earlier=first)
    assert again.group("ascend").node_numbers == [*range(79), 80]
    without_history = changed_cluster(changed_cluster(cluster, ["node:ascend/79"], []), [], ["group:ascend:1"])
    assert without_history.group("ascend").node_numbers == [*range(80)]  # 79 again: what `earlier` prevents
    # a count taken from the tail and given back is the same group (the count, not the numbers, changed)
    back = changed_cluster(cluster, [], ["group:ascend:1"], earlier=[(["group:ascend:1"], [])])
    assert back.group("ascend").node_numbers == list(range(80))


def test_a_replanned_plan_read_with_another_cluster_file_is_refused_in_one_line(tmp_path):
    """The plan's node numbers name the machines of the file it was re-planned from: with a file whose group has
    other nodes (fewer here), its recorded changes leave other nodes than it records, and every command reading it
    says so in one line naming the file and the group, instead of running on nodes the file does not have."""
    from tests.conftest import hetplan, write_plan

    plan_path, replanned = tmp_path / "plan.json", tmp_path / "re.json"
    write_plan(plan_path, CLUSTER, "gpt3-1.7b", 64)
    result = hetplan("replan", str(plan_path), "-c", str(CLUSTER), "--without", "node:v100/1", "--out", str(replanned))
    assert result.returncode == 0, result.stderr
    bigger = tmp_path / "a100-v100-32.yaml"  # same name, a third V100 node
    bigger.write_text(CLUSTER.read_text().replace("device: v100\n    nodes: 2", "device: v100\n    nodes: 3"))
    for command in (("launch", str(replanned), "-c", str(bigger)), ("explain", str(replanned), "-c", str(bigger))):
        refused = hetplan(*command)
        assert refused.returncode == 2, refused.stdout
        line = refused.stderr.strip()
        assert "\n" not in line and line.startswith(f"hetplan: error: {bigger}: groups.v100.nodes: "), line
        assert (
            "runs group 'v100' on nodes 0 (search.cluster_nodes); made again on this file's 3 nodes, its recorded "
            "changes leave 0, 2" in line
        )
        assert "not the cluster it was re-planned from" in line and "older hetplan" not in line  # (nothing added)
    smaller = tmp_path / "small" / "a100-v100-32.yaml"
    smaller.parent.mkdir()
    smaller.write_text(CLUSTER.read_text().replace("device: v100\n    nodes: 2", "device: v100\n    nodes: 1"))
    refused = hetplan("replan", str(replanned), "-c", str(smaller), "--add", "group:v100:1")
    said = "re-planned with --without node:v100/1, which does not apply here: group 'v100' has nodes 0 "
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    assert hetplan("launch", str(replanned), "-c", str(CLUSTER)).returncode == 0  # the file it was re-planned from


def test_a_plan_read_with_a_cluster_file_whose_groups_changed_since_it_was_planned_is_refused(tmp_path):
    """A plan records the cluster file's nodes as planned (no changes yet): a file whose group has grown since was
    taken silently (launch started a node the plan leaves idle), one with a group added too. Both are refused in one
    line naming the file and group; the file it was planned on, and a plan recording neither (from before), run."""
    from tests.conftest import hetplan, write_plan

    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, CLUSTER, "gpt3-1.7b", 64)
    body = json.loads(plan_path.read_text())
    search = body["search"]
    assert search["cluster_changes"] == [] and search["cluster_nodes"] == {"a100": [0, 1], "v100": [0, 1]}
    bigger = tmp_path / "a100-v100-32.yaml"
    bigger.write_text(CLUSTER.read_text().replace("device: v100\n    nodes: 2", "device: v100\n    nodes: 3"))
    added = tmp_path / "added" / "a100-v100-32.yaml"
    added.parent.mkdir()
    extra = "  - {name: extra, device: v100, nodes: 1, devices_per_node: 8, nics_per_node: 4, nic_gbps: 100}\n"
    added.write_text(CLUSTER.read_text().replace("network:", extra + "network:"))
    for cluster_file, field, said in (
        (bigger, "groups.v100.nodes", "was planned for group 'v100' on 2 nodes (0..1) (search.cluster_nodes), this "
         "file gives it 3: not the cluster it was planned for"),
        (added, "groups.extra.nodes", "was planned without group 'extra' (search.cluster_nodes), this file gives it 1"),
    ):  # fmt: skip
        refused = hetplan("launch", str(plan_path), "-c", str(cluster_file))
        line = refused.stderr.strip()
        assert refused.returncode == 2 and "\n" not in line, refused.stderr
        assert line.startswith(f"hetplan: error: {cluster_file}: {field}: {plan_path} {said}"), line
    assert hetplan("launch", str(plan_path), "-c", str(CLUSTER)).returncode == 0
    # a group shrunk, and a group the plan leaves idle removed: neither is the cluster it was made for
    smaller = tmp_path / "smaller" / "a100-v100-32.yaml"
    smaller.parent.mkdir()
    a100 = "device: a100-80gb\n    nodes: "
    smaller.write_text(CLUSTER.read_text().replace(a100 + "2", a100 + "1"))
    refused = hetplan("launch", str(plan_path), "-c", str(smaller))
    said = "was planned for group 'a100' on 2 nodes (0..1) (search.cluster_nodes), this file gives it 1:"
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    idle = tmp_path / "idle.json"  # bf16: the V100s cannot train, the plan leaves them idle
    made = hetplan("plan", "-c", str(CLUSTER), "-m", "gpt3-1.7b", "--global-batch", "64", "--dtype", "bf16", "--out",
                   str(idle), "-q")  # fmt: skip
    assert made.returncode == 0 and "idle_note" in json.loads(idle.read_text())["search"], made.stderr
    without_v100 = tmp_path / "no-v100" / "a100-v100-32.yaml"
    without_v100.parent.mkdir()
    text = CLUSTER.read_text()
    without_v100.write_text(text[: text.index("  - name: v100")] + text[text.index("network:") :])
    refused = hetplan("explain", str(idle), "-c", str(without_v100))
    said = f"groups: {idle} was made for a cluster with group 'v100' (search.cluster_nodes), this file has none"
    assert refused.returncode == 2 and said in refused.stderr, refused.stderr
    del body["search"]["cluster_changes"], body["search"]["cluster_nodes"]
    before = tmp_path / "before.json"
    before.write_text(json.dumps(body))
    assert hetplan("launch", str(before), "-c", str(bigger)).returncode == 0  # (nothing recorded: read as it stands)
    # the torchrun export's plan.json records the file's nodes as they are, of a plan from before too
    for exported_plan in (plan_path, before):
        out = tmp_path / f"t-{exported_plan.stem}"
        exported = hetplan("export", str(exported_plan), "-c", str(CLUSTER), "--format", "torchrun", "--out", str(out))
        assert exported.returncode == 0, exported.stderr
        assert json.loads((out / "plan.json").read_text())["search"]["cluster_changes"] == []  # so it is checked too
        for other in (bigger, smaller):
            assert hetplan("launch", str(out / "plan.json"), "-c", str(other)).returncode == 2


def test_a_replanned_plan_runs_on_the_nodes_left_when_read_with_the_cluster_file(tmp_path):
    """The re-planned plan named the cluster file's cluster and offsets into its groups as if no node were lost:
    `launch` put ranks on the lost node, `predict` counted its devices. The plan records the changes and the nodes
    they leave by number; commands reading it with the cluster file run on those nodes (a second re-plan adds its own
    changes; a lost node replaced by a new one puts no rank on the lost one)."""
    from tests.conftest import hetplan, write_plan

    plan_path, replanned, twice = tmp_path / "plan.json", tmp_path / "re.json", tmp_path / "re2.json"
    write_plan(plan_path, CLUSTER, "gpt3-1.7b", 64)
    result = hetplan("replan", str(plan_path), "-c", str(CLUSTER), "--without", "node:a100/0", "--out", str(replanned))
    assert result.returncode == 0, result.stderr
    search = json.loads(replanned.read_text())["search"]
    assert search["cluster_changes"] == [{"without": ["node:a100/0"], "add": []}]
    assert search["cluster_nodes"] == {"a100": [1], "v100": [0, 1]}
    launch = hetplan("launch", str(replanned), "-c", str(CLUSTER), "--json")
    assert launch.returncode == 0, launch.stderr
    nodes = {(node["group"], node["node"]) for node in json.loads(launch.stdout)["nodes"]}
    assert ("a100", 0) not in nodes and nodes <= {("a100", 1), ("v100", 0), ("v100", 1)}
    predicted = hetplan("predict", "--strategy", str(replanned), "-c", str(CLUSTER))
    assert predicted.returncode == 0, predicted.stderr
    assert "a100-v100-32 (24 devices" in predicted.stdout  # (it said 32: the lost node's too)
    result = hetplan("replan", str(replanned), "-c", str(CLUSTER), "--without", "node:v100/1", "--out", str(twice))
    assert result.returncode == 0, result.stderr
    changes = json.loads(twice.read_text())["search"]["cluster_changes"]
    assert changes == [{"without": ["node:a100/0"], "add": []}, {"without": ["node:v100/1"], "add": []}]
    assert json.loads(twice.read_text())["search"]["cluster_nodes"] == {"a100": [1], "v100": [0]}
    out = str(tmp_path / "t")
    exported = hetplan("export", str(replanned), "-c", str(CLUSTER), "--format", "torchrun", "--out", out)
    assert exported.returncode == 0, exported.stderr  # its plan.json, which the user's script and launch read
    exported_search = json.loads((tmp_path / "t" / "plan.json").read_text())["search"]
    assert exported_search["cluster_nodes"]["a100"] == [1]
    assert exported_search["cluster_changes"] == [{"without": ["node:a100/0"], "add": []}]  # so its re-plans know them
    # a plan that records its nodes but not the changes that left them (an export made before it recorded them):
    # re-planned from its nodes (a100 node 0 stays lost), recording the nodes alone
    nodes_only = tmp_path / "nodes-only.json"
    body = json.loads((tmp_path / "t" / "plan.json").read_text())
    del body["search"]["cluster_changes"]
    nodes_only.write_text(json.dumps(body))
    from_export = tmp_path / "from-export.json"
    result = hetplan("replan", str(nodes_only), "-c", str(CLUSTER), "--without", "node:v100/1", "--out",
                     str(from_export))  # fmt: skip
    assert result.returncode == 0, result.stderr
    search = json.loads(from_export.read_text())["search"]
    assert search["cluster_nodes"] == {"a100": [1], "v100": [0]} and "cluster_changes" not in search
    assert hetplan("launch", str(from_export), "-c", str(CLUSTER)).returncode == 0
    replaced = tmp_path / "replaced.json"
    changes = ("--without", "node:a100/0", "--add", "group:a100:1")
    result = hetplan("replan", str(plan_path), "-c", str(CLUSTER), *changes, "--out", str(replaced))
    assert result.returncode == 0, result.stderr
    launch = hetplan("launch", str(replaced), "-c", str(CLUSTER))
    assert launch.returncode == 0, launch.stderr
    a100 = [line.rsplit("# ", 1)[1] for line in launch.stdout.splitlines() if "# a100" in line]
    assert a100 and set(a100) <= {"a100 node 1", "a100 node 2"}


def test_replan_command(tmp_path):
    from tests.conftest import hetplan, write_plan

    plan_path = tmp_path / "plan.json"
    write_plan(plan_path, CLUSTER, "gpt3-1.7b", 64)
    result = hetplan(
        "replan",
        str(plan_path),
        "--cluster",
        str(CLUSTER),
        "--without",
        "node:a100/1",
        "--out",
        str(tmp_path / "new.json"),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["cluster_devices"] == {"before": 32, "after": 24}
    assert body["new"]["tokens_per_s"] <= body["old"]["tokens_per_s"]
    assert json.loads((tmp_path / "new.json").read_text())["schema"] == "hetplan.plan/1"
    bad = hetplan("replan", str(plan_path), "--cluster", str(CLUSTER))
    assert bad.returncode == 2 and "say what changed" in bad.stderr


def _family_plan():
    """3 A100 nodes and 1 V100 node (tests/test_families.py): the plan has two pipeline families."""
    from tests.test_families import _a100_and_v100, _training

    cluster, model, training = _a100_and_v100(), load_model("gpt3-1.7b"), _training()
    return cluster, model, training, plan(cluster, model, training)


def test_a_family_plan_shrinks_keeps_its_families_and_says_why_it_cannot():
    from planner.replan import shrink

    cluster, model, training, old = _family_plan()
    assert len(old.strategy.pipelines) == 2
    smaller = changed_cluster(cluster, ["node:a100-80gb/0"], [])
    result = replan(smaller, model, training, old.strategy, previous=old.context)
    assert result.adapted is not None and len(result.adapted.strategy.pipelines) == 2 and result.not_adapted == ""
    for before, after in zip(old.strategy.pipelines, result.adapted.strategy.pipelines, strict=True):
        assert [(s.group, s.layer_start, s.layer_end, s.tp) for s in after.stages] == [
            (s.group, s.layer_start, s.layer_end, s.tp) for s in before.stages
        ]
        assert after.replicas <= before.replicas
    assert result.plan.evaluation.iteration_time_s <= result.adapted.iteration_time_s
    assert result.plan.search_stats["warm_started"] is True
    cold = replan(smaller, model, training, old.strategy)
    assert cold.plan.evaluation.iteration_time_s == pytest.approx(result.plan.evaluation.iteration_time_s, rel=1e-12)
    without_v100 = changed_cluster(cluster, ["group:v100:1"], [])
    ctx = default_predictor().context(without_v100, model, training)
    gone = shrink(ctx, old.strategy)
    assert gone.evaluation is None
    assert gone.reason.startswith("family 1: group v100 has no nodes left")  # numbered as plan and explain do


def test_a_bf16_plan_with_idle_v100s_replans_on_the_groups_that_have_bf16():
    """A bf16 plan on A100s beside V100s leaves the V100s idle (they have no bf16); after losing an A100 node the
    new plan must not place stages on them either (the search saw every group), and says they stay idle."""
    cluster, model = load_cluster(EXAMPLES / "a100-v100-32.yaml"), load_model("gpt3-1.7b")
    training = load_training(overrides={"dtype": "bf16", "global_batch_size": 64})
    made = plan(cluster, model, training)
    again = replan(changed_cluster(cluster, ["node:a100/1"], []), model, made.context.training, made.strategy)
    assert {stage.group for p in again.plan.strategy.pipelines for stage in p.stages} == {"a100"}
    assert again.plan.search_stats["idle_note"].startswith("v100 (16 devices) left idle: v100 has no bf16")


def test_replan_names_a_wrong_argument_and_takes_an_engine_by_name():
    """A path where the cluster goes, a dict for the training, a loaded plan for the strategy failed deep inside with
    an AttributeError; an engine name (which plan() takes) did too."""
    from planner.plan import LoadedPlan

    cluster = load_cluster(CLUSTER)
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16"})
    old = plan(cluster, model, training)
    loaded = LoadedPlan(old.strategy, model, training, "plan.json")
    for args, kwargs, said in (
        ((str(CLUSTER), model, training, old.strategy), {}, "replan(): cluster: expected a ClusterSpec"),
        ((cluster, model, {"global_batch_size": 64}, old.strategy), {}, "replan(): training: expected a TrainingSpec"),
        ((cluster, model, training, loaded), {}, "replan(): old: expected a Strategy: the old Plan's .strategy"),
        ((cluster, model, training, old.strategy), {"predictor": "x.joblib"}, "replan(): predictor: expected a"),
        ((cluster, model, training, old.strategy), {"engine": "megatorn"}, "replan(): engine: unknown engine"),
    ):
        with pytest.raises(SpecError) as caught:
            replan(*args, **kwargs)
        assert str(caught.value).startswith(said), caught.value
    smaller = changed_cluster(cluster, ["node:a100/0"], [])
    assert replan(smaller, model, training, old.strategy, engine="deepspeed").plan.search_stats["engine"] == "deepspeed"


def test_a_loaded_plans_model_reuses_the_old_plans_costs(tmp_path):
    """A plan file records no catalog model's aliases nor source: replan(previous=...) given the loaded plan's model
    built every cost again, its model differing from the catalog's by source alone."""
    cluster, model, training, old = _family_plan()
    old.save(tmp_path / "plan.json")
    loaded = load_plan(tmp_path / "plan.json")
    assert loaded.model != model and loaded.model.shape == model.shape
    smaller = changed_cluster(cluster, ["node:a100-80gb/0"], [])
    result = replan(smaller, loaded.model, training, loaded.strategy, previous=old.context)
    assert result.plan.context.sources is old.context.sources
