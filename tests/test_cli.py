"""The command line as a user meets it: subprocesses, exit codes, one-line errors, JSON, no torch needed."""

from __future__ import annotations

import itertools
import json
import re

import pytest

from tests.conftest import EXAMPLES, ONE_T4_NODE, ROOT, hetplan


@pytest.fixture(scope="module")
def small_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    result = hetplan(
        "plan",
        "--cluster",
        str(EXAMPLES / "a100-v100-32.yaml"),
        "--model",
        "gpt3-6.7b",
        "--dtype",
        "fp16",
        "--global-batch",
        "256",
        "--json",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), out


def test_plan_json_has_the_schema_fields(small_plan):
    body, out = small_plan
    for field in (
        "iteration_time_s",
        "tokens_per_s",
        "mfu",
        "upper_bound_tokens_per_s",
        "fraction_of_upper_bound",
        "compute_bound_tokens_per_s",
        "fraction_of_compute_bound",
        "search_time_s",
        "recompute",
        "zero_stage",
        "pipelines",
    ):
        assert field in body
    pipeline = body["pipelines"][0]
    for field in ("replicas", "micro_batch_size", "num_microbatches", "stages"):
        assert field in pipeline
    for stage in pipeline["stages"]:
        assert set(stage) >= {"group", "device", "layers", "tp", "devices", "memory_bytes", "memory_capacity_bytes"}
    assert json.loads(out.read_text()) == body


def test_predict_strategy_reproduces_the_plan(small_plan):
    body, out = small_plan
    result = hetplan("predict", "--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--strategy", str(out), "--json")
    assert result.returncode == 0, result.stderr
    predicted = json.loads(result.stdout)
    assert predicted["fits"] is True
    assert predicted["iteration_time_s"] == body["iteration_time_s"]
    assert predicted["pipelines"] == body["pipelines"]


@pytest.mark.slow
def test_predict_megatron_flags_on_homogeneous_a100(write):
    cluster = write(
        "a100.yaml",
        """
name: dgx-a100-x16
groups:
  - {name: a100, device: a100-80gb, nodes: 16, devices_per_node: 8, nics_per_node: 8, nic_gbps: 200}
network: {topology: rail-optimized, inter_group_gbps: 200}
""",
    )
    megatron = f"predict --cluster {cluster} --model gpt3-175b --tp 8 --pp 16 --dp 1 --micro-batch 1 --recompute full"
    result = hetplan(*megatron.split(), "--global-batch", "256", "--json")
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["iteration_time_s"] > 0 and body["fits"] is True
    stages = body["pipelines"][0]["stages"]
    assert len(stages) == 16 and all(s["layers"][1] - s["layers"][0] == 6 for s in stages)
    assert all(0 < s["memory_bytes"] < s["memory_capacity_bytes"] for s in stages)
    table = hetplan(*megatron.split(), "--global-batch", "256")
    assert table.returncode == 0 and "memory GiB" in table.stdout and "iteration" in table.stdout


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # a whole file's error names the flag that gave it (the file alone was named)
        (
            ("plan", "--cluster", "missing.yaml", "--model", "llama2-7b"),
            "error: --cluster missing.yaml: file not found",
        ),
        (("plan", "--cluster=./missing.yaml", "-m", "llama2-7b"), "error: --cluster missing.yaml: file not found"),
        (
            (
                "plan",
                "-c",
                "examples/hethub-768.yaml",
                "-m",
                "llama2-7b",
                "--training",
                "examples/models/tiny-gpt.yaml",
            ),
            "error: --training examples/models/tiny-gpt.yaml: expected a training file",
        ),
        # not where two options gave the file, nor for a positional argument or a switch before a flag's error
        (
            ("plan", "-c", "examples/hethub-768.yaml", "-m", "llama2-7b", "--training", "examples/hethub-768.yaml"),
            "error: examples/hethub-768.yaml: expected a training file",
        ),
        (("explain", "-q", "missing.json", "-c", "examples/hethub-768.yaml"), "error: missing.json: file not found"),
        (  # a file of another kind given for a plan
            ("predict", "-c", "examples/hethub-768.yaml", "--strategy", "examples/a100-v100-32.yaml"),
            "error: --strategy examples/a100-v100-32.yaml: schema: expected 'hetplan.plan/1'",
        ),
        (("plan", "-c", "examples/hethub-768.yaml", "--lower-bound", "-m", "gpt5"), "error: --model: unknown model"),
        (("plan", "--cluster", "examples/hethub-768.yaml", "--model", "gpt5"), "unknown model 'gpt5'"),
        (
            ("plan", "--cluster", "examples/hethub-768.yaml", "--model", "llama2-7b", "--zero-stage", "5"),
            "--zero-stage: expected 0, 1, 2 or 3",
        ),
        (
            ("predict", "--cluster", "examples/hethub-768.yaml", "--model", "llama2-7b", "--tp", "8"),
            "--group: the cluster has several groups: expected one of amd, ascend",
        ),
        (  # the flag's mistake, not the cluster file's (the line named the file)
            ("predict", "--cluster", "examples/hethub-768.yaml", "--model", "llama2-7b", "--group", "nope"),
            "error: --group: no group named 'nope': expected one of amd, ascend (cluster 'hethub-768')",
        ),
        (
            ("predict", "--cluster", "examples/hethub-768.yaml", "--model", "llama2-7b", "--group", "amd", "--pp", "3"),
            "error: --pp: 32 layers do not split evenly into 3 stages",
        ),
        (  # Megatron's interleaving needs as many layers in each chunk (it was predicted)
            (
                "predict",
                "-c",
                "examples/hethub-768.yaml",
                "-m",
                "llama2-7b",
                "--group",
                "amd",
                "--pp",
                "2",
                "--virtual-stages",
                "3",
            ),
            "error: --virtual-stages: 16 layers per stage do not split evenly into 3 chunks",
        ),
    ],
)
def test_user_errors_print_one_line_and_exit_2(args, expected):
    result = hetplan(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hetplan: error: ") and expected in lines[0]


@pytest.mark.slow
def test_does_not_fit_exits_2_with_the_shortfall(write):
    cluster = write(
        "t4.yaml",
        ONE_T4_NODE,
    )
    result = hetplan("plan", "--cluster", str(cluster), "--model", "llama2-70b", "--dtype", "fp16")
    assert result.returncode == 2
    assert "does not fit" in result.stderr and "GiB more per device" in result.stderr


def test_catalog_listings(tmp_path):
    devices = hetplan("devices", "--json")
    assert devices.returncode == 0
    assert {"h100", "mi300x", "ascend-910b", "cpu"} <= {d["key"] for d in json.loads(devices.stdout)}
    models = hetplan("models")
    assert models.returncode == 0 and "llama-140b" in models.stdout and "139.8B" in models.stdout
    # a config.json's count and shape before planning with it (it could only be seen through plan or predict), with
    # what it sets and hetplan does not model
    config = tmp_path / "qwen" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    }))  # fmt: skip
    given = hetplan("models", str(config), "llama3-8b", "--json")
    assert given.returncode == 0, given.stderr
    qwen, llama = json.loads(given.stdout)
    assert (qwen["key"], llama["key"]) == ("qwen", "llama3-8b") and round(qwen["total_params"] / 1e9, 2) == 7.62
    assert given.stderr.strip() == f"note: {config} sets what hetplan does not model: Q/K/V biases"
    unknown = hetplan("models", "llama9")
    assert unknown.returncode == 2 and unknown.stderr.startswith("hetplan: error: MODEL: unknown model 'llama9'")
    # piped, every cell is whole (rich cut the aliases column at 100 columns: "h100-sxm, h100-sxm5, h…")
    table = hetplan("devices")
    assert table.returncode == 0
    rows = {cells[1]: cells for cells in (re.split(r"\s*[│|]\s*", line) for line in table.stdout.splitlines())
            if len(cells) > 2}  # fmt: skip
    for device in json.loads(devices.stdout):
        assert rows[device["key"]][-2] == ", ".join(device["aliases"]), rows[device["key"]]


def test_simulate_profile_writes_a_loadable_profile(tmp_path):
    out = tmp_path / "h100.json"
    result = hetplan(
        "simulate-profile",
        "--device",
        "h100",
        "--model",
        "llama3-8b",
        "--micro-batches",
        "1,2",
        "--tp",
        "1,2",
        "--out",
        str(out),
    )
    assert result.returncode == 0, result.stderr
    from profiler import load_profile

    profile = load_profile(out)
    assert profile.source == "simulated" and len(profile.entries) == 2 * 2 * 5


@pytest.mark.slow
def test_plan_lower_bound_reports_how_far_any_plan_could_be():
    """`--lower-bound` adds the least iteration time of any plan in the search space and the plan's gap to it."""
    args = ["--cluster", str(EXAMPLES / "a100-v100-32.yaml"), "--model", "gpt3-1.7b", "--dtype", "fp16"]
    made = hetplan("plan", *args, "--global-batch", "128", "--families", "off", "--lower-bound", "--json")
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    bound, iteration = body["iteration_time_lower_bound_s"], body["iteration_time_s"]
    assert 0.8 * iteration < bound <= iteration
    assert body["gap_to_lower_bound"] == pytest.approx(1 - bound / iteration, rel=1e-4)
    plain = hetplan("plan", *args, "--global-batch", "128", "--families", "off", "--json")
    assert "iteration_time_lower_bound_s" not in json.loads(plain.stdout)  # only when asked: it costs a search


def test_launch_prints_one_torchrun_per_node_that_expands_the_master_address(tmp_path):
    plan = tmp_path / "plan.json"
    made = hetplan(
        "plan", "--cluster", str(EXAMPLES / "cpu-hetero.yaml"), "--model", str(EXAMPLES / "models" / "tiny-llama.yaml"),
        "--global-batch", "8", "--out", str(plan), "--quiet",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    result = hetplan("launch", str(plan), "--cluster", str(EXAMPLES / "cpu-hetero.yaml"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split("--node-rank ")[1].split()[0] for line in lines] == [str(i) for i in range(len(lines))]
    assert all('--master-addr "$MASTER_ADDR"' in line and " hetplan run " in line for line in lines)
    as_json = hetplan("launch", str(plan), "--cluster", str(EXAMPLES / "cpu-hetero.yaml"), "--json")
    assert as_json.returncode == 0, as_json.stderr
    nodes = json.loads(as_json.stdout)["nodes"]
    # the same commands, each with where it runs (a re-planned cluster's nodes keep their numbers: not the line's)
    assert [f"{node['command']}  # {node['group']} node {node['node']}" for node in nodes] == lines
    assert [(node["group"], node["node_rank"], node["devices"]) for node in nodes] == [
        ("fast", 0, [0, 1]),
        ("slow", 1, [0, 1]),
    ]
    # paths as given relative to where `launch` ran name the same files from any node's directory
    relative = hetplan("launch", str(plan), "--cluster", "examples/cpu-hetero.yaml", "--out", "run.json")
    assert relative.returncode == 0, relative.stderr
    wanted = f"run {plan} --cluster {EXAMPLES / 'cpu-hetero.yaml'} --out {ROOT / 'run.json'}"
    assert all(wanted in line for line in relative.stdout.splitlines())
    # ... normalised: a path through a parent directory reads as the file it names (it printed "examples/../examples")
    roundabout = hetplan("launch", str(plan), "--cluster", "examples/../examples/cpu-hetero.yaml", "--out", "run.json")
    assert roundabout.returncode == 0 and roundabout.stdout == relative.stdout, roundabout.stderr
    # the run's length (every launched run took run's default 5 steps)
    longer = hetplan("launch", str(plan), "--cluster", str(EXAMPLES / "cpu-hetero.yaml"), "--steps", "20")
    assert longer.returncode == 0 and all(" --steps 20  # " in line for line in longer.stdout.splitlines())
    assert all("--steps" not in line for line in lines)
    # launch writes nothing: the directory of the record is the job's to make (`run` makes it); it was left empty
    record = tmp_path / "new" / "dir" / "run.json"
    elsewhere = hetplan("launch", str(plan), "--cluster", str(EXAMPLES / "cpu-hetero.yaml"), "--out", str(record))
    assert elsewhere.returncode == 0 and f"--out {record}" in elsewhere.stdout and not (tmp_path / "new").exists()


def test_a_cpu_cluster_of_two_lines_plans_in_fp32_and_the_plan_records_what_was_assumed(tmp_path):
    cluster = tmp_path / "laptop.yaml"
    cluster.write_text("name: laptop\ngroups:\n  - {name: cpu, device: cpu, nodes: 1, devices_per_node: 2}\n")
    model = str(EXAMPLES / "models" / "tiny-llama.yaml")
    made = hetplan("plan", "--cluster", str(cluster), "--model", model, "--global-batch", "8", "--json", "-q")
    assert made.returncode == 0, made.stderr
    body = json.loads(made.stdout)
    assert body["training"]["dtype"] == "fp32"
    assert made.stderr.startswith("note: training in fp32 on cpu devices") and made.stderr.count("\n") == 1
    assert body["cluster_defaults"] == {
        "groups[0].nics_per_node": 1,
        "groups[0].nic_gbps": 10.0,
        "network.topology": "clos",
        "network.inter_group_gbps": 10.0,
    }
    chosen = hetplan("plan", "--cluster", str(cluster), "--model", model, "--global-batch", "8", "--dtype", "bf16",
                     "--json", "-q")  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout)["training"]["dtype"] == "bf16" and "note" not in chosen.stderr


def test_a_cpu_plan_says_when_its_ranks_would_share_this_machines_cores():
    """cpu-2x2's plan is timed at a core per device; where it uses more devices than this machine has cores, the
    summary says `hetplan run` here shares them (a newcomer saw 1.0 s planned and 2.3 s predicted for the run)."""
    import os
    import re

    tiny = str(EXAMPLES / "models" / "tiny-llama.yaml")
    result = hetplan("plan", "--cluster", str(EXAMPLES / "cpu-2x2.yaml"), "--model", tiny, "--dtype", "fp32",
                     "--global-batch", "8")  # fmt: skip
    assert result.returncode == 0, result.stderr
    devices = int(re.search(r"\((\d+) devices, (\d+) used\)", result.stdout).group(1))
    cores = len(os.sched_getaffinity(0))
    said = " ".join(result.stdout.split())
    assert (f"its {devices} ranks share {cores} cores here" in said) == (devices > cores)
    if devices > cores:
        assert re.search(r"on this machine `hetplan run` predicts \d+\.\d{3} s: its", said), said


def test_a_cpu_plan_says_what_the_run_here_predicts_where_it_overlaps_nothing(tmp_path):
    """A plan's times overlap the gradient reduction with the backward, as the engines run it; hetplan's runtime
    reduces after the flush, so `hetplan run` predicts it slower (a newcomer: 0.251 s planned, 0.375 s for the run,
    with nothing said). Two ranks on one CPU node: the row (and `local_run` in the JSON) gives the run's time and why;
    one rank has no gradient reduction to overlap, and no row."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two ranks sharing one core would be a second reason")
    tiny = str(EXAMPLES / "models" / "tiny-llama.yaml")
    for devices in (2, 1):
        cluster = tmp_path / f"cpu{devices}.yaml"
        cluster.write_text(f"name: cpu{devices}\ngroups:\n  - {{name: cpu, device: cpu, nodes: 1, devices_per_node: "
                           f"{devices}}}\n")  # fmt: skip
        result = hetplan("plan", "--cluster", str(cluster), "--model", tiny, "--global-batch", "4", "--json", "-q")
        assert result.returncode == 0, result.stderr
        planned = json.loads(result.stdout)
        shown = hetplan("plan", "--cluster", str(cluster), "--model", tiny, "--global-batch", "4", "-q")
        said = " ".join(shown.stdout.split())
        if devices == 1:
            assert "on this machine" not in said and "local_run" not in planned, said
            continue
        assert planned["pipelines"][0]["replicas"] == 2
        assert planned["local_run"]["why"] == [
            "it does not overlap gradient reduction or weight gathering with compute (the engines do, as planned)"
        ]
        assert f"predicts {planned['local_run']['predicted_iteration_time_s']:.3f} s" in said
        found = re.search(r"on this machine `hetplan run` predicts (\d+\.\d{3}) s: it does not overlap gradient", said)
        assert found is not None, said
        assert float(found[1]) > planned["iteration_time_s"] * 1.005
        # predict of the plan file says the same; a flag that repeats the plan's own training changes nothing, one
        # that changes it is a what-if `hetplan run` would not run (no row)
        plan_file = tmp_path / "plan.json"
        saved = hetplan("plan", "--cluster", str(cluster), "--model", tiny, "--global-batch", "4", "-q", "--out",
                        str(plan_file))  # fmt: skip
        assert saved.returncode == 0, saved.stderr
        for flags, shown in (((), True), (("--seq-len", "256"), True), (("--seq-len", "128"), False)):
            predicted = hetplan("predict", "--strategy", str(plan_file), "--cluster", str(cluster), "--json", *flags)
            assert predicted.returncode == 0, predicted.stderr
            local = json.loads(predicted.stdout).get("local_run")
            assert (local is not None) == shown, (flags, local)
            if shown:
                assert local == planned["local_run"]


def test_piped_help_keeps_flag_names_and_bracketed_defaults():
    """Piped, --help is 120 columns wide (at 80 rich cut '--no-sequence-parallel'), and a help text's '[default: 1]'
    is text (typer's rich markup took it for a tag and printed nothing of it)."""
    result = hetplan("predict", "--help")
    assert result.returncode == 0, result.stderr
    assert "--no-sequence-parallel" in result.stdout
    assert "Tensor-parallel degree [default: 1]." in result.stdout
    assert max(len(line) for line in result.stdout.splitlines()) <= 120


def test_command_list_summaries_run_on_without_the_docstrings_line_breaks():
    """`hetplan --help` lists each command with its docstring's first paragraph as one flowing text: typer's rich
    mode kept the docstring's line breaks there, so 'predict' read '... plan.json (with the' and its next line
    'costs ...' with the rest of the row blank."""
    result = hetplan("--help")
    assert result.returncode == 0, result.stderr
    summaries = " ".join(line.strip(" │") for line in result.stdout.splitlines())
    assert "--strategy plan.json (with the costs the plan records" in " ".join(summaries.split())
    rows = [line for line in result.stdout.splitlines() if line.startswith("│ ")]
    for row, following in itertools.pairwise(rows):
        # a row ends short only where its summary ends (the next row names a command) or its panel does
        if len(row.rstrip(" │")) < 80 and following.startswith("│" + " " * 18):
            raise AssertionError(f"a summary broke early:\n{row}\n{following}")


def test_help_without_rich_shows_bracketed_defaults_as_written(monkeypatch: pytest.MonkeyPatch) -> None:
    """With typer's rich help off (TYPER_USE_RICH=0), '[default: 1]' is printed as written: the escape that keeps rich
    from reading it as a markup tag showed as a backslash there."""
    monkeypatch.setenv("TYPER_USE_RICH", "0")
    result = hetplan("predict", "--help")
    assert result.returncode == 0, result.stderr
    assert "Tensor-parallel degree [default: 1]." in result.stdout
    assert "\\[" not in result.stdout


@pytest.mark.slow
def test_a_run_of_a_tied_model_trains_one_matrix(tmp_path):
    """hetplan's runtime held an output matrix of its own: a tied model (tiny-gpt) ran as an untied one, and said so.
    Now the single-process check, whose model ties the matrix (its first loss is the tied model's), matches the run
    (tests/test_runtime.py checks every rank's gradients of tied plans)."""
    pytest.importorskip("torch")
    cluster, plan_file = str(EXAMPLES / "cpu-even.yaml"), str(tmp_path / "p.json")
    model = str(EXAMPLES / "models" / "tiny-gpt.yaml")
    made = hetplan("plan", "-c", cluster, "-m", model, "--global-batch", "4", "--out", plan_file, "--quiet")
    assert made.returncode == 0, made.stderr
    ran = hetplan(
        "run", plan_file, "-c", cluster, "--steps", "1", "--out", str(tmp_path / "r.json"), torch_allowed=True
    )
    assert ran.returncode == 0, ran.stderr
    record = json.loads((tmp_path / "r.json").read_text())
    assert record["model"]["tied_embeddings"] is True
    assert record["reference_match"]["match"], record["reference_match"]
    assert "untied" not in ran.stderr + ran.stdout
