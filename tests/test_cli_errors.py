"""Every way a user can get the command line wrong ends as one line on stderr and exit 2 (usage errors included),
Ctrl-C as 'interrupted' and exit 130, a bug as one line naming HETPLAN_DEBUG and exit 1; and nothing is measured or
searched before the flags and outputs are checked. Most cases run the app in this process (report.failures'
exit_status, as `main` does); Ctrl-C and a missing torch need a real process."""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import cli
from report.failures import DEBUG_HINT, exit_status, failure_line
from specs.errors import SpecError
from tests.conftest import EXAMPLES, NO_TORCH, ROOT, hetplan

CPU = EXAMPLES / "cpu-2x2.yaml"
TINY = str(EXAMPLES / "models" / "tiny-llama.yaml")


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """A valid plan of the tiny Llama on cpu-2x2 and broken copies of it (a wrong cluster name, TP 3, a billion
    replicas, reversed layers), as files."""
    from planner import build_context, compute_bounds, predict
    from planner.plan import Plan
    from specs import load_cluster, load_model, load_training
    from specs.layout import megatron_strategy

    directory = tmp_path_factory.mktemp("plans")
    cluster, model = load_cluster(CPU), load_model(TINY)
    training = load_training(None, {"global_batch_size": 8, "dtype": "fp32"})
    strategy = megatron_strategy(
        cluster, model, training, group=None, tp=1, pp=2, dp=2, micro_batch_size=1, recompute="none"
    )
    ctx = build_context(cluster, model, training)
    good = directory / "good.json"
    Plan(ctx, predict(ctx, strategy), compute_bounds(ctx), 0.0, {}).save(good)
    files = {"good": good}
    breaks = {
        "other-cluster": lambda b: b.update(cluster="elsewhere"),
        "tp3": lambda b: b["pipelines"][0]["stages"][0].update(tp=3, devices=6),  # the figure made to agree
        "replicas": lambda b: (
            b["pipelines"][0].update(replicas=10**9),
            [stage.update(devices=10**9) for stage in b["pipelines"][0]["stages"]],  # the figures made to agree
            b["pipelines"][0].pop("replica_batches"),  # a figure may be left out
        ),
        "reversed": lambda b: b["pipelines"][0]["stages"][0].update(layers=[4, 0]),
        "fp8": lambda b: b["training"].update(dtype="fp8"),
        "per-node": lambda b: (b.update(zero_shard="node"), b["training"].update(zero_shard="node")),
        # figures the plan repeats for its readers, edited by hand (they changed nothing, without a word)
        "batch-summary": lambda b: b.update(global_batch_size=1000),
        "samples-summary": lambda b: b["pipelines"][0].update(samples_per_replica=31),
        "family-samples": lambda b: b["pipelines"][0].update(family_samples=4),
        "stage-devices": lambda b: b["pipelines"][0]["stages"][1].update(devices=4),
        "tp-edited": lambda b: b["pipelines"][0]["stages"][0].update(tp=2),  # its devices figure left as tp 1 gives
        "tp3-edited": lambda b: b["pipelines"][0]["stages"][0].update(tp=3),  # a tp no stage can have
        # every stage's tp edited: each devices figure is stale, the first named and the others after it
        "tp-edited-all": lambda b: [stage.update(tp=2) for stage in b["pipelines"][0]["stages"]],
        "schedule": lambda b: b.update(schedule="interleaved-1f1b"),
        "stage-device": lambda b: b["pipelines"][0]["stages"][0].update(device="h100"),
        "stage-device-alias": lambda b: b["pipelines"][0]["stages"][0].update(device="CPU"),  # the same device
        "stage-group": lambda b: b["pipelines"][0]["stages"][1].update(group="cpuu"),
        "replica-split": lambda b: b["pipelines"][0]["replica_batches"][0].update(samples=-40),
        # 3 replicas sharing 8 micro-batches, the replica split left as 2 replicas gave (its other figures agree)
        "replicas-edited": lambda b: b["pipelines"][0].update(
            replicas=3, num_microbatches=3, total_microbatches=8, samples_per_replica=3, batch_weight=0.375
        ),
        "batch-weight": lambda b: b["pipelines"][0].update(batch_weight=0.25),
        # a misspelt setting (it was ignored: the default ran instead)
        "typo": lambda b: b.update(virtual_stage=2),
        "stage-typo": lambda b: b["pipelines"][0]["stages"][1].update(device_ofset=1),
        "pipeline-typo": lambda b: b["pipelines"][0].update(context_paralel=2),
        # defaults every family and stage overrides (a plan writes each one's), and numbers written as text
        "zero-default": lambda b: b.update(zero_stage=3),
        "recompute-default": lambda b: b.update(recompute="full"),
        "training-zero": lambda b: b["training"].update(zero_stage=3),
        "training-shard": lambda b: b["training"].update(zero_shard="node"),
        "replicas-text": lambda b: b["pipelines"][0].update(replicas="2"),
        "layers-float": lambda b: b["pipelines"][0]["stages"][0].update(layers=[0, 2.0]),
        "stage-recompute-null": lambda b: b["pipelines"][0]["stages"][0].update(recompute=None),
    }
    for name, change in breaks.items():
        broken = json.loads(good.read_text())
        change(broken)
        files[name] = directory / f"{name}.json"
        files[name].write_text(json.dumps(broken))
    return files


def run(capsys, *args: str) -> tuple[int, list[str], str]:
    """The exit status, the stderr lines and stdout of `hetplan args` run in this process."""
    code = exit_status(cli.app, list(args))
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def one_error(capsys, *args: str) -> str:
    """Run `args`, which must fail as a user error: exit 2 and exactly one line; returns the line."""
    code, lines, _ = run(capsys, *args)
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith("hetplan: error: ")
    return lines[0]


PLAN = ("plan", "--cluster", str(CPU), "--model", TINY)
TRAFFIC_CALC = ("traffic-calc", "-m", "llama3-8b", "--tokens", "1e9", "--global-batch", "8", "--gpus", "8")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "missing command: one of plan, predict"),
        (("bogus",), "No such command 'bogus'"),
        (("plan", "--bogus"), "No such option: --bogus"),
        # a misspelling gets its option; an option the command lacks gets no guess (click offered --group, --recompute
        # and --tp for predict's --out)
        (
            ("predict", "-c", str(CPU), "--globl-batch", "3"),
            "No such option: --globl-batch (did you mean --global-batch?) (see",
        ),
        (("predict", "-c", str(CPU), "--out", "x.json"), "No such option: --out (see 'hetplan predict --help')"),
        (("plan", "--o\x1b[31mx"), "No such option: --o\\x1b[31mx (see"),  # no terminal escape from the command line
        (("plan", "--cluster", str(CPU)), "Missing option '--model'"),
        ((*PLAN, "--top-k", "0"), "--top-k: expected a value >= 1, got '0' (see"),
        ((*PLAN, "--global-batch", "1e3"), "--global-batch: expected an integer, got '1e3' (see"),
        ((*PLAN, "--top-k=x8"), "--top-k: expected an integer, got 'x8' (see"),  # the value named, as in files
        ((*PLAN, "--seq-len", "0"), "--seq-len: "),  # not silently the model's
        ((*PLAN, "--zero-stage", "4"), "--zero-stage: expected 0, 1, 2 or 3"),
        ((*PLAN, "--uneven-batch", "always"), "--uneven-batch: expected 'off', 'refine' or 'exhaustive'"),
        ((*PLAN, "--micro-batch-sizes", "1,x"), "--micro-batch-sizes: expected integers >= 1"),
        # an empty value is refused (it was taken for the flag left out, or a path for the current directory)
        ((*PLAN, "--engine", ""), "--engine: expected a value, got '' (an empty argument)"),
        ((*PLAN, "--zero-shard", ""), "--zero-shard: expected a value, got ''"),
        ((*PLAN, "--recompute="), "--recompute: expected a value, got ''"),
        (("plan", "-c", "", "-m", TINY), "--cluster: expected a value, got ''"),
        (("plan", "-c", str(CPU), "--model="), "--model: expected a value, got ''"),
        (("export", "", "--out", "x"), "PLAN: expected a value, got ''"),
        ((*PLAN, "--bogus="), "No such option: --bogus"),
        ((*PLAN, "--json", ""), "unexpected extra argument"),
        ((*PLAN, "--json="), "Option '--json' does not take a value"),  # a switch: click says so
        ((*PLAN, "--engine", "nemo"), "error: --engine: unknown engine 'nemo'; expected one of: megatron"),
        (
            (*PLAN, "--global-batch", "8", "--micro-batch-sizes", "16"),
            "error: --micro-batch-sizes: the micro-batch sizes [16] are all larger than the global batch (8 sequences)",
        ),
        ((*PLAN, "--out", "/proc/no/such/plan.json"), "--out: /proc/no/such/plan.json: cannot create its directory"),
        (
            ("traffic-calc", "-m", "llama3-8b", "--tokens", "1e9", "--global-batch", "0", "--gpus", "8"),
            "--global-batch",
        ),
        (("traffic-calc", "-m", "llama3-8b", "--tokens", "-1e9", "--global-batch", "8", "--gpus", "8"), "--tokens: ex"),
        (("traffic-calc", "-m", "llama3-8b", "--tokens", "nan", "--global-batch", "8", "--gpus", "8"), "got nan"),
        ((*TRAFFIC_CALC, "--grad-bytes", "3"), "--grad-bytes: expected 1 (FP8), 2 (bf16/fp16) or 4 (fp32), got 3"),
        (
            (*TRAFFIC_CALC, "--seq-len", "0"),
            "--seq-len: ",
        ),
        (("simulate-profile", "--device", "h100", "-m", "llama3-8b", "--tp", "0", "--out", "x.json"), "--tp: expected"),
        (
            ("simulate-profile", "--device", "h100", "-m", "llama3-8b", "--micro-batches", "0", "--out", "x.json"),
            "--micro-batches: expected integers >= 1",
        ),
        (("simulate-profile", "--device", "h100", "-m", "llama3-8b", "--noise", "inf", "--out", "x.json"), "--noise"),
        (("profile", "-m", TINY, "--micro-batches", "0", "--out", "p.json"), "--micro-batches: expected integers"),
        (("profile", "-m", TINY, "--micro-batches", "1,,4", "--out", "p.json"), "expected integers >= 1 (comma"),
        (("profile", "-m", TINY, "--recompute", "some", "--out", "p.json"), "--recompute: expected some of none"),
        (("profile-comm", "--max-size", "inf", "--out", "l.json"), "--max-size: expected a size from 4B to 16GiB"),
        (("profile-comm", "--min-size", "1MiB", "--max-size", "4KiB", "--out", "l.json"), "min-size <= max-size"),
        (("profile-comm", "--link-class", "spine", "--out", "l.json"), "--link-class: expected one of auto, in_node"),
        (("profile-comm", "--world", "1", "--out", "l.json"), "--world: expected process counts from 2 to"),
        (("profile-comm", "--world", "2,1000", "--out", "l.json"), "local processes per core"),  # not 1000 processes
        (("profile", "-m", TINY, "--device", "npu:0", "--out", "p.json"), "'npu:0' is not available on this machine"),
        (("profile-comm", "--timeout", "nan", "--out", "l.json"), "--timeout: expected a finite number > 0"),
        (("comm-bench", "--sizes", "1e30"), "--sizes: expected a size"),
        (("comm-bench", "--world", "100000"), "--world: "),
        (
            ("simulate-profile", "--device", "h100", "--model", "llama2-7b", "--tp", "3", "--out", "sp.json"),
            "--tp: 3 must divide the model's 32 kv heads and ffn size",
        ),
        # a value listed twice wrote a profile with a second entry of one shape, which every reader then refused
        (
            ("simulate-profile", "--device", "h100", "--model", "llama2-7b", "--micro-batches", "2,1,2", "--out", "s"),
            "--micro-batches: expected each value once, got '2,1,2' (2 twice)",
        ),
        ((*PLAN, "--micro-batch-sizes", "1,2,1"), "--micro-batch-sizes: expected each value once, got '1,2,1'"),
    ],
)
def test_usage_and_flag_errors_are_one_line_and_exit_2(capsys, tmp_path, monkeypatch, args, expected):
    monkeypatch.chdir(tmp_path)
    assert expected in one_error(capsys, *args)
    assert not list(tmp_path.iterdir()), "nothing is written when a flag is wrong"


def test_a_run_given_twice_is_refused_where_it_would_count_twice(capsys, tmp_path, monkeypatch):
    """A copy of the bundled published runs given to `fit --runs` counted every run twice ("calibrated on 22 runs"),
    and a file given twice to validate weighed its errors double: refused, naming the user's file and the other."""
    from predictor.predictor import PUBLISHED_RUNS

    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "pub.json"
    copy.write_text(PUBLISHED_RUNS.read_text())
    line = one_error(capsys, "fit", "--runs", str(copy), "--out", "p.joblib")
    assert line.startswith(f"hetplan: error: {copy}: runs: run '"), line
    assert "is also among the published runs `fit` reads unless --no-published-runs: it would count twice" in line
    line = one_error(capsys, "validate", str(copy), str(PUBLISHED_RUNS))
    assert line.startswith(f"hetplan: error: {PUBLISHED_RUNS}: runs: run '") and f"is also in {copy}:" in line, line
    assert not (tmp_path / "p.joblib").exists()


def test_an_output_that_is_a_document_of_another_kind_is_not_replaced(capsys, tmp_path, monkeypatch, plans):
    """`simulate-profile --out my.plan.json` replaced the plan with a profile and `--out model.yaml` a model file,
    without a word: an existing document of another kind than the command writes is refused (one of its own kind, or
    a file that is none of the project's documents, is replaced as before)."""
    monkeypatch.chdir(tmp_path)
    plan_copy, model_copy = tmp_path / "my.plan.json", tmp_path / "model.yaml"
    plan_copy.write_text(plans["good"].read_text())
    model_copy.write_text(Path(TINY).read_text())
    simulate = ("simulate-profile", "--device", "h100", "--model", "llama2-7b", "--out")
    for existing, kind in ((plan_copy, "a plan"), (model_copy, "a model file")):
        before = existing.read_text()
        line = one_error(capsys, *simulate, str(existing))
        assert f"--out: {existing}: is {kind}: expected a new file or a device profile to replace" in line, line
        assert existing.read_text() == before
    line = one_error(capsys, *PLAN, "--out", str(model_copy))
    assert "is a model file: expected a new file or a plan to replace" in line
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    for out in ("profile.json", "profile.json", "notes.json"):  # a new file, one of its kind, none of the documents
        code, lines, _ = run(capsys, *simulate, out)
        assert code == 0, lines


def test_a_long_message_keeps_its_end_where_the_other_mistakes_are_listed():
    from report.failures import one_line

    line = one_line("x" * 900 + " (also wrong: groups[1].nodes)")
    assert len(line) == 500 and line.endswith("x (also wrong: groups[1].nodes)") and "..." in line


def test_a_profiles_directory_without_some_devices_profiles_says_whose_costs_are_the_datasheets(capsys, tmp_path):
    """`--profiles` that leaves a device of the cluster unprofiled (an empty directory: every device) plans on its
    datasheet costs and says so in one line; a directory that covers every device says nothing."""
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    plan = (
        "plan",
        "--cluster",
        str(EXAMPLES / "h100-mi300x.yaml"),
        "--model",
        "llama3-8b",
        "--profiles",
        str(profiles),
    )
    said = f"note: --profiles {profiles} has no profile of "
    expected = [[said + "h100, mi300x: their costs are the datasheet's (simulated)"]]
    expected += [[said + "mi300x: its costs are the datasheet's (simulated)"], []]
    for lines, profiled in zip(expected, ("h100", "mi300x", None), strict=True):
        assert run(capsys, *plan)[:2] == (0, lines)
        if profiled is not None:  # one more device's profile for the next plan
            out = str(profiles / f"{profiled}.json")
            assert run(capsys, "simulate-profile", "--device", profiled, "-m", "llama3-8b", "--out", out)[0] == 0


def test_predict_with_megatron_flags_notes_only_its_groups_unprofiled_device(capsys, tmp_path):
    """`predict --group` runs on one group: the --profiles note names that group's device if unprofiled, not the
    cluster's other devices."""
    out = str(tmp_path / "h100.json")
    assert run(capsys, "simulate-profile", "--device", "h100", "-m", "llama3-8b", "--out", out)[0] == 0
    flags = ("predict", "-c", str(EXAMPLES / "h100-mi300x.yaml"), "-m", "llama3-8b", "--profiles", str(tmp_path))
    assert run(capsys, *flags, "--group", "h100", "--tp", "8", "--json")[:2] == (0, [])
    code, lines, _ = run(capsys, *flags, "--group", "mi300x", "--json")
    assert code == 0 and lines == [
        f"note: --profiles {tmp_path} has no profile of mi300x: its costs are the datasheet's (simulated)"
    ]


def test_bf16_is_refused_only_on_the_groups_a_strategy_uses(capsys):
    """A100 beside V100: `predict --group a100` trains in bf16, as on a cluster of A100s alone (the whole cluster was
    refused: 'group v100: v100 has no bf16'); the V100 group's own prediction says it trains in fp16, and refuses
    bf16 when asked for, naming the group."""
    flags = ("predict", "-c", str(EXAMPLES / "a100-v100-32.yaml"), "-m", "gpt3-6.7b", "--tp", "8")
    for extra in ((), ("--dtype", "bf16")):
        code, lines, out = run(capsys, *flags, "--group", "a100", *extra, "--json")
        assert (code, lines) == (0, []) and json.loads(out)["training"]["dtype"] == "bf16"
    code, lines, out = run(capsys, *flags, "--group", "v100", "--json")
    assert code == 0 and json.loads(out)["training"]["dtype"] == "fp16"
    assert lines[0].startswith("note: training in fp16 (v100 has no bf16)")
    code, lines, _ = run(capsys, *flags, "--group", "v100", "--dtype", "bf16")
    assert code == 2 and lines[0].endswith("group v100: v100 has no bf16: train in fp16 (--dtype fp16)")
    code, lines, out = run(capsys, *flags, "--group", "a100", "--dtype", "fp8", "--json")
    assert code == 0 and lines == ["note: a100-80gb has no FP8: its GEMMs run in bf16 (as predicted)"]


def test_predict_takes_sequence_parallelism_from_the_training_file_unless_the_flag_says(capsys, write):
    """Megatron-style flags: --sequence-parallel defaulted to on over a training file's `sequence_parallel: false`."""
    training = str(write("sp.yaml", "sequence_parallel: false\n"))
    flags = ("predict", "-c", str(EXAMPLES / "a100-v100-32.yaml"), "-m", "gpt3-6.7b", "--group", "a100", "--tp", "8")
    for extra, expected in (((), False), (("--sequence-parallel",), True)):
        code, _, out = run(capsys, *flags, "--training", training, "--dtype", "fp16", *extra, "--json")
        assert code == 0 and json.loads(out)["sequence_parallel"] is expected


def test_help_and_listings_are_successes(capsys):
    for args in (("--help",), ("-h",), ("plan", "--help"), ("plan", "-h"), ("devices",), ("models", "--json")):
        code, lines, out = run(capsys, *args)
        assert code == 0 and not lines and out


def test_version_is_the_installed_one(capsys):
    from importlib.metadata import version

    code, lines, out = run(capsys, "--version")
    assert code == 0 and not lines and out.strip() == f"hetplan {version('hetplan')}"


def test_a_torchrun_rank_ends_with_its_status_after_its_threads_without_the_interpreters_teardown(monkeypatch, capsys):
    """A rank of a torchrun job (torch imported) ends by os._exit with its command's status once its threads have
    ended and its logs and output are flushed: torch's teardown once aborted a finished rank. Elsewhere the usual
    sys.exit."""
    import logging
    import threading
    import types

    ended: list[tuple[int, bool]] = []  # (status, a thread still running then)
    logs_shut: list[bool] = []

    def fake_exit(code: int) -> None:
        ended.append((code, late.is_alive()))
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(logging, "shutdown", lambda: logs_shut.append(True))
    monkeypatch.setitem(sys.modules, "torch", sys.modules.get("torch") or types.ModuleType("torch"))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(name, value)
    for args, code in ((["--version"], 0), (["plan", "--cluster", "missing.yaml", "--model", "tiny"], 2)):
        late = threading.Thread(target=time.sleep, args=(0.3,))
        late.start()
        monkeypatch.setattr(sys, "argv", ["hetplan", *args])
        with pytest.raises(SystemExit) as caught:
            cli.main()
        assert caught.value.code == code and ended[-1] == (code, False)
    assert logs_shut == [True, True] and capsys.readouterr().out.startswith("hetplan ")
    monkeypatch.delenv("RANK")
    with pytest.raises(SystemExit) as caught:
        cli.main()
    assert caught.value.code == 2 and len(ended) == 2  # not a rank: sys.exit


@pytest.mark.parametrize(
    "args", [["--version"], ["plan", "--help"], ["plan", "--cluster", str(CPU), "--model", TINY, "--dtype", "fp32"]]
)
def test_an_output_whose_reader_went_away_ends_in_silence_as_shell_tools_do(args):
    """`hetplan ... | head -1` once `head` has gone: no line, no traceback, the status a shell gives `cat` there
    (141), whether the project's printing met the closed pipe or rich's (help, which points stdout at /dev/null)."""
    from report.failures import READER_GONE_STATUS

    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader has gone before a byte is written
    try:
        command = [sys.executable, "-c", NO_TORCH, *args]
        ended = subprocess.run(command, cwd=ROOT, stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write_end)
    assert (ended.returncode, ended.stderr) == (READER_GONE_STATUS, "")


def test_a_broken_pipe_that_is_not_the_outputs_is_a_failure_with_its_line(monkeypatch, capsys):
    """A peer's socket closing under a command (stdout intact) is reported, not taken for `| head`."""
    import typer

    app = typer.Typer()

    @app.command()
    def send() -> None:
        raise BrokenPipeError(32, "Broken pipe")

    @app.command()
    def other() -> None:  # two commands: `send` is a subcommand, as hetplan's are
        pass

    assert exit_status(app, ["send"]) == 2
    assert capsys.readouterr().err == "hetplan: error: Broken pipe\n"
    import report.failures as failures

    monkeypatch.setattr(failures, "stdout_is_null", lambda: True)  # `hetplan ... > /dev/null`: it was silent 141
    assert exit_status(app, ["send"]) == 2
    assert capsys.readouterr().err == "hetplan: error: Broken pipe\n"
    null_now = iter([False, True])  # a pipe before the command, the null device after: rich's, on a broken pipe
    monkeypatch.setattr(failures, "stdout_is_null", lambda: next(null_now))
    assert exit_status(app, ["send"]) == failures.READER_GONE_STATUS
    assert capsys.readouterr().err == ""


def test_a_ctrl_c_while_a_rank_waits_for_its_threads_ends_it_as_interrupted(monkeypatch, capsys):
    """A Ctrl-C during a torchrun rank's wait for its threads ends the rank with 130 and one line, no traceback."""
    import logging
    import threading

    from profiler.machine import end_rank_without_teardown

    class Interrupted(threading.Thread):
        def join(self, timeout: float | None = None) -> None:
            raise KeyboardInterrupt

    ended: list[int] = []

    def fake_exit(code: int) -> None:
        ended.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(logging, "shutdown", lambda: None)  # pytest's log capture stays open
    waiting = Interrupted(target=time.sleep, args=(0.3,))
    waiting.start()
    with pytest.raises(SystemExit):
        end_rank_without_teardown(0)
    waiting_output = capsys.readouterr()
    assert ended == [130] and waiting_output.err == "hetplan: interrupted\n"


def test_predict_runs_a_plan_at_the_zero_stage_and_shard_its_flags_give(capsys, tmp_path, monkeypatch, plans):
    """`predict --strategy plan.json --zero-stage N` evaluates every family at stage N (the flag changed the plan's
    training only, which a plan's families do not read: the same stage and memory were printed)."""
    monkeypatch.chdir(tmp_path)

    def predicted(*flags: str) -> dict:
        code, lines, out = run(capsys, "predict", "-c", str(CPU), "--strategy", str(plans["good"]), *flags, "--json")
        assert code == 0, lines
        return json.loads(out)

    as_planned, sharded = predicted(), predicted("--zero-stage", "3")
    assert as_planned["zero_stage"] == 1 and [p["zero_stage"] for p in as_planned["pipelines"]] == [1]
    assert sharded["zero_stage"] == 3 and [p["zero_stage"] for p in sharded["pipelines"]] == [3]
    memory = [[stage["memory_bytes"] for stage in b["pipelines"][0]["stages"]] for b in (as_planned, sharded)]
    assert all(z3 < z1 for z1, z3 in zip(*memory, strict=True))  # weights and gradients sharded too
    assert predicted("--zero-shard", "node")["zero_shard"] == "node"


@pytest.mark.parametrize(
    ("plan", "extra", "expected"),
    [
        ("tp3", (), "pipelines[0].stages[0].tp: expected a divisor of 2 devices per node"),
        ("replicas", (), "pipelines[0].total_microbatches: expected 1000000000 replicas"),
        ("reversed", (), "pipelines[0].stages[0].layers: expected [0, end > 0)"),
        ("other-cluster", (), "the plan is for cluster 'elsewhere', got 'cpu-2x2'"),
        ("good", ("--tokens", "nan"), "--tokens: expected a finite number > 0, got nan"),
        ("good", ("--epochs", "inf", "--tokens", "1e9"), "--epochs: expected a finite number > 0, got inf"),
        ("good", ("--epochs", "2"), "--epochs: counts epochs of --tokens"),  # it was dropped without a word
        ("good", ("--png", "heatmap.txt"), "--png: heatmap.txt: expected a file name ending in .png"),
    ],
)
def test_traffic_checks_the_plan_and_its_flags(capsys, tmp_path, monkeypatch, plans, plan, extra, expected):
    """`traffic` runs the structure check the other commands run (it used to raise IndexError, MemoryError or
    StopIteration, or count a reversed plan); every flag is checked before counting."""
    monkeypatch.chdir(tmp_path)
    assert expected in one_error(capsys, "traffic", str(plans[plan]), "--cluster", str(CPU), *extra)


def test_a_stage_device_written_by_alias_or_another_case_is_the_groups(capsys, tmp_path, monkeypatch, plans):
    monkeypatch.chdir(tmp_path)
    code, lines, _ = run(capsys, "explain", str(plans["stage-device-alias"]), "-c", str(CPU))
    assert code == 0, lines


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("explain", "{good}", "-c", str(CPU), "--png", "x.txt"), "--png: x.txt: expected a file name ending in .png"),
        (("explain", "{good}", "-c", str(CPU), "--html", "x.png"), "--html: x.png: expected a file name ending in"),
        (("explain", "{tp3}", "-c", str(CPU)), "stages[0].tp: expected a divisor"),
        (("explain", "{batch-summary}", "-c", str(CPU)), "global_batch_size: 1000 disagrees with training.global_"),
        (("export", "{samples-summary}", "-c", str(CPU), "-f", "megatron"), "pipelines[0].samples_per_replica: 31 dis"),
        (("explain", "{family-samples}", "-c", str(CPU)), "pipelines[0].family_samples: 4 disagrees with"),
        # the figure a stage's tp decides is named with the product (a hand-edited tp read as a devices error)
        (
            ("explain", "{stage-devices}", "-c", str(CPU)),
            "stages[1].devices: 4 disagrees with pipelines[0]'s replicas x its context_parallel x the stage's tp "
            "(2 x 1 x 1), 2, which decides it",
        ),
        (("explain", "{replica-split}", "-c", str(CPU)), "pipelines[0].replica_batches[0].samples: -40 disagrees w"),
        # a replica split in its replicas x samples (its dicts ran past the line's length and were cut in a word)
        (
            ("explain", "{replicas-edited}", "-c", str(CPU)),
            "pipelines[0].replica_batches: 2 x 4 samples disagrees with pipelines[0]'s micro-batch size and counts, 2 x"
            " 3 + 1 x 2 samples, which decides it",
        ),
        # a stage's tp edited by hand: the devices figure it left behind says which tp it was
        (
            ("explain", "{tp-edited}", "-c", str(CPU)),
            "(2 x 1 x 2), 4, which decides it; 2 is what tp 1 gives: if tp was edited from 1, change replicas with it "
            "to keep the stage's devices, or make this figure agree",
        ),
        # run's flags named as the flags (--dtype read "training flags: dtype"; --inject-failure "--max-restarts")
        (("run", "{good}", "-c", str(CPU), "--out", "r.json", "--dtype", "fp64"), "--dtype: expected 'bf16', 'fp16'"),
        (
            ("run", "{good}", "-c", str(CPU), "--out", "r.json", "--inject-failure", "1:2"),
            "--inject-failure: a run that survives failures needs --checkpoint-dir to resume from",
        ),
        (("explain", "{tp-edited-all}", "-c", str(CPU)), "figure agree (also wrong: pipelines[0].stages[1].devices)"),
        # ... to a tp that cannot split the layer: said before the stale figure (it named the figure alone)
        (
            ("explain", "{tp3-edited}", "-c", str(CPU)),
            "which decides it; tp 3 does not split the 4 kv heads nor FFN 1408 into equal parts (a stage's TP must); 2 "
            "is what tp 1 gives",
        ),
        (("predict", "-c", str(CPU), "--strategy", "{batch-weight}"), "pipelines[0].batch_weight: 0.25 disagrees"),
        (("predict", "-c", str(CPU), "--strategy", "{schedule}"), "schedule: 'interleaved-1f1b' disagrees with"),
        (("explain", "{stage-device}", "-c", str(CPU)), "pipelines[0].stages[0].device: 'h100' is not group 'cpu'"),
        (("predict", "-c", str(CPU), "--strategy", "{stage-device}"), "stages[0].device: 'h100' is not group 'cpu'"),
        (("explain", "{typo}", "-c", str(CPU)), "typo.json: virtual_stage: unknown field"),
        (("export", "{stage-typo}", "-c", str(CPU), "-f", "megatron"), "pipelines[0].stages[1].device_ofset: unknown"),
        (("run", "{pipeline-typo}", "-c", str(CPU), "--out", "r.json"), "pipelines[0].context_paralel: unknown field"),
        (("predict", "-c", str(CPU), "--strategy", "{other-cluster}"), "the plan is for cluster 'elsewhere'"),
        # a default no family or stage takes, edited by hand, changed nothing; text for a number was taken as one
        (("explain", "{zero-default}", "-c", str(CPU)), "zero_stage: 3 is no family's (each sets its own pipelines"),
        (("explain", "{recompute-default}", "-c", str(CPU)), "recompute: 'full' is no stage's (each sets its own"),
        # the training's ZeRO stage and scope are the search's: the plan's families take their own
        (("explain", "{training-zero}", "-c", str(CPU)), "training.zero_stage: 3 is not the plan's zero_stage (1)"),
        (("predict", "-c", str(CPU), "--strategy", "{training-shard}"), "training.zero_shard: node is not the plan's"),
        (("explain", "{replicas-text}", "-c", str(CPU)), "pipelines[0].replicas: expected an integer, got '2'"),
        (("explain", "{layers-float}", "-c", str(CPU)), "pipelines[0].stages[0].layers[1]: expected an integer"),
        # a stage's written null took the plan's mode (a hand edit may have meant none); leaving it out still does
        (
            ("predict", "-c", str(CPU), "--strategy", "{stage-recompute-null}"),
            "pipelines[0].stages[0].recompute: expected none, selective or full (leave the field out for the plan's",
        ),
        # a stage's group the cluster has not is the plan's field (the line named the cluster file)
        (("explain", "{stage-group}", "-c", str(CPU)), "stage-group.json: pipelines[0].stages[1].group: expected a g"),
        (("predict", "-c", str(CPU), "--strategy", "{good}", "--seq-len", "0"), "--seq-len: "),
        # a plan's layout and training are its own: a flag that would change them is refused (they were dropped)
        (("predict", "-c", str(CPU), "--strategy", "{good}", "--tp", "1"), "--tp: goes with the Megatron-style flags"),
        (("predict", "-c", str(CPU), "--strategy", "{good}", "--recompute", "full"), "--recompute: goes with the"),
        (("predict", "-c", str(CPU), "--strategy", "{good}", "--training", "t.yaml"), "--training: goes with the"),
        # a Megatron-style flag's layout the cluster cannot run is named as the flag (was "flags: pipelines[0]...")
        (("predict", "-c", str(CPU), "--model", "llama2-7b", "--dtype", "fp32", "--tp", "3"), "error: --tp: expected"),
        # TP wider than a node is named as such before the devices the layout needs ("tp x pp x dp: 8 exceeds the 4")
        (
            ("predict", "-c", str(CPU), "--model", "llama2-7b", "--dtype", "fp32", "--tp", "4", "--pp", "2"),
            "error: --tp: expected a divisor of the 2 devices per node of group 'cpu' (TP stays inside a node), got 4",
        ),
        (("export", "{reversed}", "-c", str(CPU), "-f", "megatron", "--out", "e"), "stages[0].layers: expected"),
        (("export", "{good}", "-c", str(CPU), "-f", "megatron", "--out", "{good}"), "exists and is not a directory"),
        (
            ("replan", "{good}", "-c", str(CPU), "--without", "node:cpu/1", "--without", "node:cpu/node1"),
            "--without: node:cpu/node1: names the node 'node:cpu/1' already named",
        ),
        (("replan", "{good}", "-c", str(CPU)), "--without/--add: say what changed"),
        (("replan", "{good}", "-c", str(CPU), "--add", "group:cpu:0"), "--add: group:cpu:0: expected a count of"),
        (("replan", "{good}", "-c", str(CPU), "--without", "group:cpu:-1"), "expected a count of nodes from 1 to 2"),
        (("replan", "{replicas}", "-c", str(CPU), "--without", "node:cpu/1"), "total_microbatches"),
        (("run", "{other-cluster}", "-c", str(CPU), "--out", "r.json"), "the plan is for cluster 'elsewhere'"),
        (("launch", "{fp8}", "-c", str(CPU)), "training.dtype: hetplan's runtime has no FP8 GEMMs"),
        (("run", "{good}", "-c", str(CPU), "--out", "r.json", "--dtype", "fp8"), "error: --dtype: fp8 training needs"),
        (("launch", "{per-node}", "-c", str(CPU)), "zero_shard: the local runtime shards ZeRO over the whole"),
        (("run", "{per-node}", "-c", str(CPU), "--out", "r.json"), "plan with --zero-shard dp to run it"),
    ],
)
def test_commands_that_read_a_plan_check_it_and_their_outputs_first(
    capsys, tmp_path, monkeypatch, plans, args, expected
):
    monkeypatch.chdir(tmp_path)
    filled = [str(plans[arg[1:-1]]) if arg.startswith("{") else arg for arg in args]
    assert expected in one_error(capsys, *filled)
    assert not [path for path in tmp_path.rglob("*") if path.is_file()], "nothing is written when the input is wrong"


def test_input_files_that_are_not_text_or_are_bombs_are_one_line(capsys, tmp_path):
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe name: x")
    bomb = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"{chr(c)}: &{chr(c)} [{', '.join([f'*{chr(c - 1)}'] * 9)}]\n" for c in range(ord("b"), ord("k"))
    )
    (tmp_path / "bomb.yaml").write_text(bomb)
    (tmp_path / "inf.yaml").write_text(
        (EXAMPLES / "cpu-2x2.yaml").read_text().replace("nic_gbps: 10", "nic_gbps: .inf")
    )
    started = time.monotonic()
    for name, expected in (("binary", "not UTF-8"), ("bomb", "aliases expand"), ("inf", "finite")):
        line = one_error(capsys, "plan", "--cluster", str(tmp_path / f"{name}.yaml"), "--model", TINY)
        assert f"{name}.yaml" in line and expected in line
    assert time.monotonic() - started < 30  # a bomb expanded would take minutes; a loaded first import, seconds


def _profiles(tmp_path: Path, change) -> Path:
    """A directory with one simulated profile of the tiny Llama, changed by `change(body)`."""
    from profiler.simulated import SimulatedDevice
    from specs import load_model
    from specs.device import get_device

    model = load_model(TINY)
    profile = SimulatedDevice(get_device("cpu"), model, model.seq_length, "fp32").to_profile((1, 2), (1,))
    body = json.loads(profile.to_json())
    change(body)
    directory = tmp_path / "profiles"
    directory.mkdir()
    (directory / "cpu.json").write_text(json.dumps(body))
    return directory


def _too_fast(body: dict) -> None:
    body["entries"][0]["backward_time_s"] = 1e-30


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (lambda body: body["entries"].append(body["entries"][0]), "a second entry for decoder b=1 tp=1 none"),
        (_too_fast, "entries[0].backward_time_s: 1e-30 s means"),
    ],
)
def test_profiles_with_duplicate_or_impossible_entries_are_refused(capsys, tmp_path, change, expected):
    """Duplicates and times no device could reach (1e-30 s gave an MFU of 1,180) are refused by `fit` and by
    `plan --profiles`, before any fitting or search."""
    profiles = _profiles(tmp_path, change)
    assert expected in one_error(capsys, "fit", "--profiles", str(profiles), "--out", str(tmp_path / "p.joblib"))
    assert expected in one_error(capsys, *PLAN, "--profiles", str(profiles), "--dtype", "fp32")
    assert not (tmp_path / "p.joblib").exists()


def test_a_bug_is_one_line_with_the_debug_hint_and_the_traceback_on_request(capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    monkeypatch.setattr("report.traffic_calc", broken)
    args = ("traffic-calc", "-m", "llama3-8b", "--tokens", "1e9", "--global-batch", "8", "--gpus", "8")
    code, lines, _ = run(capsys, *args)
    assert code == 1 and len(lines) == 1
    assert lines[0] == f"hetplan: internal error: ZeroDivisionError: float division by zero ({DEBUG_HINT})"
    monkeypatch.setenv("HETPLAN_DEBUG", "1")
    code, lines, _ = run(capsys, *args)
    assert code == 1 and lines[0] == "Traceback (most recent call last):" and lines[-1].endswith(f"({DEBUG_HINT})")


def test_ctrl_c_in_a_command_exits_130_with_one_line(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("planner.plan", interrupted)
    code, lines, out = run(capsys, *PLAN, "--dtype", "fp32", "--json")  # (no note that the cpu cluster trains fp32)
    assert (code, lines, out) == (130, ["hetplan: interrupted"], "")


def test_failure_lines_name_the_file_and_stay_short():
    line, code = failure_line(OSError(28, "No space left on device", "/dev/full"))
    assert (line, code) == ("hetplan: error: /dev/full: No space left on device", 2)
    line, code = failure_line(RuntimeError("x" * 5000 + "\n" + "y"))
    assert code == 1 and len(line) < 300 and "\n" not in line
    assert failure_line(MemoryError())[1] == 2


def _stderr_line(process: subprocess.Popen[str], timeout_s: float) -> str:
    """The next line the process writes on stderr, waiting at most `timeout_s` (never a bare blocking read)."""
    assert process.stderr is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stderr, selectors.EVENT_READ)
        assert selector.select(timeout_s), f"no line on stderr within {timeout_s} s"
        return process.stderr.readline()


@pytest.mark.slow
def test_ctrl_c_during_a_large_plan_exits_130_and_says_interrupted(tmp_path):
    """SIGINT while `plan` searches four vendors' 256 devices: exit 130 (it used to exit 0, which scripts took for
    success), 'interrupted' as the only line besides progress, no plan file. The first progress line (every 0.2 s
    here) says the search is under way; the search takes about 3 s here (the 768-device example's now ends within
    a second, sometimes before the signal lands)."""
    out = tmp_path / "plan.json"
    args = ["--cluster", str(EXAMPLES / "four-vendor-256.yaml"), "--model", "llama-140b", "--families", "search"]
    env = {**os.environ, "HETPLAN_PROGRESS_SECONDS": "0.2"}
    command = [sys.executable, "-c", NO_TORCH, "plan", *args, "--uneven-batch", "exhaustive", "--out", str(out)]
    # Ctrl-C at a terminal: SIGINT at its default disposition, which a test run started in the background (`cmd &`
    # in a script ignores SIGINT for its children, and Python then never raises KeyboardInterrupt) would not give
    process = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    try:
        first = _stderr_line(process, 60)
        assert first.startswith("hetplan plan: "), first
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        process.kill()
    lines = [line for line in stderr.splitlines() if not line.startswith("hetplan plan: ")]
    assert process.returncode == 130, stderr
    assert lines == ["hetplan: interrupted"], stderr
    assert not out.exists()


@pytest.mark.slow
def test_commands_that_need_torch_say_so_in_one_line(tmp_path, plans):
    """Without torch, `run` (it raised ModuleNotFoundError) and `comm-bench` fail in one line, after the checks that
    need no torch."""
    ran = hetplan("run", str(plans["good"]), "--cluster", str(CPU), "--out", str(tmp_path / "run.json"))
    assert ran.returncode == 2 and ran.stderr.count("\n") == 1
    assert "`hetplan run` needs PyTorch" in ran.stderr
    bench = hetplan("comm-bench", "--world", "2", "--islands", "nvidia,amd")
    assert bench.returncode == 2 and "`hetplan comm-bench` needs PyTorch" in bench.stderr


@pytest.mark.slow
def test_does_not_fit_advice_names_only_what_the_training_does_not_allow(capsys, write):
    """The planner advised 'allow full recompute or ZeRO-1' when both were allowed (the defaults). A model whose
    state fits the node's memory in all, at a sequence whose activations do not."""
    from tests.conftest import ONE_T4_NODE

    cluster = str(write("t4.yaml", ONE_T4_NODE))
    shape = "num_layers: 32\nhidden_size: 2816\nffn_hidden_size: 11264\nnum_attention_heads: 32\nnum_kv_heads: 32\n"
    model = str(write("long.yaml", shape + "vocab_size: 50304\nseq_length: 16384\nmlp: gelu\n"))
    line = one_error(capsys, "plan", "--cluster", cluster, "--model", model, "--dtype", "fp16", "--quiet")
    assert "GiB more per device; add devices, shard gradients and weights too (--zero-stage 3) or shorten" in line
    narrow = ("--recompute", "none", "--zero-stage", "0", "--quiet")
    line = one_error(capsys, "plan", "--cluster", cluster, "--model", model, "--dtype", "fp16", *narrow)
    assert "allow full recompute (--recompute none,selective,full), use ZeRO-1 (--zero-stage 1)" in line


def test_pydantic_counts_and_patterns_are_in_the_houses_words(capsys, tmp_path, plans):
    """An empty list, a too-long pair, a wrong schema and a malformed profile hash say what was expected in the
    house's words (pydantic's "List should have at least 1 item after validation, not 0" leaked through)."""
    cluster = tmp_path / "empty.yaml"
    cluster.write_text("name: empty\ngroups: []\n")
    assert one_error(capsys, *PLAN[:1], "--cluster", str(cluster), "--model", TINY).endswith(
        "empty.yaml: groups: expected at least 1 item, got []"
    )
    good = json.loads(plans["good"].read_text())
    for name, change, expected in [
        ("schema", lambda b: b.update(schema="hetplan.plan/2"), "schema: expected 'hetplan.plan/1', got"),
        # a cluster file given for the plan read as a plan of misspelt fields ("name: unknown field ...")
        ("cluster", lambda b: b.clear() or b.update(name="c", groups=[]), "expected 'hetplan.plan/1': a plan, as"),
        ("layers", lambda b: b["pipelines"][0]["stages"][0].update(layers=[0, 2, 3]), "expected at most 2 items"),
        (
            "hash",
            lambda b: b.update(
                cost_source={
                    "predictor": {"kind": "unsaved", "name": "fitted here"},
                    "profiles": [{"device": "cpu", "path": "cpu.json", "sha256": "abc"}],
                }
            ),
            "sha256: expected the profile file's SHA-256: 64 hex digits (0-9, a-f), got 'abc'",
        ),
    ]:
        broken = json.loads(json.dumps(good))
        change(broken)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(broken))
        line = one_error(capsys, "explain", str(path), "--cluster", str(CPU))
        assert expected in line, line
        assert "should" not in line, line


def test_a_plan_predicted_for_another_model_keeps_its_sequence_length(capsys, tmp_path, plans):
    """predict --strategy plan.json --model M trained M at M's default sequence (a GPT-3 plan of 2048 tokens read
    4096 for llama2-7b, and no longer fit, without a word); the plan's own stays unless --seq-len says otherwise."""
    other = tmp_path / "longer.yaml"
    other.write_text(Path(TINY).read_text().replace("seq_length: 256", "seq_length: 1024"))
    predict = ("predict", "--cluster", str(CPU), "--strategy", str(plans["good"]), "-m", str(other), "--json")
    for flags, tokens in (((), 256), (("--seq-len", "512"), 512)):
        code, lines, out = run(capsys, *predict, *flags)
        assert code == 0, lines
        assert json.loads(out)["seq_length"] == tokens


def test_flags_a_plan_cannot_honour_are_named_before_anything_runs(capsys, tmp_path, plans):
    """predict --strategy: a global batch the plan's micro-batches do not make and a model of other depth are the
    flags' mistakes (they were reported as the plan's); run: a file where the checkpoints go and a failure that
    would never happen are refused before the ranks start (the first failed after ~30 s inside rank 0)."""
    good = str(plans["good"])
    predict = ("predict", "--cluster", str(CPU), "--strategy", good)
    line = one_error(capsys, *predict, "--global-batch", "7")
    assert "--global-batch: the plan's micro-batches add up to 8 sequences per iteration: re-plan for 7" in line
    assert "--model: llama2-7b: has 32 layers, the plan's stages hold 8" in one_error(
        capsys, *predict, "-m", "llama2-7b"
    )
    in_the_way = tmp_path / "checkpoints"
    in_the_way.write_text("")
    run_args = ("run", good, "--cluster", str(CPU), "--out", str(tmp_path / "r.json"), "--steps", "2")
    line = one_error(capsys, *run_args, "--checkpoint-dir", str(in_the_way))
    assert "--checkpoint-dir: " in line and "exists and is not a directory" in line
    checkpoints = ("--checkpoint-dir", str(tmp_path / "ck"))
    for failure in ("9:2", "1:3"):
        line = one_error(capsys, *run_args, *checkpoints, "--inject-failure", failure)
        assert "expected a rank below 4 (the cluster's devices) and a step up to --steps, 2" in line


def test_a_gpt_trains_no_longer_sequences_than_its_learned_positions(capsys):
    """tiny-gpt learns 128 positions: a 256-token training is refused when planned (the run failed at its first
    step: 'The size of tensor a (256) must match the size of tensor b (128)')."""
    gpt = str(EXAMPLES / "models" / "tiny-gpt.yaml")
    line = one_error(capsys, "plan", "--cluster", str(CPU), "--model", gpt, "--seq-len", "256")
    assert line.endswith("seq_length: expected at most 128 tokens (--seq-len, or the training file's seq_length): "
                         "tiny-gpt learns one position embedding for each of its 128 positions, got 256")  # fmt: skip
    # the virtual stages a stage must hold a layer each of are named with their flag (it named only the layers)
    line = one_error(capsys, "plan", "--cluster", str(CPU), "--model", TINY, "--virtual-stages", "64", "--quiet")
    assert "at least 64 on a stage of 64 virtual stages, --virtual-stages" in line


def test_profile_tp_defaults_are_the_degrees_that_split_the_model(capsys, tmp_path):
    """simulate-profile's default TP degrees are those of 1,2,4,8 that split the model (tiny-llama's 4 kv heads:
    1, 2, 4); its default used to fail on a bundled model with '--tp: 8 must divide ...', a flag not given."""
    out = tmp_path / "cpu.json"
    code, lines, _ = run(capsys, "simulate-profile", "--device", "cpu", "--model", TINY, "--out", str(out))
    assert code == 0, lines
    assert sorted({entry["tp"] for entry in json.loads(out.read_text())["entries"]}) == [1, 2, 4]
    assert json.loads(out.read_text())["dtype"] == "fp32"  # as `plan` trains on cpu (bf16: plan refused the profile)
    line = one_error(capsys, "simulate-profile", "--device", "cpu", "--model", TINY, "--tp", "8", "--out", str(out))
    assert "--tp: 8 must divide the model's 4 kv heads" in line


def test_a_plan_kept_beside_the_profiles_is_not_read_as_one(capsys, tmp_path, plans):
    """`--profiles DIR` holding a plan beside the profile (a plan saved next to the profiles it was made from) plans
    from the profile (it failed on the plan: 'cluster: unknown field ...'); a JSON file of no known kind still fails."""
    directory = tmp_path / "profiles"
    out = directory / "cpu.json"
    made = ("simulate-profile", "--device", "cpu", "--model", TINY, "--dtype", "fp32", "--seq-len", "128")
    code, lines, _ = run(capsys, *made, "--out", str(out))
    assert code == 0, lines
    (directory / "plan.json").write_text(plans["good"].read_text())
    planned = ("plan", "--cluster", str(CPU), "--model", TINY, "--seq-len", "128", "--profiles", str(directory))
    code, lines, _ = run(capsys, *planned, "--quiet")
    assert code == 0, lines
    (directory / "notes.json").write_text('{"what": "my notes"}')
    assert "notes.json" in one_error(capsys, *planned)


def test_a_failed_command_leaves_no_output_directory_it_created(capsys, tmp_path):
    """`--out new/dirs/plan.json` creates the directories when the flag is checked, before the search; a search
    that then fails removed nothing, and the user found empty directories."""
    out = tmp_path / "new" / "dirs" / "plan.json"
    no_strategy = ("--global-batch", "7", "--micro-batch-sizes", "2,4")  # no micro-batch divides 7
    assert "no strategy" in one_error(capsys, *PLAN, *no_strategy, "--out", str(out))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "mine.txt").write_text("a user's file")
    out = tmp_path / "kept" / "new" / "plan.json"
    one_error(capsys, *PLAN, *no_strategy, "--out", str(out))
    assert [p.name for p in (tmp_path / "kept").iterdir()] == ["mine.txt"]  # only what it created went
    assert run(capsys, *PLAN, "--global-batch", "8", "--out", str(out), "--json")[0] == 0 and out.is_file()


def test_profiles_of_devices_the_cluster_has_not_are_left_unchecked(capsys, tmp_path):
    """A profiles directory kept for several clusters: a profile of a device this cluster has not (of another model)
    failed every command ("model.hidden_size: profiled 4096, the model to plan has ..."); it is left out now, while
    one of the cluster's devices is still checked against the model."""
    profiles = tmp_path / "profiles"
    made = run(capsys, "simulate-profile", "--device", "a100", "-m", "gpt3-1.7b", "--out", str(profiles / "a100.json"))
    assert made[0] == 0
    cluster = str(EXAMPLES / "h100-mi300x.yaml")
    plan_path = str(tmp_path / "plan.json")
    flags = ("--cluster", cluster, "--model", "llama3-8b", "--profiles", str(profiles))
    assert run(capsys, "plan", *flags, "--out", plan_path, "--json")[0] == 0
    assert run(capsys, "explain", plan_path, "--cluster", cluster, "--profiles", str(profiles), "--json")[0] == 0
    made = run(capsys, "simulate-profile", "--device", "h100", "-m", "gpt3-1.7b", "--out", str(profiles / "h100.json"))
    assert made[0] == 0
    assert "model." in one_error(capsys, "plan", *flags)
    assert "model." in one_error(capsys, "explain", plan_path, "--cluster", cluster, "--profiles", str(profiles))


@pytest.mark.slow
def test_a_closed_stderr_discards_messages_instead_of_failing_or_writing_them_to_stdout():
    """`hetplan plan ... 2>&-`: Python starts with sys.stderr None; the CPU note made `plan` fail (exit 1,
    "'NoneType' object has no attribute 'isatty'") and print() of the error line wrote it to stdout."""

    def closed_stderr(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-c", NO_TORCH, *args]
        return subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=120,
                              preexec_fn=lambda: os.close(2))  # fmt: skip

    planned = closed_stderr(*PLAN, "--global-batch", "8", "--json")
    assert planned.returncode == 0 and json.loads(planned.stdout)["schema"] == "hetplan.plan/1"
    refused = closed_stderr("plan", "--cluster", str(CPU), "--model", "no-such-model")
    assert refused.returncode == 2 and refused.stdout == ""


def test_an_output_that_is_an_input_is_refused_and_the_input_kept(capsys, tmp_path, monkeypatch, plans):
    """`plan --out cluster.yaml` replaced the cluster file with the plan (exit 0); also through a link or a path via
    a directory not made yet, and `replan --out` onto the plan it reads."""
    monkeypatch.chdir(tmp_path)
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text(CPU.read_text())
    (tmp_path / "link.yaml").symlink_to(cluster)
    for out in ("cluster.yaml", "link.yaml", "new/../cluster.yaml"):
        line = one_error(capsys, *PLAN[:1], "--cluster", "cluster.yaml", *PLAN[3:], "--out", out)
        assert line.endswith(f"--out: {out}: is the file --cluster reads: expected another file (it would be lost)")
    assert cluster.read_text() == CPU.read_text() and not (tmp_path / "new").exists()
    before = plans["good"].read_text()
    line = one_error(
        capsys, "replan", str(plans["good"]), "-c", str(CPU), "--add", "group:cpu:1", "--out", str(plans["good"])
    )
    assert "is the file PLAN reads" in line and plans["good"].read_text() == before


def test_flags_a_command_dropped_or_guessed_are_refused_or_said(capsys, tmp_path):
    """From a newcomer's list: --zero-stage beside --zero-stages (the search dropped it), --virtual-stages with --pp 1
    (predicted as plain 1F1B, labelled interleaved), a bf16 profile of a V100 (which `plan` refuses to train in bf16),
    fit with nothing to fit (it wrote an empty predictor), an fp8 profile of an A100 (written as fp8 with bf16's times)
    and the --profiles note under --quiet (it went silent)."""
    cluster, model = str(EXAMPLES / "a100-v100-32.yaml"), "gpt3-1.7b"
    line = one_error(capsys, "plan", "-c", cluster, "-m", model, "--dtype", "fp16", "--zero-stage", "3",
                     "--zero-stages", "1,2")  # fmt: skip
    assert line.endswith(
        "--zero-stage: 3: plans with one ZeRO stage, --zero-stages searches several: pass one of the two"
    )
    line = one_error(capsys, "predict", "-c", cluster, "-m", model, "--group", "a100", "--pp", "1",
                     "--virtual-stages", "4")  # fmt: skip
    assert "--virtual-stages: interleaves the chunks of two or more stages: 4 with --pp 1 has none" in line
    out = tmp_path / "v100.json"
    line = one_error(capsys, "simulate-profile", "--device", "v100", "-m", model, "--dtype", "bf16", "--out", str(out))
    assert line.endswith("--dtype: bf16: v100 has no bf16: profile it in fp16 (or fp32)")
    line = one_error(capsys, "simulate-profile", "--device", "ascend-910b", "-m", model, "--dtype", "fp32", "--out",
                     str(out))  # fmt: skip
    assert line.endswith("--dtype: fp32: ascend-910b has no published fp32 peak: profile it in bf16 (or fp16)")
    # a predictor is joblib: under a document's name every reader took it for one and refused it
    line = one_error(capsys, "fit", "--out", str(tmp_path / "new" / "p.json"))
    assert "p.json: expected a predictor file name such as predictor.joblib (fit writes joblib, not JSON)" in line
    assert not (tmp_path / "new").exists()
    line = one_error(capsys, "fit", "--out", str(tmp_path / "f.joblib"), "--no-published-runs")
    assert "--no-published-runs: leaves nothing to fit: give --profiles, --links or --runs" in line
    assert not list(tmp_path.iterdir())
    code, lines, _ = run(
        capsys, "simulate-profile", "--device", "a100", "-m", model, "--dtype", "fp8", "--out", str(out)
    )
    assert code == 0 and lines == ["note: a100-80gb has no FP8: the profile is in bf16, as fp8 training runs there"]
    assert json.loads(out.read_text())["dtype"] == "bf16"
    empty = tmp_path / "empty"
    empty.mkdir()
    code, lines, _ = run(capsys, "plan", "-c", cluster, "-m", model, "--profiles", str(empty), "--quiet", "--json")
    said = f"note: --profiles {empty} has no profile of a100-80gb, v100: their costs are"
    assert code == 0 and any(line.startswith(said) for line in lines), lines


def test_a_run_shorter_than_ten_iterations_and_a_one_device_cluster_read_as_they_are(capsys, tmp_path, plans):
    """`traffic --tokens 1.5` said "over 0 iterations" (the totals were of 1.5 tokens' share of one): they take one
    whole iteration; a cluster of one device said "1 devices"."""
    import re

    code, _, out = run(capsys, "traffic", str(plans["good"]), "--cluster", str(CPU), "--tokens", "1.5")
    assert code == 0 and "over 1 iteration, TB" in " ".join(out.split()), out[:300]
    code, _, out = run(capsys, "traffic", str(plans["good"]), "--cluster", str(CPU), "--tokens", "1e9")
    assert code == 0 and re.search(r"over \d{1,3}(,\d{3})* iterations", " ".join(out.split()))
    one = tmp_path / "one.yaml"
    one.write_text("name: one\ngroups:\n  - name: cpu\n    device: cpu\n    nodes: 1\n    devices_per_node: 1\n")
    code, _, out = run(capsys, "plan", "--cluster", str(one), "--model", TINY, "--global-batch", "4")
    assert code == 0 and "one (1 device, 1 used)" in out


@pytest.mark.parametrize(
    ("args", "flag", "name"),
    [
        ((*PLAN, "--out"), "--out", "plan.json"),
        (("replan", "{good}", "-c", str(CPU), "--add", "group:cpu:1", "--out"), "--out", "plan.json"),
        (("export", "{good}", "-c", str(CPU), "-f", "megatron", "--out"), "--out", "export"),
        (("explain", "{good}", "-c", str(CPU), "--png"), "--png", "gantt.png"),
        (("explain", "{good}", "-c", str(CPU), "--html"), "--html", "report.html"),
        (("traffic", "{good}", "-c", str(CPU), "--png"), "--png", "heatmap.png"),
        (("run", "{good}", "-c", str(CPU), "--out"), "--out", "run.json"),
        (("run", "{good}", "-c", str(CPU), "--out", "run.json", "--checkpoint-dir"), "--checkpoint-dir", "ck"),
        (("profile", "-m", TINY, "--out"), "--out", "cpu.json"),
        (("simulate-profile", "--device", "cpu", "-m", TINY, "--out"), "--out", "cpu.json"),
        (("profile-comm", "--out"), "--out", "links.json"),
        (("comm-bench", "--links-out"), "--links-out", "links.json"),
        (("fit", "--out"), "--out", "predictor.joblib"),
    ],
)
def test_an_output_below_a_file_says_the_file_is_not_a_directory(
    capsys, tmp_path, monkeypatch, plans, args, flag, name
):
    """`--out README.md/plan.json` said "cannot create its directory: File exists", naming neither the file in the
    way nor what is wrong with it; every command that writes a file or a directory says so before any work."""
    monkeypatch.chdir(tmp_path)
    Path("notes.txt").write_text("a user's file")
    filled = [str(plans[arg[1:-1]]) if arg.startswith("{") else arg for arg in args]
    line = one_error(capsys, *filled, f"notes.txt/new/{name}")
    assert line == f"hetplan: error: {flag}: notes.txt/new/{name}: notes.txt is a file, not a directory"
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_replan_changes_that_cancel_out_are_said_or_refused(capsys, tmp_path, plans):
    """`replan --add group:cpu:1 --without group:cpu:1` re-planned the plan's own cluster without a remark; changes
    that leave one group of several as it was are said in a note beside the re-plan."""
    line = one_error(capsys, "replan", str(plans["good"]), "-c", str(CPU), "--add", "group:cpu:1", "--without",
                     "group:cpu:1")  # fmt: skip
    assert line == ("hetplan: error: --without/--add: --without group:cpu:1 and --add group:cpu:1 cancel out (group "
                    "cpu keeps its 2 nodes): the cluster is unchanged (nothing to re-plan)")  # fmt: skip
    hetero, out = str(EXAMPLES / "cpu-hetero.yaml"), str(tmp_path / "hetero.json")
    assert run(capsys, "plan", "-c", hetero, "-m", TINY, "--global-batch", "8", "--out", out, "--json")[0] == 0
    changes = ("--without", "group:fast:1", "--add", "group:fast:1", "--add", "group:slow:1")
    code, lines, _ = run(capsys, "replan", out, "-c", hetero, *changes, "--quiet", "--json")
    assert code == 0, lines
    assert "note: --without group:fast:1 and --add group:fast:1 cancel out (group fast keeps its 1 node)" in lines


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((*PLAN, "--dtype", "fp16", "--dtype", "bf16"), "--dtype: given twice, 'fp16' and 'bf16': expected one value "
         "(only the last would count) (see 'hetplan plan --help')"),
        (("plan", "--cluster", "a.yaml", "-m", TINY, "-c", "b.yaml"), "--cluster: given twice, 'a.yaml' and 'b.yaml'"),
        ((*PLAN, "--top-k", "1", "--top-k=3", "--top-k", "2"), "--top-k: given 3 times, '1', '3' and '2': expected"),
        (("predict", "-c", str(CPU), "-m", TINY, "--sequence-parallel", "--no-sequence-parallel"),
         "--sequence-parallel: given twice, --sequence-parallel and --no-sequence-parallel: expected one value"),
        (("export", "p.json", "-c", str(CPU), "-f", "megatron", "-f", "deepspeed"), "--format: given twice"),
    ],
)  # fmt: skip
def test_an_option_of_one_value_given_twice_is_refused_naming_its_values(capsys, tmp_path, monkeypatch, args, expected):
    """click keeps an option's last value without a word: `plan --dtype fp16 --dtype bf16` planned bf16."""
    monkeypatch.chdir(tmp_path)
    assert expected in one_error(capsys, *args)


def test_options_meant_to_repeat_and_a_value_given_again_are_taken(capsys, plans):
    """Only different values of an option of one value are refused, in every command: replan's --without repeats,
    and the same --dtype twice loses nothing."""
    import typer

    commands = typer.main.get_command(cli.app).commands
    assert {type(command).__name__ for command in commands.values()} == {"OnceEachCommand"}
    code, lines, _ = run(capsys, *PLAN, "--dtype", "fp32", "--dtype", "fp32", "--global-batch", "8", "--json")
    assert (code, lines) == (0, [])
    code, lines, _ = run(capsys, *PLAN, "--top-k", "2", "--top-k", "02", "--dtype", "fp32", "--global-batch", "8")
    assert (code, lines) == (0, [])  # one value, written two ways
    code, lines, out = run(capsys, *PLAN, "--dtype", "fp32", "--dtype", "bf16", "--help")
    assert code == 0 and "Usage: hetplan plan" in out  # --help answers first
    changes = ("--without", "node:cpu/1", "--add", "group:cpu:1", "--add", "group:cpu:2")
    code, lines, _ = run(capsys, "replan", str(plans["good"]), "-c", str(CPU), *changes, "--quiet", "--json")
    assert code == 0, lines


def test_an_option_without_its_value_is_named_with_its_commands_help(capsys):
    """click said "Option '--dtype' requires an argument." and pointed at hetplan's help, not the command's."""
    assert one_error(capsys, *PLAN, "--dtype") == (
        "hetplan: error: --dtype: expected a value after it (see 'hetplan plan --help')"
    )
    assert one_error(capsys, "export", "plan.json", "-c") == (
        "hetplan: error: -c: expected a value after it (see 'hetplan export --help')"
    )


def test_run_and_fit_refuse_to_write_over_a_file_they_read(capsys, plans, tmp_path):
    """fit --runs r.json --out r.json replaced the run record with the predictor; run --out plan.json would have
    replaced the plan with the run record."""
    record = tmp_path / "r.json"
    record.write_text("{}")
    assert one_error(capsys, "fit", "--runs", str(record), "--out", str(record)) == (
        f"hetplan: error: --out: {record}: is the file --runs reads: expected another file (it would be lost)"
    )
    assert record.read_text() == "{}"
    plan = plans["good"]
    line = one_error(capsys, "run", str(plan), "--cluster", str(CPU), "--out", str(plan))
    assert line == f"hetplan: error: --out: {plan}: is the file PLAN reads: expected another file (it would be lost)"


def test_an_output_never_replaces_a_file_the_command_reads(capsys, tmp_path, monkeypatch, plans):
    """`fit --out prof/cpu.json --profiles prof` replaced the measured profile with the predictor, `plan --profiles
    prof --out prof/cpu.json` with the plan, `plan --predictor p.joblib --out p.joblib` the predictor; `launch --out
    plan.json` printed every node's `run --out plan.json`, which each node then refused."""
    monkeypatch.chdir(tmp_path)
    profiles = tmp_path / "prof"
    profiles.mkdir()
    measured = (ROOT / "bench" / "results" / "profile-cpu-tiny-llama.json").read_text()
    (profiles / "cpu.json").write_text(measured)
    predictor = tmp_path / "p.joblib"
    predictor.write_bytes(b"a predictor")
    planning = ("plan", "-c", str(CPU), "-m", TINY, "--global-batch", "8", "-q")
    in_profiles = "is in the directory --profiles reads (its .json files): expected a file elsewhere"
    assert in_profiles in one_error(capsys, "fit", "--out", "prof/cpu.json", "--profiles", "prof", "-q")
    assert in_profiles in one_error(capsys, *planning, "--profiles", "prof", "--out", "prof/cpu.json")
    assert in_profiles in one_error(capsys, *planning, "--profiles", "prof", "--out", "prof/plan.json")
    said = one_error(capsys, *planning, "--predictor", "p.joblib", "--out", "p.joblib")
    assert "p.joblib: is the file --predictor reads: expected another file (it would be lost)" in said
    good = str(plans["good"])
    assert "is the file PLAN reads" in one_error(capsys, "launch", good, "-c", str(CPU), "--out", good)
    assert (profiles / "cpu.json").read_text() == measured and predictor.read_bytes() == b"a predictor"
    assert sorted(p.name for p in profiles.iterdir()) == ["cpu.json"]


def test_a_profiles_directory_holding_only_a_plan_names_the_plan(capsys, tmp_path, monkeypatch, plans):
    """`fit --profiles DIR` of a directory whose only .json is a plan said "no *.json profiles in this directory",
    with no word of the file that is there (the project's other documents beside the profiles are skipped)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prof").mkdir()
    (tmp_path / "prof" / "my.plan.json").write_text(plans["good"].read_text())
    said = one_error(capsys, "fit", "--profiles", "prof", "--out", "p.joblib", "-q")
    assert said.endswith("prof: no *.json profiles in this directory: my.plan.json (hetplan.plan/1) is not a profile")
    assert not (tmp_path / "p.joblib").exists()


def test_a_plan_given_as_a_profile_or_a_link_profile_is_named_as_a_plan(capsys, plans):
    """A plan given to `fit --links` or to `fit_predictor` as a profile listed all its fields as misspelt ("cluster:
    unknown field (also wrong: schema, source, device and 32 more)"): it is named for what it is."""
    good = str(plans["good"])
    said = one_error(capsys, "fit", "--links", good, "--out", "p.joblib", "-q")
    assert said.endswith(f"{good}: expected a link profile (what `hetplan profile-comm` writes), got a plan")
    from predictor.predictor import fit_predictor

    with pytest.raises(SpecError, match=r": expected a device profile \(what `hetplan profile` writes\), got a plan$"):
        fit_predictor([plans["good"]])
    links = r": expected a link profile \(what `hetplan profile-comm` writes\), got a plan$"
    with pytest.raises(SpecError, match=links):
        fit_predictor(link_paths=[plans["good"]])


def test_a_hf_configs_longest_context_is_said_where_it_is_the_training_length(capsys, tmp_path):
    """A Qwen2 config.json's max_position_embeddings (32768) was trained at, context-parallel, without a word: a
    config gives no training length. A profiles directory holding the config.json read it as a profile of misspelt
    fields ("architectures: unknown field")."""
    (tmp_path / "qwen").mkdir()
    config = tmp_path / "qwen" / "config.json"
    config.write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 256, "intermediate_size": 512,
        "num_attention_heads": 4, "num_hidden_layers": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 512,
    }))  # fmt: skip
    args = ("plan", "--cluster", str(CPU), "--model", str(config), "--global-batch", "8", "--dtype", "fp32", "--quiet")
    code, lines, _ = run(capsys, *args)
    assert code == 0, lines
    biases = f"note: {config} sets what hetplan does not model: Q/K/V biases"  # (Qwen2's attention has them)
    assert lines == [
        f"note: sequences of 512 tokens, the longest context of {config} (max_position_embeddings, else 4096): a "
        "config.json gives no training length; set seq_length in the training file or --seq-len",
        biases,
    ]
    code, lines, _ = run(capsys, *args, "--seq-len", "256")
    assert code == 0 and lines == [biases], lines
    in_profiles = one_error(capsys, *args, "--seq-len", "256", "--profiles", str(tmp_path / "qwen"))
    assert in_profiles.endswith(f"{config}: expected a device profile (what `hetplan profile` writes), got a Hugging "
                                "Face config.json")  # fmt: skip
