"""The runtime under torchrun: two agents on this machine (c10d rendezvous on localhost, 2 nodes x 2 processes) run
a two-family heterogeneous plan and match one process; and the per-node torchrun commands for a plan."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from profiler.comm_bench import free_port
from runtime.launch import launch_commands
from specs import load_cluster
from specs.layout import PipelineStrategy, StageStrategy, Strategy
from tests.conftest import EXAMPLES, ROOT
from tests.test_runtime import CLUSTER, compare_with_one_process, parity_plan

ENTRY = """
import json, pickle, sys
from runtime.launch import run_in_job
with open(sys.argv[1], "rb") as f:
    plan, cluster, settings = pickle.load(f)
results = run_in_job(plan, cluster, settings, sys.argv[2])
if results is not None:  # rank 0 has every rank's result, gathered over the process group
    with open(sys.argv[2] + "/results.json", "w") as f:
        json.dump(results, f)
"""


RENDEZVOUS_LOST = "DistNetworkError"  # torch's error when the c10d store's connection fails


def _run_agents(tmp_path: Path, job: Path, entry: Path) -> tuple[list[int], list[str]]:
    """Two torchrun agents (2 processes each) on a fresh localhost rendezvous: their exit codes and logs."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hetplan-test", "--max-restarts", "0",
               str(entry), str(job), str(tmp_path)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
              for _ in range(2)]  # fmt: skip
    try:
        outputs = [agent.communicate(timeout=300)[0].decode(errors="replace") for agent in agents]
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait(timeout=30)
    return [agent.returncode for agent in agents], outputs


@pytest.mark.slow
def test_two_torchrun_agents_run_a_two_family_plan_like_one_process(tmp_path):
    # family 0 on `fast`: the whole model at TP 2 (4 samples); family 1 on `slow`: 2 stages at TP 1, interleaved
    # with 2 chunks each (2 samples); ranks, world and rendezvous come from torchrun's environment
    fast = PipelineStrategy(1, 2, 2, (StageStrategy("fast", 0, 5, 2, 0),))
    slow = PipelineStrategy(1, 2, 1, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1)))
    strategy = Strategy((fast, slow), "none", 0, virtual_stages=2)
    plan, settings = parity_plan(strategy)
    job = tmp_path / "job.pkl"
    job.write_bytes(pickle.dumps((plan, CLUSTER, settings)))
    entry = tmp_path / "entry.py"
    entry.write_text(ENTRY)
    returncodes, outputs = _run_agents(tmp_path, job, entry)
    if any(returncodes) and any(RENDEZVOUS_LOST in output for output in outputs):
        # the rendezvous port was taken between free_port() and the store's bind (another test's process group):
        # not the runtime's failure; once more on a fresh port
        returncodes, outputs = _run_agents(tmp_path, job, entry)
    assert not any(returncodes), [output[-3000:] for output in outputs]  # the end of each agent's log says why
    results = json.loads((tmp_path / "results.json").read_text())
    assert sorted(r["rank"] for r in results) == [0, 1, 2, 3]
    compare_with_one_process(strategy, results, tmp_path)


def test_launch_commands_start_one_torchrun_per_node_in_the_runtimes_rank_order():
    cluster = load_cluster(EXAMPLES / "hethub-768.yaml")
    commands = launch_commands("plan.json", cluster, "hethub-768.yaml", out="run.json", master_addr="10.0.0.1")
    assert len(commands) == 96
    first, last = commands[0], commands[-1]
    assert first.startswith("env HIP_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 torchrun --nnodes 96 --node-rank 0 ")
    assert last.startswith("env ASCEND_RT_VISIBLE_DEVICES=0,1,2,3,4,5,6,7 torchrun --nnodes 96 --node-rank 95 ")
    assert "--nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 --no-python hetplan run plan.json" in first
    assert first.endswith("--cluster hethub-768.yaml --out run.json")
    assert all("HIP" in c for c in commands[:16]) and all("ASCEND" in c for c in commands[16:])


def test_a_torchrun_rank_other_than_0_says_nothing_and_rank_0_says_the_costs(tmp_path, monkeypatch, capsys):
    """Under torchrun every rank runs `hetplan run`; a 4-rank job printed its costs line four times. Rank 0 says
    it (and writes the record); the others print nothing (the job's ranks are stood in for: the line is the CLI's)."""
    import cli
    from report import said
    from report.failures import exit_status
    from runtime import launch

    plan = tmp_path / "plan.json"
    cpu = EXAMPLES / "cpu-even.yaml"
    made = ["--cluster", str(cpu), "--model", str(EXAMPLES / "models" / "tiny-llama.yaml"), "--global-batch", "4"]
    assert exit_status(cli.app, ["plan", *made, "--out", str(plan), "--quiet"]) == 0
    capsys.readouterr()
    monkeypatch.setattr(launch, "execute_in_job", lambda *args, **kwargs: None)  # what ranks other than 0 return
    for key, value in {"WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    args = ["run", str(plan), "--cluster", str(cpu), "--out", str(tmp_path / "run.json")]
    assert exit_status(cli.app, args) == 0
    assert capsys.readouterr() == ("", "")
    # rank 0's first progress line or its result prints what the command said (stood in for: a flush, no record)
    monkeypatch.setattr(launch, "execute_in_job", lambda *args, **kwargs: said.flush())
    monkeypatch.setenv("RANK", "0")
    assert exit_status(cli.app, args) == 0
    assert capsys.readouterr().err.startswith("costs: ")
