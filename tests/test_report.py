"""report/ called as a library (no CLI): explain names the slowest stage and writes a real picture and report, the
traffic heatmap is drawn and sums what was counted, the rail-only check flags rings that leave their rail, and a
directory of profiles is checked against the model. Also the tables the CLI prints from these results."""

from __future__ import annotations

import base64
import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from planner.plan import LoadedPlan
from predictor.traffic import Traffic
from profiler.profiles import load_profiles, profile_files
from profiler.simulated import SimulatedDevice
from report import explain, rail_only, traffic, traffic_calc
from report.figures import HEATMAP_MAX_DEVICES, traffic_matrix
from report.measurements import measured_steps_words, memory_lines
from report.replanning import replan_lines
from report.tables import STAGE_COLUMNS, plan_rows, stage_table, traffic_calc_lines
from specs import load_cluster, load_model, load_training
from specs.cluster import ClusterSpec
from specs.device import get_device
from specs.errors import SpecError
from specs.layout import PipelineStrategy, StageStrategy, Strategy, megatron_strategy
from specs.model import ModelSpec
from tests.conftest import EXAMPLES

CLUSTER = EXAMPLES / "a100-v100-32.yaml"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STAGE_DEVICES = STAGE_COLUMNS.index("devices")


def _a100() -> ClusterSpec:
    """The 16 A100s (two nodes of 8) of the example cluster."""
    cluster = load_cluster(CLUSTER)
    return cluster.only(cluster.group("a100"))


def _plan(strategy: Strategy | None = None, batch: int = 32, **megatron: int) -> LoadedPlan:
    """gpt3-1.7b (24 layers) on the A100s: a given strategy, or a Megatron-style one (micro-batch 1)."""
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": batch, "zero_stage": 1})
    if strategy is None:
        strategy = megatron_strategy(
            _a100(), model, training, group="a100", micro_batch_size=1, recompute="none", **megatron
        )
    return LoadedPlan(strategy, model, training, "test-plan.json", "a100-v100-32")


def _two_stages(first_layers: int) -> Strategy:
    """Four replicas of two TP-2 stages, `first_layers` of the 24 layers on stage 0 and the rest on stage 1."""
    stages = (StageStrategy("a100", 0, first_layers, 2, 0), StageStrategy("a100", first_layers, 24, 2, 8))
    return Strategy((PipelineStrategy(4, 1, 8, stages),), "none", 1)


@pytest.mark.parametrize(("first_layers", "slowest"), [(18, 0), (6, 1)])
def test_explain_names_the_slowest_stage(first_layers, slowest):
    result = explain(_plan(_two_stages(first_layers)), _a100())
    times = [s.step_time_s for s in result.evaluation.stages]
    assert times.index(max(times)) == slowest
    layers = first_layers if slowest == 0 else 24 - first_layers
    assert result.bottleneck[0].startswith(f"Stage {slowest} (a100, {layers} layers, TP 2) is the slowest")
    body = result.to_dict()
    assert body["bottleneck"] == result.bottleneck
    assert 0 < body["flush_s"] < body["iteration_time_s"] == result.evaluation.iteration_time_s
    assert body["png"] is None and body["html"] is None


def test_explain_says_how_far_the_drawn_interleaved_schedule_is_from_the_closed_form():
    plain = explain(_plan(tp=2, pp=2, dp=4), _a100())
    interleaved = explain(_plan(tp=2, pp=2, dp=4, virtual_stages=2), _a100())
    assert not any(line.startswith("Interleaved 1F1B") for line in plain.bottleneck)
    assert interleaved.bottleneck[-1].startswith("Interleaved 1F1B (v=2, Megatron's order) is drawn chunk by chunk")


def test_explain_writes_the_picture_and_embeds_it_in_the_report(tmp_path):
    png, html = tmp_path / "explain.png", tmp_path / "explain.html"
    result = explain(_plan(tp=2, pp=4, dp=2), _a100(), png=png, html=html)
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    report = html.read_text(encoding="utf-8")
    assert result.title in report and all(line in report for line in result.bottleneck)
    assert report.count("<tr><td>") == 4  # one row per stage
    encoded = report.split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(encoded) == png.read_bytes()  # the same picture, not a second drawing
    assert result.to_dict()["png"] == str(png) and result.to_dict()["html"] == str(html)


def test_explain_report_alone_draws_its_picture_into_the_report_only(tmp_path):
    html = tmp_path / "explain.html"
    result = explain(_plan(tp=2, pp=2, dp=4), _a100(), html=html)
    encoded = html.read_text(encoding="utf-8").split("data:image/png;base64,")[1].split("'")[0]
    assert base64.b64decode(encoded)[:8] == PNG_SIGNATURE
    assert result.to_dict()["png"] is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["explain.html"]


def test_traffic_heatmap_is_written_and_sums_the_counted_bytes(tmp_path):
    png = tmp_path / "traffic.png"
    result = traffic(_plan(tp=2, pp=2, dp=4), _a100(), tokens=1e9, epochs=2, png=png)
    assert png.read_bytes()[:8] == PNG_SIGNATURE and png.stat().st_size > 10_000
    labels, matrix = traffic_matrix(result.traffic)
    assert len(labels) == 16
    assert matrix.sum() == pytest.approx(result.traffic.total_bytes(), rel=1e-12)
    body = result.to_dict()
    assert body["png"] == str(png) and body["plan"] == "test-plan.json"
    assert body["iterations"] == math.ceil(2 * 1e9 / (32 * 2048))  # whole iterations
    for d, links in body["bytes_total"].items():
        for link, total in links.items():
            assert total == round(result.by_dimension_and_link[d][link] * body["iterations"])


def _toy_traffic(devices: int, per_node: int) -> Traffic:
    """`devices` devices of one group, `per_node` to a node, no bytes yet."""
    return Traffic(
        [f"g:{i}" for i in range(devices)],
        [f"g/node{i // per_node}" for i in range(devices)],
        [i % per_node for i in range(devices)],
        ["g"] * devices,
    )


def test_heatmap_sums_device_pairs_into_node_pairs_on_large_clusters():
    toy = _toy_traffic(HEATMAP_MAX_DEVICES + 8, 8)
    toy.add_ring("tp", list(range(8)), 10.0)  # inside node 0
    toy.add_ring("dp", [0, 8, 16], 5.0)  # nodes 0 -> 1 -> 2 -> 0
    labels, matrix = traffic_matrix(toy)
    assert len(labels) == (HEATMAP_MAX_DEVICES + 8) // 8 and labels[0] == "g/node0"
    assert matrix[0, 0] == 80.0 and matrix[0, 1] == matrix[1, 2] == matrix[2, 0] == 5.0
    assert matrix.sum() == toy.total_bytes()


def test_rail_only_counts_off_rail_bytes_and_the_worst_relay():
    toy = _toy_traffic(4, 2)  # two nodes of two devices
    toy.add_ring("dp", [0, 3], 100.0)  # local rank 0 <-> 1 across nodes: off-rail both ways
    toy.add_ring("dp", [1, 3], 50.0)  # local rank 1 on both nodes: on the rail
    toy.add_ring("pp", [0, 2], 30.0)  # on the rail
    rail = rail_only(toy)
    assert not rail.ok
    assert rail.spine_bytes == {"tp": 0, "cp": 0, "pp": 0, "dp": 200.0}
    assert rail.groups_breaking_it == ["g"] and rail.relay_bytes_worst_device == 100.0
    assert rail.sentence().startswith("rail-only: NO, 0.0 GB per iteration cross nodes off-rail (groups g)")
    clean = _toy_traffic(4, 2)
    clean.add_ring("dp", [1, 3], 50.0)
    assert rail_only(clean).ok and rail_only(clean).relay_bytes_worst_device == 0.0


def test_rail_only_flags_a_plan_whose_dp_ring_crosses_rails():
    """Three TP-2 replicas fill 6 of 8 devices a node: stage 1 starts at local rank 6 on node 0 and wraps to local
    rank 0 on node 1, so its DP rings go off-rail. Four replicas (stage 1 at device 8) stay on their rails."""
    shifted = traffic(_plan(batch=24, tp=2, pp=2, dp=3), _a100())
    rail = shifted.rail
    assert not rail.ok and rail.groups_breaking_it == ["a100"]
    assert rail.spine_bytes["dp"] > 0 and rail.spine_bytes["tp"] == 0
    pairs = shifted.traffic.pairs
    worst = max(
        sum(
            size
            for (src, dst), size in pairs[d].items()
            if src == device and shifted.traffic.link_class(src, dst) == "spine"
        )
        for device in range(16)
        for d in pairs
    )
    assert rail.relay_bytes_worst_device == worst > 0
    body = shifted.to_dict()["rail_only"]
    assert body["ok"] is False and body["spine_bytes_per_iteration"]["dp"] == round(rail.spine_bytes["dp"])
    aligned = traffic(_plan(tp=2, pp=2, dp=4), _a100())
    assert aligned.rail.ok and aligned.to_dict()["rail_only"]["groups_breaking_it"] == []


def test_traffic_calc_is_the_textbook_volume_over_the_run():
    model = load_model("llama3-70b")
    body = traffic_calc(model, 156e9, 2048, 8)
    # whole steps (156e9 tokens are 9,298.3 steps of 2048 x 8192): the last, partial one syncs every gradient too
    assert body["steps"] == 9299 == math.ceil(156e9 / (2048 * model.seq_length))
    assert body["bytes_per_rank"]["dp"] == pytest.approx(body["steps"] * 2 * 7 / 8 * model.total_params() * 2)
    assert traffic_calc(model, 156e9, 2048, 8, seq_length=model.seq_length // 2)["steps"] == 18597
    # in words: the steps whole, the bytes in petabytes; fewer tokens than a step are one step (they read
    # "5.96e-08 steps", with bytes to match), its bytes in a unit that shows them
    first, dp_line, *_ = traffic_calc_lines(body, 2048, model.seq_length)
    assert "156,000,000,000 tokens = 9,299 steps of 2048 x 8192 tokens (rounded up" in first
    assert dp_line.endswith("PB in all)")
    one_token = traffic_calc(model, 1, 2048, 8)
    first, dp_line, *_ = traffic_calc_lines(one_token, 2048, model.seq_length)
    assert "1 tokens = 1 step of" in first and " GB sent per rank" in dp_line
    assert one_token["bytes_per_rank"] == traffic_calc(model, 2048 * model.seq_length, 2048, 8)["bytes_per_rank"]


def test_traffic_calc_has_no_volume_for_ranks_the_model_or_batch_cannot_take():
    """96 pipeline stages of 80 layers, TP 96 over 8 kv heads and 4096 DP ranks for 2048 sequences were each given a
    volume; they are n/a, with why."""
    model = load_model("llama3-70b")
    body = traffic_calc(model, 156e9, 2048, 96)
    assert body["bytes_per_rank"]["pp"] is None and body["bytes_per_rank"]["tp"] is None
    assert body["bytes_per_rank"]["dp"] > 0 and sorted(body["not_applicable"]) == ["pp", "tp"]
    lines = traffic_calc_lines(body, 2048, model.seq_length)
    assert "  pp    n/a: 96 stages of 80 layers: a stage would have none" in lines
    assert "  tp    n/a: TP 96 does not split the 8 kv heads nor FFN 28672 into equal parts" in lines
    # only what does not split is named (qwen3-4b's FFN 9728 splits over 16: it was named too)
    qwen = traffic_calc(load_model("qwen3-4b"), 1e9, 2048, 16)["not_applicable"]
    assert qwen["tp"] == "TP 16 does not split the 8 kv heads into equal parts"
    wide = traffic_calc(model, 156e9, 2048, 4096)
    assert all(value is None for value in wide["bytes_per_rank"].values())
    assert wide["not_applicable"]["dp"] == "4096 ranks, a global batch of 2048 sequences: a rank would have none"
    assert traffic_calc(model, 156e9, 2048, 8)["not_applicable"] == {}
    # a gradient of 3 bytes was taken from Python (the CLI alone checked its flag)
    with pytest.raises(SpecError, match=r"^traffic_calc\(\): grad_bytes: expected 1 \(FP8\), 2 \(bf16/fp16\) or 4"):
        traffic_calc(model, 156e9, 2048, 8, grad_bytes=3)


def _save_profile(path: Path, device: str, model: str) -> None:
    SimulatedDevice(get_device(device), load_model(model), 1024, "bf16").to_profile((1,), (1,)).save(path)


def test_profiles_directory_is_checked_against_the_model(tmp_path):
    model = load_model("gpt3-1.7b")
    _save_profile(tmp_path / "a.json", "a100-80gb", "gpt3-1.7b")
    _save_profile(tmp_path / "b.json", "v100", "gpt3-1.7b")
    assert sorted(load_profiles(tmp_path, model)) == ["a100-80gb", "v100"]
    assert load_profiles(None, model) == {}
    assert [p.name for p in profile_files(tmp_path)] == ["a.json", "b.json"]
    _save_profile(tmp_path / "c.json", "a100-80gb", "gpt3-1.7b")
    with pytest.raises(SpecError, match="a second profile for device 'a100-80gb'"):
        load_profiles(tmp_path, model)
    (tmp_path / "c.json").unlink()
    _save_profile(tmp_path / "c.json", "h100", "gpt3-6.7b")
    with pytest.raises(SpecError, match=r"c\.json: model\.hidden_size: profiled 4096, the model to plan has 2304"):
        load_profiles(tmp_path, model)
    # a profile of heads of hidden / heads does not time heads of their own width (Qwen3's), nor the other way
    wide = ModelSpec.model_validate({**model.model_dump(), "head_dim": 128})
    (tmp_path / "c.json").unlink()
    with pytest.raises(SpecError, match=r"a\.json: model\.head_dim: profiled no head_dim \(heads of hid"):
        load_profiles(tmp_path, wide)
    other = tmp_path / "wide"
    other.mkdir()
    SimulatedDevice(get_device("h100"), wide, 1024, "bf16").to_profile((1,), (1,)).save(other / "w.json")
    with pytest.raises(SpecError, match=r"w\.json: model\.head_dim: profiled 128, the model to plan has no head_dim"):
        load_profiles(other, model)
    # a profile whose model writes out head_dim = hidden / heads (2304 / 24) is the model without it
    written = json.loads((tmp_path / "a.json").read_text())
    written["model"]["head_dim"] = 96
    (other / "w.json").write_text(json.dumps(written))
    assert list(load_profiles(other, model)) == ["a100-80gb"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert load_profiles(empty, model) == {}
    with pytest.raises(SpecError, match="no \\*.json profiles"):
        profile_files(empty)
    with pytest.raises(SpecError, match="expected a directory of profile JSON files"):
        load_profiles(tmp_path / "a.json", model)
    with pytest.raises(SpecError, match=r"nowhere: not found: expected a directory of profile JSON files$"):
        load_profiles(tmp_path / "nowhere", model)


def test_stage_table_marks_stages_that_do_not_fit_in_red():
    from rich.console import Console

    result = explain(_plan(tp=1, pp=1, dp=16), _a100())
    table = stage_table(result.context, result.evaluation)
    assert table.row_count == 1
    memory_cell = next(iter(table.columns[-1].cells))
    assert memory_cell.startswith("[red]") == (not result.evaluation.stages[0].fits)
    console = Console(width=200, record=True)
    console.print(table)
    assert "a100-80gb" in console.export_text()


def test_plan_rows_show_the_lower_bound_only_when_it_was_computed():
    body = {
        "upper_bound_tokens_per_s": 1000.0,
        "fraction_of_upper_bound": 0.5,
        "compute_bound_tokens_per_s": 2000.0,
        "fraction_of_compute_bound": 0.25,
        "search_time_s": 1.234,
        "search": {"evaluated": 3, "configurations": 10},
    }
    assert [name for name, _ in plan_rows(body, None)] == ["groups alone", "compute bound", "search"]
    rows = dict(plan_rows({**body, "iteration_time_lower_bound_s": 2.0, "gap_to_lower_bound": 0.05}, None))
    assert rows["lower bound"] == "2.000 s per iteration for any plan searched: this one is within 5.0%"
    assert rows["search"] == "1.23 s, 3 of 10 configurations evaluated"


def test_replan_lines_say_when_the_old_plan_cannot_run_any_more():
    side = {"summary": "[a] 2 stages", "iteration_time_s": 2.0, "tokens_per_s": 1000.0}
    body = {
        "cluster_devices": {"before": 16, "after": 8},
        "old": side,
        "old_adapted": None,
        "old_not_adapted": "group [fast] has no nodes left and the old plan has stages there",
        "new": {**side, "iteration_time_s": 4.0, "tokens_per_s": 500.0},
        "throughput_change": -0.5,
        "replan_time_s": 0.1,
        "warm_started": False,
    }
    lines = replan_lines(body, 0.123)
    assert lines[0] == "cluster: 16 -> 8 devices"
    assert (
        "old plan shrunk to fit: cannot run on the changed cluster: group \\[fast] has no nodes left and the old "
        "plan has stages there" in lines
    )  # why not, escaped
    assert lines[2].strip() == "\\[a] 2 stages"  # escaped for rich markup
    assert lines[-1] == "throughput -50.0%; re-planned in 0.12 s"


def test_progress_lines_off_a_terminal_say_done_total_elapsed_and_eta():
    """A line every interval (the first only after one: quick commands print nothing), none when quiet; a final
    'done' only after lines were printed."""
    import io

    from report.progress import Progress

    now = [0.0]
    out = io.StringIO()
    progress = Progress("profile", unit="entries", interval_s=5, stream=out, clock=lambda: now[0], terminal=False)
    with progress:
        progress(3, 12, "decoder b=2 tp=1 full")
        assert out.getvalue() == ""
        now[0] = 6.0
        progress(3, 12, "decoder b=2 tp=1 full")
        now[0] = 8.0
        progress.tick()  # within the interval: nothing
        now[0] = 70.0
        progress.tick()  # the heartbeat, with no new update
    lines = out.getvalue().splitlines()
    assert lines == [
        "hetplan profile: 3/12 entries (25%) decoder b=2 tp=1 full, 6 s elapsed, about 18 s left",
        "hetplan profile: 3/12 entries (25%) decoder b=2 tp=1 full, 1 min 10 s elapsed, about 3 min 30 s left",
        "hetplan profile: done in 1 min 10 s",
    ]
    quiet = io.StringIO()
    with Progress("plan", quiet=True, interval_s=0.0, stream=quiet, terminal=False) as silent:
        silent(5, None)
        silent.tick()
    assert quiet.getvalue() == ""


def test_progress_of_steps_and_of_work_of_unknown_size():
    import io

    from report.progress import Progress

    progress = Progress("explain", unit="steps", interval_s=1, stream=io.StringIO(), clock=lambda: 0.0, terminal=False)
    progress.step("evaluating the plan", 3)
    progress.step("laying out the schedule", 3)
    assert (
        progress.line(10.0) == "hetplan explain: 1/3 steps (33%) laying out the schedule, 10 s elapsed, about 20 s left"
    )
    search = Progress("plan", unit="candidates", stream=io.StringIO(), clock=lambda: 0.0, terminal=False)
    searched = search.counter("searched")
    searched(1280, 1344)  # the planner's total is only a lower bound: no ETA from it
    searched(3, 10)  # the family search counts its own steps: the count shown does not go back
    assert search.line(3725.0) == "hetplan plan: 1,280 candidates searched, 1 h 02 min elapsed"
    assert Progress("fit", stream=io.StringIO(), clock=lambda: 0.0, terminal=False).line(3.0) == (
        "hetplan fit: starting, 3 s elapsed"
    )
    now = [0.0]
    steps = Progress("run", unit="steps", stream=io.StringIO(), clock=lambda: now[0], terminal=False)
    steps(0, 10)
    now[0] = 30.0  # the processes took 30 s to start; then a step a second
    steps(1, 10)
    now[0] = 34.0
    steps(5, 10)
    assert steps.line(34.0) == "hetplan run: 5/10 steps (50%), 34 s elapsed, about 5 s left"  # not 34 s: the start
    now[0] = 60.0  # a rank died; the resumed attempt has 8 steps left, its first seen at 60 s, its third at 62 s
    steps(1, 8)
    now[0] = 62.0
    steps(3, 8)
    assert steps.line(62.0) == "hetplan run: 3/8 steps (38%), 1 min 02 s elapsed, about 5 s left"
    run = Progress("run", stream=io.StringIO(), clock=lambda: 0.0, terminal=False)
    run.say("running plan.json on 4 local processes for 5 steps ...")
    assert run.line(2.0) == "hetplan run: running plan.json on 4 local processes for 5 steps, 2 s elapsed"


def test_the_iteration_says_how_much_dp_sync_the_tail_leaves_overlapped():
    """A longer backward hides more of the DP sync, and the tail (DP sync + optimizer) shrank without a word."""
    from report.tables import summary_rows

    overlapped = []
    model, strategy = load_model("gpt3-1.7b"), _plan(tp=1, pp=1, dp=16).strategy
    for seq_length in (512, 1024):
        training = load_training(None, {"global_batch_size": 32, "zero_stage": 1, "seq_length": seq_length})
        result = explain(LoadedPlan(strategy, model, training, "test-plan.json", "a100-v100-32"), _a100())
        tail = max(result.evaluation.stages, key=lambda stage: stage.tail_time_s)
        hidden_s = tail.dp_sync_time_s - tail.dp_exposed_time_s  # ZeRO-1: the reduction and the gather
        assert result.evaluation.dp_sync_overlapped_s == pytest.approx(hidden_s)
        line = dict(summary_rows(result.context, result.evaluation, []))["iteration"]
        assert line.endswith(f"; {hidden_s:.3f} s of DP sync overlapped)" if hidden_s >= 0.0005 else "")
        assert ("of DP sync overlapped" in line) == (hidden_s >= 0.0005)
        overlapped.append(hidden_s)
    assert 0.0005 < overlapped[0] < overlapped[1]  # a backward of twice the tokens hides more (0.032 s, 0.056 s)
    zero3 = load_training(None, {"global_batch_size": 256, "zero_stage": 3})
    strategy = replace(_plan(tp=2, pp=2, dp=4, batch=256).strategy, zero_stage=3)
    sharded = explain(LoadedPlan(strategy, load_model("gpt3-1.7b"), zero3, "z3.json", "a100-v100-32"), _a100())
    assert sharded.evaluation.dp_sync_overlapped_s == 0.0  # its traffic is in the passes' time, not after the flush
    assert "overlapped" not in dict(summary_rows(sharded.context, sharded.evaluation, []))["iteration"]


def test_a_tiny_models_state_beside_its_ranks_memory_is_in_mib():
    """A run of a 150K-parameter model said "the plan's 0.00 GiB per device"."""
    ranks = {"memory_max_rss_bytes": {"0": 3.7 * 2**30, "1": 4.5 * 2**30}}
    (tiny,) = memory_lines({**ranks, "predicted_memory_bytes": 2.4 * 2**20})
    assert tiny.startswith("memory: peak resident 3.70-4.50 GiB per rank; the plan's 2.4 MiB per device is the model's")
    (small,) = memory_lines({**ranks, "predicted_memory_bytes": 0.5 * 2**30})
    assert "the plan's 0.50 GiB per device" in small


def test_summaries_say_what_their_numbers_count():
    """Small models in millions (not '0.0B'), the stage table's devices over all replicas, traffic summed over
    devices, and HETHUB's yardstick not called a bound (a mixed plan can beat it)."""
    from rich.console import Console

    from report.tables import params, summary_rows, traffic_table

    assert [params(n) for n in (31_000_000, 1.7e9, 1.2e12, 950)] == ["31.0M", "1.7B", "1.2T", "950"]
    result = explain(_plan(tp=2, pp=2, dp=4), _a100())
    rows = dict(summary_rows(result.context, result.evaluation, []))
    assert rows["model"].startswith("gpt3-1.7b (1.7B params")
    table = stage_table(result.context, result.evaluation)
    assert table.title == "Stages (devices: TP x replicas; time per micro-batch and memory per device)"
    assert [int(cell) for cell in table.columns[STAGE_DEVICES].cells] == [8, 8]  # TP 2 x 4 replicas
    console = Console(width=200, record=True)
    console.print(traffic_table(traffic(_plan(tp=2, pp=2, dp=4), _a100())))
    assert "GB sent, summed over all 16 devices" in " ".join(console.export_text().split())
    body = {"upper_bound_tokens_per_s": 100.0, "fraction_of_upper_bound": 1.024, "compute_bound_tokens_per_s": 200.0}
    body |= {"fraction_of_compute_bound": 0.5, "search_time_s": 1.0, "search": {"evaluated": 1, "configurations": 1}}
    yardstick = dict(plan_rows(body, None))["groups alone"]
    assert "not a bound" in yardstick and "102.4% of it" in yardstick


def test_catalog_tables_never_cut_the_key_column():
    from rich.console import Console

    from report.tables import devices_table, models_table
    from specs.device import device_catalog
    from specs.model import model_catalog

    for table, keys in (
        (devices_table(device_catalog()), device_catalog()),
        (models_table(model_catalog()), model_catalog()),
    ):
        console = Console(width=100, record=True)
        console.print(table)
        text = console.export_text()
        assert all(key in text for key in keys), [key for key in keys if key not in text]


def test_hints_name_uneven_batches_for_a_prime_batch_and_advice_skips_what_is_allowed():
    from planner.planning import fit_remedies
    from report.tables import hint_lines

    prime = explain(_plan(tp=8, pp=2, dp=1, batch=31), _a100())
    (hint,) = hint_lines(prime.context, prime.evaluation)
    assert hint.startswith("hint: the global batch 31 is prime") and "--uneven-batch exhaustive" in hint
    even = explain(_plan(tp=2, pp=2, dp=4), _a100())
    assert hint_lines(even.context, even.evaluation) == []  # every device used, batch splits evenly
    single = explain(_plan(tp=4, pp=2, dp=1, batch=1), _a100())  # devices idle, but one sample: no more replicas
    assert single.evaluation.devices_used < single.context.cluster.num_devices
    assert hint_lines(single.context, single.evaluation) == []
    defaults = load_training()  # full recompute and ZeRO-1 already allowed
    assert fit_remedies(defaults) == (
        "add devices, shard gradients and weights too (--zero-stage 3) or shorten the sequence (--seq-len)"
    )
    assert "--dtype bf16" in fit_remedies(load_training(None, {"dtype": "fp32"}))
    assert "--zero-stage 3" not in fit_remedies(load_training(None, {"zero_stage": 3}))
    assert "--zero-stage 3" not in fit_remedies(defaults, zero_stages=[1, 2, 3])  # `plan --zero-stages 1,2,3`
    assert "--zero-stage 3" not in fit_remedies(defaults, zero_stages=[0, 3])
    assert "ZeRO-1 (--zero-stage 1)" not in fit_remedies(load_training(None, {"zero_stage": 0}), [0, 1])
    narrow = load_training(None, {"recompute": ["none"], "zero_stage": 0, "micro_batch_sizes": [2, 4]})
    assert "allow full recompute" in fit_remedies(narrow) and "ZeRO-1 (--zero-stage 1)" in fit_remedies(narrow)


def test_explain_words_agree_with_the_table_when_families_differ():
    """With several families the pacing stage is the slowest of the family that takes longest, and a slower stage
    of another family (running fewer micro-batches) is named as such, not contradicted."""
    from predictor.schedule import pace_words

    cluster = load_cluster(CLUSTER)
    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 64, "dtype": "fp16", "zero_stage": 1})
    fast = (StageStrategy("a100", 0, 12, 1, 0), StageStrategy("a100", 12, 24, 1, 1))
    slow = (StageStrategy("v100", 0, 24, 2, 0),)
    strategy = Strategy((PipelineStrategy(1, 1, 60, fast), PipelineStrategy(1, 1, 4, slow)), "none", 1)
    result = explain(LoadedPlan(strategy, model, training, "families.json", cluster.name), cluster)
    stages = result.evaluation.stages
    assert stages[2].step_time_s > max(s.step_time_s for s in stages[:2])  # the V100 stage is slower ...
    words = pace_words(result.evaluation)
    assert words.startswith("Stage 0.")  # ... but the 60 micro-batches of family 0 take longer
    assert "slowest stage of family 0, whose 60 micro-batches per replica take longest" in words
    assert (
        f"Family 1's stages are slower per micro-batch (up to {stages[2].step_time_s * 1e3:.1f} ms) but run 4" in words
    )
    assert result.bottleneck[0] == words


def test_dense_schedules_are_summarised_and_many_stage_labels_thinned(tmp_path):
    """A 1F1B row denser than the picture merges blocks closer than a pixel (forward + backward runs become one
    'mixed' bar); 100 stages get at most MAX_LABELS labels; the legends sit outside the charts."""
    import matplotlib

    matplotlib.use("Agg")
    from predictor.schedule import Block
    from report.figures import MAX_LABELS, _every, merged_runs

    blocks = [Block(0, "forward", i, i * 1.0, i + 0.5) for i in range(4)]
    blocks += [Block(0, "backward", i, i + 0.5, i + 1.0) for i in range(4)]
    blocks.append(Block(0, "forward", 9, 9.0, 9.5))
    assert merged_runs(blocks, 1000.0) == [(0.0, 4.0, "mixed"), (9.0, 9.5, "forward")]
    assert merged_runs(blocks[:1], 1000.0) == [(0.0, 0.5, "forward")]
    assert len(range(0, 100, _every(100))) <= MAX_LABELS and _every(26) == 1


def test_a_prime_batch_split_by_families_still_hints_at_uneven_shares():
    """H100 + MI300X / Llama-3-70B at a prime batch (1021): families split it (no replica count divides it), which
    the hint took for a plan without the constraint; `--uneven-batch exhaustive` plans it 0.9% faster."""
    from planner import plan
    from report.tables import hint_lines

    cluster, model = load_cluster(EXAMPLES / "h100-mi300x.yaml"), load_model("llama3-70b")
    made = plan(cluster, model, load_training(None, {"global_batch_size": 1021, "dtype": "bf16"}))
    assert len(made.strategy.pipelines) > 1
    (hint,) = hint_lines(made.context, made.evaluation)
    assert hint.startswith("hint: the global batch 1021 is prime: only the families' shares") and "exhaustive" in hint


def test_a_run_says_which_of_its_steps_it_measured():
    """After the warm-up step of the steps the run trained: a run resumed at step 2 of 3 trained step 3 alone (it
    said "median of steps 2-3"), one resumed at step 1 of 4 trained steps 2-4 (it said "median of steps 2-4", the
    warm-up included). Of an even count the lower median, a step that happened (it was the mean of two)."""
    assert measured_steps_words(steps=3, trained=3) == "the faster of steps 2 and 3"
    assert measured_steps_words(steps=2, trained=2) == "step 2"
    assert measured_steps_words(steps=1, trained=1) == "step 1, with its warm-up"
    assert measured_steps_words(steps=3, trained=1) == "step 3, with its warm-up"
    assert measured_steps_words(steps=4, trained=3) == "the faster of steps 3 and 4"
    assert measured_steps_words(steps=5, trained=5) == "lower median of steps 2-5"
    assert measured_steps_words(steps=6, trained=6) == "median of steps 2-6"


def test_the_measured_step_is_a_step_that_happened():
    """Two ranks, three steps after the warm-up: the iteration is the slowest rank's step, and of an even count of
    measured steps the lower median (the mean of 0.020 and 0.027 s read 0.0235 s, a step no rank took)."""
    from runtime.launch import summarize

    def rank(number: int, times: list[float]) -> dict:
        steps = [{"time_s": t, "compute_s": t, "emulation_s": 0.0, "wait_s": 0.0} for t in times]
        return {"rank": number, "replica": number, "family": 0, "stage": 0, "group": "cpu", "layers": [0, 2],
                "tp_rank": 0, "cp_rank": 0,
                "emulate_speed": 1.0, "microbatches": 1, "steps": steps, "loss_contributions": [1.0] * len(times),
                "last_stage": True, "max_rss_bytes": 1}  # fmt: skip

    summary = summarize([rank(0, [0.5, 0.020, 0.027, 0.018]), rank(1, [0.5, 0.019, 0.025, 0.022])], 4)
    assert summary["step_times_s"] == [0.5, 0.020, 0.027, 0.022]
    assert summary["measured_iteration_time_s"] == 0.022
    summary = summarize([rank(0, [0.5, 0.020, 0.027])], 3)
    assert summary["measured_iteration_time_s"] == 0.020


def test_a_run_predicted_without_host_costs_says_what_that_leaves_out():
    """From profiles without the host's step costs the work around the layers is predicted as none (a newcomer's run
    read DP sync 0.000 s predicted, 0.007 s measured); with them, or from the predictor, nothing is said."""
    from report.measurements import host_costs_lines

    profiles = {"profiles": [{"path": "cpu.json"}]}
    (line,) = host_costs_lines({"predicted_timeline": None, "cost_source": profiles})
    assert line.startswith("note: the profiles have no host costs") and "--no-host" in line
    assert host_costs_lines({"predicted_timeline": {"step_s": 0.1, "actors": []}, "cost_source": profiles}) == []
    shipped = {"predictor": {"kind": "shipped"}, "profiles": []}
    assert host_costs_lines({"predicted_timeline": None, "cost_source": shipped}) == []


def test_the_iteration_says_how_much_of_the_tail_is_the_tied_embeddings_sum():
    """GPT-3 1.7B ties its embedding and output: over two stages most of its tail on a100-v100-32 is the matrix summed
    between the first and last stage, 0.108 of 0.134 s, which the row did not say; one stage has none to sum."""
    from report.tables import summary_rows

    model = load_model("gpt3-1.7b")
    training = load_training(None, {"global_batch_size": 32, "zero_stage": 1})
    for pp in (1, 2):
        strategy = _plan(tp=1, pp=pp, dp=16 // pp).strategy
        result = explain(LoadedPlan(strategy, model, training, "test-plan.json", "a100-v100-32"), _a100())
        tied_s = result.evaluation.tied_sync_s
        tail = max(result.evaluation.stages, key=lambda stage: stage.tail_time_s)
        assert tied_s == tail.tied_sync_time_s and (tied_s > 0.0005) == (pp == 2)
        line = dict(summary_rows(result.context, result.evaluation, []))["iteration"]
        assert (f"DP sync + optimizer {result.evaluation.tail_time_s:.3f}, {tied_s:.3f} of it the tied" in line) == (
            pp == 2
        )
