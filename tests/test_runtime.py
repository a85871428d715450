"""The runtime against a single-process reference: loss and gradients of heterogeneous plans (4 local processes)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from comm.communicator import CommGroup  # noqa: E402
from comm.plan_groups import stage_chunks  # noqa: E402
from planner.plan import LoadedPlan  # noqa: E402
from runtime.execute import RunSettings, synthetic_batch  # noqa: E402
from runtime.launch import run_plan, summarize  # noqa: E402
from runtime.model import (  # noqa: E402
    ReferenceModel,
    StageModule,
    check_tp,
    gradient_pieces,
    piece_offsets,
    seeded_pieces,
    shard_positions,
    tie_output,
)
from runtime.tensor_parallel import TensorParallel  # noqa: E402
from specs.cluster import ClusterFile, resolve_cluster  # noqa: E402
from specs.errors import SpecError  # noqa: E402
from specs.layout import PipelineStrategy, StageStrategy, Strategy  # noqa: E402
from specs.model import ModelSpec, load_model  # noqa: E402
from specs.training import TrainingSpec  # noqa: E402

MODEL = load_model(str(Path(__file__).parent.parent / "examples/models/tiny-llama.yaml")).model_copy(
    update={
        "num_layers": 5,
        "seq_length": 16,
        "hidden_size": 64,
        "ffn_hidden_size": 128,
        "vocab_size": 256,
        "num_attention_heads": 4,
        "num_kv_heads": 2,
    }
)
# the same model tying its embedding and output: one matrix, a copy on a last stage apart from the first
TIED = MODEL.model_copy(update={"tied_embeddings": True})
# a vocabulary TP 2 does not divide: its ranks hold 128 and 127 rows (Megatron would pad it; the runtime splits it)
ODD_VOCAB = TIED.model_copy(update={"vocab_size": 255})
CLUSTER = resolve_cluster(
    ClusterFile.model_validate(
        {
            "name": "two-cpu-types",
            "groups": [
                {
                    "name": "fast",
                    "device": "cpu",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nics_per_node": 1,
                    "nic_gbps": 10,
                },
                {
                    "name": "slow",
                    "device": "cpu",
                    "nodes": 1,
                    "devices_per_node": 2,
                    "nics_per_node": 1,
                    "nic_gbps": 10,
                },
            ],
            "network": {"topology": "clos", "inter_group_gbps": 10},
        }
    ),
    "test",
)

pytestmark = pytest.mark.slow  # every test here runs several processes
SEED, BATCH, STEPS = 3, 6, 2
ROOT_EXAMPLES = Path(__file__).parent.parent / "examples"


def _reference(model: ModelSpec = MODEL) -> tuple[ReferenceModel, list[float]]:
    """Two steps of the whole model in this process with torch's AdamW (lr 1e-3, weight decay 0.01)."""
    reference = ReferenceModel(model, SEED).double()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.01)
    losses, first_grads = [], None
    for step in range(STEPS):
        tokens = synthetic_batch(model, BATCH, model.seq_length, SEED, step)
        loss = reference(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(float(loss.detach()))
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in reference.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    fresh = ReferenceModel(model, SEED).double()
    for name, p in fresh.named_parameters():
        p.grad = first_grads[name]
    return fresh, losses


def parity_plan(strategy: Strategy, model: ModelSpec = MODEL) -> tuple[LoadedPlan, RunSettings]:
    """A plan of the test model and batch, and settings that capture step 0's gradients in fp64."""
    plan = LoadedPlan(strategy, model, TrainingSpec(global_batch_size=BATCH, dtype="fp32"), "test plan")
    return plan, RunSettings(steps=STEPS, seed=SEED, dtype="fp64", capture_gradients=True, timeout_s=60)


def _check(strategy: Strategy, tmp_path, model: ModelSpec = MODEL) -> None:
    plan, settings = parity_plan(strategy, model)
    compare_with_one_process(strategy, run_plan(plan, CLUSTER, settings, str(tmp_path)), tmp_path, model)


def compare_with_one_process(strategy: Strategy, results: list[dict], tmp_path, model: ModelSpec = MODEL) -> None:
    """Both steps' losses and every rank's step-0 gradients (grads-R.pt in tmp_path) against the reference."""
    summary = summarize(results, STEPS)
    reference, losses = _reference(model)
    # step 1's loss also checks the optimizer (and ZeRO-1's sharded update and all-gather)
    assert summary["losses"] == pytest.approx(losses, rel=1e-9)
    checked = 0
    for result in results:
        if result.get("idle"):
            continue
        pipeline = strategy.pipelines[result["family"]]
        stage = pipeline.stages[result["stage"]]
        chunks = stage_chunks(pipeline, result["stage"], strategy.virtual_stages)
        modules = []
        for chunk in chunks:  # the interleaved chunks' layers, as the runtime deals them
            pieces = gradient_pieces(reference, chunk.layer_start, chunk.layer_end, chunk.first, chunk.last)
            tp = TensorParallel(None, stage.tp, result["tp_rank"])
            modules.append(StageModule(model, pieces, tp, "none").double())
        tie_output(model, modules)  # a tied matrix on one rank: its one gradient, by the embedding's name
        expected_grads: dict[str, torch.Tensor] = {}
        for k, module in enumerate(modules):
            prefix = f"chunk{k}." if len(chunks) > 1 else ""
            for name, p in module.named_parameters():
                if all(p is not seen for seen in expected_grads.values()):
                    expected_grads[prefix + name] = p
        got = torch.load(tmp_path / f"grads-{result['rank']}.pt")
        assert set(got) == {name for name, p in expected_grads.items() if p.requires_grad}
        assert got, result
        for name, grad in got.items():
            scale = expected_grads[name].abs().max().item() + 1e-12
            assert (grad - expected_grads[name]).abs().max().item() / scale < 1e-7, (result["rank"], name)
        checked += 1
    assert checked == sum(sum(s.tp for s in p.stages) * p.replicas for p in strategy.pipelines)


def test_shard_positions_say_where_each_shard_element_sits_in_the_whole_model():
    # the reference model's parameters in piece order (embedding, layers, final norm, head) are the whole model
    reference = ReferenceModel(MODEL, SEED)
    ordered = [reference.tokens, *reference.layers.parameters(), *reference.norm.parameters(), reference.output]
    whole = torch.cat([p.detach().reshape(-1) for p in ordered])
    assert whole.numel() == piece_offsets(MODEL)[-1]
    seen = []
    for start, end in ((0, 2), (2, MODEL.num_layers)):
        first, last = start == 0, end == MODEL.num_layers
        for k in range(2):
            tp = TensorParallel(None, 2, k)
            shard = StageModule(MODEL, seeded_pieces(MODEL, start, end, first, last, SEED), tp, "none")
            values = torch.cat([p.detach().reshape(-1) for p in shard.parameters() if p.requires_grad])
            positions = shard_positions(MODEL, start, end, first, last, tp, "none")
            assert torch.equal(whole[positions], values)
            seen.append(positions)
    # every element lands somewhere: TP shards once, the replicated norms on both TP ranks
    counts = torch.bincount(torch.cat(seen), minlength=whole.numel())
    norms = 2 * MODEL.num_layers * MODEL.hidden_size + MODEL.hidden_size
    assert counts.min() == 1 and int((counts == 2).sum()) == norms and counts.max() == 2


def test_uneven_stages_and_uneven_batches_with_zero1_match_one_process(tmp_path):
    # 3 + 2 layers over two groups, 2 replicas sharing 3 micro-batches of 2 (2 and 1), selective recompute, ZeRO-1
    stages = (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0))
    strategy = Strategy((PipelineStrategy(2, 2, 2, stages, total_microbatches=3),), "selective", 1)
    plan, settings = parity_plan(strategy)
    told: list[tuple[int, int]] = []
    results = run_plan(
        plan, CLUSTER, settings, str(tmp_path), steps_done=lambda done, steps: told.append((done, steps))
    )
    compare_with_one_process(strategy, results, tmp_path)
    _check_timeline(results)
    # the progress it told while the ranks ran (about every second): steps done so far, of the run's steps
    assert told and all(steps == STEPS for _, steps in told), told
    assert [done for done, _ in told] == sorted(done for done, _ in told) and told[-1][0] <= STEPS
    assert not list(tmp_path.glob("progress-*.jsonl"))  # kept in a scratch directory, not the run's


def test_completed_steps_are_the_fewest_any_rank_finished_since_the_run_began(tmp_path):
    from runtime.execute import completed_steps, tell_steps

    assert completed_steps(tmp_path) is None
    (tmp_path / "progress-0.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n')
    (tmp_path / "progress-2.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')  # a line being written
    assert completed_steps(tmp_path) == (0, 2)
    (tmp_path / "progress-3.jsonl").write_text('{"st')
    assert completed_steps(tmp_path) == (0, 0)
    resumed = tmp_path / "resumed"  # from a checkpoint at step 900 of 1000: 2 of the 100 steps to run are done
    resumed.mkdir()
    (resumed / "progress-0.jsonl").write_text('{"step": 901}\n{"step": 902}\n')
    told: list[tuple[int, int]] = []
    tell_steps(resumed, 1000, lambda done, steps: told.append((done, steps)))
    tell_steps(tmp_path / "none", 1000, lambda done, steps: told.append((done, steps)))  # nothing finished yet
    assert told == [(2, 100)]
    long = tmp_path / "long"  # a long run's file: its two ends are read, a line longer than the window too
    long.mkdir()
    lines = "".join(f'{{"step": {s}, "loss": 1.0}}\n' for s in range(1, 5001))
    (long / "progress-0.jsonl").write_text(lines + '{"step": 5001, "note": "' + "x" * 9000 + '"}\n{"step": 50')
    (long / "progress-1.jsonl").write_text(lines + '{"ste')
    assert completed_steps(long) == (0, 5000)
    (long / "progress-1.jsonl").write_text(lines + '{"step": 5001}\n{"step": 5002}\n')
    assert completed_steps(long) == (0, 5001)


def test_a_rank_is_counted_from_its_set_up_so_the_count_does_not_run_ahead_of_a_slow_starter(tmp_path):
    """A training rank makes its progress file when set up: a peer's first step does not count as every rank's
    while it is still starting (an idle rank makes none)."""
    from types import SimpleNamespace

    from runtime.execute import _Keeper, completed_steps

    job = SimpleNamespace(settings=RunSettings(steps=2, progress_dir=str(tmp_path)))
    _Keeper(1, job, None, object())  # type: ignore[arg-type]
    _Keeper(2, job, None, None)  # type: ignore[arg-type]
    assert [p.name for p in tmp_path.iterdir()] == ["progress-1.jsonl"] and completed_steps(tmp_path) is None
    (tmp_path / "progress-0.jsonl").write_text('{"step": 1}\n')
    assert completed_steps(tmp_path) == (0, 0)


def _check_timeline(results: list[dict]) -> None:
    """The record's timeline of the median step (step 1 of 2): every rank's batch, then a forward and a backward per
    micro-batch of its replica, each forward of the second stage right after the wait for its input, then the sync
    and the update; in order, without overlap, within the rank's step, CPU times not negative."""
    timeline = summarize(results, STEPS)["timeline"]
    assert timeline["step"] == 1
    by_rank = {r["rank"]: r for r in results}
    assert sorted(row["rank"] for row in timeline["ranks"]) == sorted(by_rank)
    for row in timeline["ranks"]:
        events, result = row["events"], by_rank[row["rank"]]
        kinds = [kind for kind, *_ in events]
        assert kinds[0] == "batch" and kinds[-2:] == ["dp_sync", "optimizer"], kinds
        assert kinds.count("forward") == kinds.count("backward") == result["microbatches"], kinds
        if row["stage"] == 1:
            assert all(kinds[i - 1] == "wait" for i, kind in enumerate(kinds) if kind == "forward"), kinds
        starts_and_ends = [(start, end) for _, start, end, _ in events]
        assert all(start <= end for start, end in starts_and_ends)
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(starts_and_ends))
        assert events[0][1] >= 0 and events[-1][2] <= result["steps"][1]["time_s"] + 1e-6
        assert all(cpu_s >= 0 for *_, cpu_s in events)


@pytest.mark.parametrize("model", [MODEL, TIED, ODD_VOCAB], ids=["untied", "tied", "tied-vocabulary-255"])
def test_tensor_parallel_stage_feeding_a_narrower_stage_matches_one_process(tmp_path, model):
    # stage 0: 2 layers at TP 2 (vocab-parallel embedding); stage 1: 3 layers at TP 1; full recompute; 3 micro-batches.
    # Tied, the last stage's whole output matrix meets the first stage's two vocabulary halves (128 + 127 rows of 255)
    stages = (StageStrategy("fast", 0, 2, 2, 0), StageStrategy("slow", 2, 5, 1, 0))
    _check(Strategy((PipelineStrategy(1, 2, 3, stages),), "full", 0), tmp_path, model)


def test_a_vocabulary_tp_does_not_divide_is_split_with_the_rest_on_the_last_rank():
    """A plan may put TP 2 on a vocabulary of 255 (the planner costs ceil(255 / 2) rows, as the profiler times them):
    the runtime runs it, 128 + 127 rows, rather than refusing it after planning; only a TP leaving a rank no row is
    refused, in one line."""
    check_tp(ODD_VOCAB, 2, "plan.json")
    pieces = seeded_pieces(ODD_VOCAB, 0, 5, True, True, SEED)
    shards = [StageModule(ODD_VOCAB, pieces, TensorParallel(None, 2, k), "none") for k in (0, 1)]
    assert [shard.embedding.weight.shape[0] for shard in shards] == [128, 127]
    assert [shard.head.weight.shape[0] for shard in shards] == [128, 127]
    with pytest.raises(SpecError, match="plan.json: tp: TP 2 leaves its last rank none of the vocabulary's 1 rows: ex"):
        check_tp(ODD_VOCAB.model_copy(update={"vocab_size": 1}), 2, "plan.json")


def test_a_tied_matrix_over_a_narrower_first_stage_and_unsharded_replicas_matches_one_process(tmp_path):
    # TP 1 -> TP 2: the first stage's whole matrix meets the last stage's two vocabulary halves; then 2 replicas of
    # 3 + 2 layers without ZeRO (the sum's chunks all-gathered back), both tied
    stages = (StageStrategy("fast", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 2, 0))
    (tmp_path / "narrower").mkdir()
    _check(Strategy((PipelineStrategy(1, 2, 3, stages),), "none", 0), tmp_path / "narrower", TIED)
    stages = (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0))
    (tmp_path / "replicas").mkdir()
    _check(Strategy((PipelineStrategy(2, 2, 2, stages, total_microbatches=3),), "none", 0), tmp_path / "replicas", TIED)


def test_every_copy_of_an_element_stays_equal_to_the_last_bit(tmp_path):
    """Three families, the third of two stages holding the tied matrix twice, in fp32: every holder of an element adds
    its parts in the same order, so after two updates its copies (the families', the tied matrix's two) are equal bit
    for bit (they drifted where each holder added its own part first)."""
    fast = [PipelineStrategy(1, 1, 2, (StageStrategy("fast", 0, 5, 1, k),)) for k in range(2)]
    slow = PipelineStrategy(1, 1, 2, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1)))
    strategy = Strategy((*fast, slow), "none", 0)
    plan = LoadedPlan(strategy, TIED, TrainingSpec(global_batch_size=BATCH, dtype="fp32"), "test plan")
    settings = RunSettings(steps=STEPS, seed=SEED, dtype="fp32", timeout_s=60, dump_state=True,
                           checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=STEPS)  # fmt: skip
    run_plan(plan, CLUSTER, settings, str(tmp_path))
    held: dict[int, list[float]] = {}
    for path in sorted(tmp_path.glob(f"state-*-step{STEPS}.pt")):
        state = torch.load(path)
        for position, value in zip(state["positions"].tolist(), state["params"].tolist(), strict=True):
            held.setdefault(position, []).append(value)
    assert len(held) == piece_offsets(TIED)[-1]
    copies = [values for values in held.values() if len(values) > 1]
    assert min(len(values) for values in held.values()) == 3  # one per family
    assert sum(len(values) == 4 for values in copies) == TIED.vocab_size * TIED.hidden_size  # and the tied copy
    assert all(len(set(values)) == 1 for values in copies)


def test_every_dimension_at_once_matches_one_process(tmp_path):
    # stage 0: 2 layers at TP 2 on `fast`; stage 1: 3 layers at TP 1, 2 replicas... a stage's replicas share its TP
    # width, so on 2 + 2 devices: 2 replicas x (TP 1 on fast -> TP 1 on slow) is test 1; here one replica of
    # TP 2 -> TP 2 with an uneven layer split and the LM head's vocabulary-parallel loss at TP 2
    stages = (StageStrategy("fast", 0, 1, 2, 0), StageStrategy("slow", 1, 5, 2, 0))
    _check(Strategy((PipelineStrategy(1, 1, 6, stages),), "none", 0), tmp_path)


def test_two_families_with_different_tp_and_stage_boundaries_match_one_process(tmp_path):
    # family 0 on `fast`: the whole model at TP 2, 4 samples; family 1 on `slow`: layers 0-1 -> 2-4 at TP 1, 2 samples.
    # Gradients meet across families per segment (embedding + layers 0-1, layers 2-4 + head): TP shards and the
    # replicated norms each counted once
    fast = PipelineStrategy(1, 2, 2, (StageStrategy("fast", 0, 5, 2, 0),))
    slow = PipelineStrategy(1, 1, 2, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1)))
    _check(Strategy((fast, slow), "none", 0), tmp_path)


def test_heads_wider_than_hidden_over_heads_split_over_tp_and_stages_match_one_process(tmp_path):
    # Qwen3's shape: 4 heads of 32 at hidden 64 (Q and the attention output 128 wide, K and V 2 x 32), at TP 2 on
    # `fast` then TP 1 on `slow`, ZeRO-1
    wide = ModelSpec.model_validate({**MODEL.model_dump(), "head_dim": 32})
    assert wide.q_size == 2 * wide.hidden_size
    stages = (StageStrategy("fast", 0, 2, 2, 0), StageStrategy("slow", 2, 5, 1, 0))
    _check(Strategy((PipelineStrategy(1, 2, 3, stages),), "none", 1), tmp_path, wide)


@pytest.mark.parametrize("model", [MODEL, TIED], ids=["untied", "tied"])
def test_families_with_uneven_replicas_zero1_and_recompute_match_one_process(tmp_path, model):
    # family 0: layers 0-2 -> 3-4 over both `fast` devices, 3 samples; family 1: two replicas of the whole model on
    # `slow` sharing 3 samples as 2 + 1, ZeRO-1 inside each family, selective recompute. Tied: the matrix's copy on
    # family 0's last stage, one matrix in each replica of family 1, their ZeRO-1 shards meeting
    fast = PipelineStrategy(1, 1, 3, (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("fast", 3, 5, 1, 1)))
    slow = PipelineStrategy(2, 1, 2, (StageStrategy("slow", 0, 5, 1, 0),), total_microbatches=3)
    _check(Strategy((fast, slow), "selective", 1), tmp_path, model)


def test_interleaved_1f1b_with_uneven_batches_and_zero1_matches_one_process(tmp_path):
    # 3 + 2 layers, 2 virtual stages each (chunks of 2+1 and 1+1 layers, activations wrapping from `slow` back to
    # `fast`), 2 replicas sharing 3 micro-batches of 2 (2 and 1), ZeRO-1
    stages = (StageStrategy("fast", 0, 3, 1, 0), StageStrategy("slow", 3, 5, 1, 0))
    _check(Strategy((PipelineStrategy(2, 2, 2, stages, total_microbatches=3),), "none", 1, virtual_stages=2), tmp_path)


@pytest.mark.parametrize("model", [MODEL, TIED], ids=["untied", "tied"])
def test_interleaved_families_one_stage_at_tp2_and_two_stages_match_one_process(tmp_path, model):
    # family 0: one stage at TP 2 holding 2 chunks (chunk to chunk inside the rank), 2 micro-batches of 2; family 1:
    # 2 stages at TP 1 with 2 chunks each, 1 micro-batch; gradients meet across families as shards. Tied: family 0's
    # first and last chunks share one matrix on each rank
    fast = PipelineStrategy(1, 2, 2, (StageStrategy("fast", 0, 5, 2, 0),))
    slow = PipelineStrategy(1, 2, 1, (StageStrategy("slow", 0, 2, 1, 0), StageStrategy("slow", 2, 5, 1, 1)))
    _check(Strategy((fast, slow), "selective", 0, virtual_stages=2), tmp_path, model)


def test_the_speed_check_sets_every_core_computing_beside_the_profiles_measurement(tmp_path):
    """Before a run, a process per core computes the reference layer at once; their busy stretch over the profile's
    is the cores' slowdown (a profile that read 3x with every core busy: this machine reads under 3x, so the check
    says the cores run faster together now)."""
    import os
    from dataclasses import replace

    from profiler.profile import DeviceProfile, HostCosts, ProfileEntry
    from report.measurements import speed_lines
    from runtime.launch import cores_check, speed_check

    cores = len(os.sched_getaffinity(0))
    if cores < 2:
        pytest.skip("the all-cores check needs two cores")
    host = HostCosts(cores=cores, concurrency=[{"processes": cores, "busy_stretch": 3.0}], optimizer_s_per_param=0.0,
                     flatten_s_per_param=0.0, microbatch_overhead_s=0.0, layer_overhead_s=0.0, batch_s=0.0,
                     batch_s_per_sample=0.0)  # fmt: skip
    entry = ProfileEntry(layer="decoder", micro_batch_size=1, tp=1, recompute="none", forward_time_s=1e-3,
                         backward_time_s=2e-3, activation_bytes=0)  # fmt: skip
    profile = DeviceProfile(source="measured", device={"key": "cpu"}, model={}, dtype="fp32", seq_length=16,
                            entries=[entry], host=host)  # fmt: skip
    checked = cores_check(MODEL, profile, entry)
    assert checked["cores"] == cores and checked["busy_stretch_profiled"] == 3.0
    # a sanity band: two busy processes on this 2-core host read 0.80-1.76 when disturbed, and the profile's 3.0
    # stays outside it
    assert 0.5 < checked["busy_stretch_now"] < 2.9, checked
    assert checked["cores_slowdown"] == pytest.approx(checked["busy_stretch_now"] / 3.0)
    speed = speed_check((profile, entry), 3e-3, 3e-3, checked)
    record = {"measurements": {"machine_speed": speed, "prediction_error_at_run_speed": 0.0},
              "predicted_at_run_speed_s": 1.0}  # fmt: skip
    assert f"all {cores} cores computing it at once" in speed_lines(record)[1]
    assert cores_check(MODEL, replace(profile, host=None), entry) == {}
    # what other work took of the cores during the run: said, and named as what the prediction does not know of
    # above OTHER_WORK_LIMIT_CORES
    others = {"checked": True, "cores": 2, "over": "the steps after the first", "over_s": 3.0,
              "other_processes_cores": 0.55, "stolen_cores": 0.05}  # fmt: skip
    record["measurements"]["machine_speed"] = {**speed, "other_work": others}
    said = speed_lines(record)[-1]
    assert said.startswith("other work on this host during the steps after the first: 0.60 of its 2 cores (other ")
    assert "the prediction does not know of" in said
    quiet = {**others, "other_processes_cores": 0.02, "stolen_cores": 0.0}
    record["measurements"]["machine_speed"] = {"checked": False, "why": "simulated costs", "other_work": quiet}
    assert speed_lines(record) == [
        "machine speed not checked: simulated costs",
        "other work on this host during the steps after the first: 0.02 of its 2 cores (other processes 0.02, the "
        "hypervisor 0.00)",
    ]


def test_zero_syncs_gradients_with_a_reduce_scatter_as_the_cost_model_counts_them(monkeypatch):
    """ZeRO-1 and 2 reduce-scatter the gradients (half an all-reduce's bytes on NCCL; predictor/sharding.py counts a
    reduce-scatter), ZeRO-0 all-reduces them; each rank's optimizer gets the sum over its elements."""
    from types import SimpleNamespace

    import runtime.execute as execute

    class Recording:
        """Two replicas whose gradients are equal: a sum doubles them."""

        def __init__(self) -> None:
            self.calls: list[str] = []

        def reduce_scatter(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
            self.calls.append("reduce_scatter")
            return tensor.chunk(len(group.ranks))[group.ranks.index(1)] * 2

        def all_reduce(self, tensor: torch.Tensor, group: CommGroup) -> torch.Tensor:
            self.calls.append("all_reduce")
            return tensor.mul_(2)

    monkeypatch.setattr(execute.dist, "get_rank", lambda: 1)
    for zero_stage, collective, (lo, hi) in ((0, "all_reduce", (0, 8)), (1, "reduce_scatter", (4, 8)),
                                             (2, "reduce_scatter", (4, 8))):  # fmt: skip
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (3, 5)]
        for p, grad in zip(params, torch.arange(8.0).split([3, 5]), strict=True):
            p.grad = grad.clone()
        state = SimpleNamespace(params=params, dp_group=CommGroup((0, 1), {"cpu": (0, 1)}), across=None,
                                optimizer=SimpleNamespace(lo=lo, hi=hi), zero_stage=zero_stage)  # fmt: skip
        comm = Recording()
        mine, _ = execute._synced_gradients(state, comm, capture=False)  # type: ignore[arg-type]
        assert comm.calls == [collective], zero_stage
        assert torch.equal(mine, torch.arange(8.0)[lo:hi] * 2), zero_stage
        assert all(p.grad is None for p in params)


def test_cross_family_sync_moves_each_devices_shard_once_per_other_family():
    """Every element of a rank's chunk (its 1/replicas of its gradient) arrives once from each other family; what it
    sends is its own chunk (plus the few replicated elements a TP peer needs too): shards, not whole segments."""
    from runtime.sync import ShardedSync, chunk_bounds, rank_positions
    from specs.layout import group_offsets

    fast = PipelineStrategy(2, 1, 3, (StageStrategy("fast", 0, 5, 1, 0),))  # 2 replicas of the whole model
    slow = PipelineStrategy(1, 1, 3, (StageStrategy("slow", 0, 5, 2, 0),))  # the whole model at TP 2
    strategy = Strategy((fast, slow), "none", 0)
    offsets = group_offsets(CLUSTER)
    for rank, dp_ranks, family, tp_rank in ((0, (0, 1), 0, 0), (1, (0, 1), 0, 0), (2, (2,), 1, 0), (3, (3,), 1, 1)):
        dp = CommGroup(dp_ranks, {"cpu": dp_ranks})
        sync = ShardedSync(MODEL, strategy, offsets, rank, dp)
        positions = rank_positions(MODEL, strategy, family, 0, tp_rank)
        lo, hi = chunk_bounds(positions.numel(), dp_ranks.index(rank), len(dp_ranks))
        received = torch.cat([s.receive for s in sync.swaps])
        assert sorted(received.tolist()) == list(range(hi - lo)), rank  # each element once, from the one other family
        sent = sum(s.send.numel() for s in sync.swaps)
        norms = 2 * MODEL.num_layers * MODEL.hidden_size + MODEL.hidden_size
        assert sent <= hi - lo + norms


def test_hetplan_run_plans_trains_records_and_feeds_fit(tmp_path):
    """plan -> run -> record -> fit through the CLI, on a 2-layer model and 2 local processes (one emulated slow)."""
    import json
    import os

    from tests.conftest import hetplan

    (tmp_path / "model.yaml").write_text(
        "num_layers: 2\nhidden_size: 64\nffn_hidden_size: 128\nnum_attention_heads: 4\nnum_kv_heads: 2\n"
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
    plan = tmp_path / "plan.json"
    profile = tmp_path / "profiles" / "cpu.json"
    profile.parent.mkdir()
    simulated = hetplan("simulate-profile", "--device", "cpu", "--model", str(tmp_path / "model.yaml"), "--out",
                        str(profile), "--dtype", "fp32", "--tp", "1", "--micro-batches", "1")  # fmt: skip
    assert simulated.returncode == 0, simulated.stderr
    made = hetplan(
        "plan", "--cluster", str(cluster), "--model", str(tmp_path / "model.yaml"), "--training", str(training),
        "--profiles", str(profile.parent), "--out", str(plan), "--json",
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    record_path = tmp_path / "run.json"
    ran = hetplan("run", str(plan), "--cluster", str(cluster), "--steps", "2", "--out", str(record_path),
                  "--timeout", "60", torch_allowed=True)  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    record = json.loads(record_path.read_text())
    # the prediction comes from the profile the plan was made with, without --profiles on `run`, and says so
    assert record["measurements"]["cost_source"]["profiles"][0]["path"] == str(profile.resolve())
    assert f"profiles cpu={profile.resolve()} (as recorded in the plan)" in ran.stderr
    assert record["schema"] == "hetplan.run/1"
    # predicted (and recorded for `fit --runs`) as the runtime runs: DP traffic after the flush, not overlapped
    assert record["training"]["overlap_grad_reduce"] is False and record["training"]["overlap_param_gather"] is False
    assert record["measured_iteration_time_s"] > 0 and record["predicted_iteration_time_s"] > 0
    assert len(record["losses"]) == 2 and record["reference_match"]["match"], record["reference_match"]
    assert record["cpu_share"] == pytest.approx(min(1.0, len(os.sched_getaffinity(0)) / 2))
    # every stage's step split into the cost model's terms, measured beside predicted, each side adding up
    terms = record["measurements"]["terms"]
    stages = record["measurements"]["stages"]
    assert {(t["family"], t["stage"]) for t in terms} == {(s["family"], s["stage"]) for s in stages}
    for stage in terms:
        measured = {term: values["measured_s"] for term, values in stage["terms"].items()}
        predicted = {term: values["predicted_s"] for term, values in stage["terms"].items()}
        assert measured["forward"] > 0 and measured["backward"] > 0 and predicted["forward"] > 0
        assert sum(measured.values()) == pytest.approx(stage["step"]["measured_s"])
        assert sum(predicted.values()) == pytest.approx(stage["step"]["predicted_s"])
    slowest = max(stage["step"]["predicted_s"] for stage in terms)
    assert slowest == pytest.approx(record["predicted_iteration_time_s"])
    assert "Where the step goes" in ran.stdout
    # the ranks' resident memory beside the plan's per device, which counts the model's state alone
    planned = record["measurements"]["predicted_memory_bytes"]
    assert 0 < planned < min(record["measurements"]["memory_max_rss_bytes"].values())
    assert planned < 0.1 * 2**30  # the test model's state: in MiB (it read "the plan's 0.00 GiB per device")
    assert f"GiB per rank; the plan's {planned / 2**20:.1f} MiB per device is the model's weights" in ran.stdout
    assert "emulated: slow at 0.5x:" in ran.stdout  # in words, not a Python dict
    # one step laid out rank by rank (tested in detail on a pipeline above)
    timeline = record["measurements"]["timeline"]
    assert timeline["step"] == 1 and len(timeline["ranks"]) == 2
    assert all(row["events"][-1][0] == "optimizer" for row in timeline["ranks"])
    # the simulated step beside it comes with measured host costs; this profile is simulated, without them, and the
    # run says what that leaves out
    assert record["measurements"]["predicted_timeline"] is None
    assert "note: the profiles have no host costs (profiled with --no-host, or simulated)" in ran.stdout
    assert all(stage["predicted_cpu_s"] is None for stage in terms)
    for stage in record["measurements"]["stages"]:
        assert stage["compute_s"] > 0
        # the CPU time of the median step and of its waits, syncs and update: each a part of the step's
        cpu = stage["cpu_s"]
        assert set(cpu) == {"step", "pipeline_wait", "tp_comm", "dp_sync", "optimizer"} and cpu["step"] > 0
        assert all(0 <= cpu[term] <= cpu["step"] for term in cpu), cpu
        if stage["group"] == "slow":  # its ranks really computed longer
            assert stage["emulate_speed"] == 0.5 and stage["emulation_s"] > 0
    fitted = hetplan("fit", "--runs", str(record_path), "--out", str(tmp_path / "p.joblib"), torch_allowed=True)
    assert fitted.returncode == 0, fitted.stderr
    assert "plan on two" in fitted.stdout
    # validate predicts the record from the costs `run` predicted it with (the plan's profile), as `run` did
    validated = hetplan("validate", str(record_path), "--json")
    assert validated.returncode == 0, validated.stderr
    body = json.loads(validated.stdout)
    shipped = record["measurements"]["cost_source"]["predictor"]["key"][:12]
    said = f"costs: the shipped predictor {shipped}, profiles cpu={profile.resolve()} (as recorded in the run record)"
    assert body["costs"][0].startswith(said), body["costs"]
    assert body["runs"][0]["predicted_s"] == pytest.approx(record["predicted_iteration_time_s"], rel=1e-4)
    wrong = hetplan("run", str(plan), "--cluster", str(ROOT_EXAMPLES / "a100-v100-32.yaml"), "--out",
                    str(tmp_path / "x.json"), torch_allowed=True)  # fmt: skip
    assert wrong.returncode == 2 and wrong.stderr.count("\n") == 1 and "cluster" in wrong.stderr, wrong.stderr


def test_a_run_times_its_profiles_layer_around_it_and_records_how_much_slower_the_machine_runs_now(tmp_path):
    """A profile taken when the machine ran its layers four times as fast as now (this machine's times, quartered):
    the run times the profile's decoder layer before and after itself, records the slowdown (about 4) and predicts at
    the run's speed too. (Halved, the sub-millisecond layer read x1.32 once, in a clean clone's CI with the other test
    worker busy: the band must hold this machine's noise and still tell a check from none, x1.)"""
    import json
    from dataclasses import replace

    from planner.what_if import run_context
    from predictor.predictor import Predictor
    from predictor.runs import load_runs
    from profiler.measure import profile_model
    from report.measurements import speed_lines
    from runtime.launch import execute
    from specs.cluster import load_cluster

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as `hetplan profile --threads 1` measures: the check must time the layer the same way
    try:
        now = profile_model(MODEL, device=torch.device("cpu"), device_key="cpu", dtype="fp32", seq_length=16,
                            micro_batch_sizes=[1], tp_degrees=[1], recompute_modes=("none",), repeats=5, passes=2,
                            min_time_s=0.1)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert now.source == "measured" and now.environment["threads"] == 1
    quartered = [e.model_copy(update={"forward_time_s": e.forward_time_s / 4, "backward_time_s": e.backward_time_s / 4})
                 for e in now.entries]  # fmt: skip
    earlier = replace(now, entries=quartered, path=str(tmp_path / "cpu.json"))
    cluster_path = tmp_path / "one.yaml"
    cluster_path.write_text("name: one\ngroups:\n  - {name: cpu, device: cpu, nodes: 1, devices_per_node: 1}\n")
    training = TrainingSpec(global_batch_size=2, dtype="fp32", zero_stage=0)
    strategy = Strategy((PipelineStrategy(1, 1, 2, (StageStrategy("cpu", 0, MODEL.num_layers, 1),)),), "none", 0)
    plan = LoadedPlan(strategy, MODEL, training, "one-stage plan")
    measured_earlier = run_context(plan, Predictor(), {"cpu": earlier})
    record = execute(plan, load_cluster(cluster_path), str(cluster_path), measured_earlier,
                     RunSettings(steps=2, dtype="fp32", timeout_s=60.0), progress=lambda _: None)  # fmt: skip

    speed = record["measurements"]["machine_speed"]
    assert speed["checked"] and speed["layer"] == "decoder, micro-batch 1, tp 1, no recompute", speed
    assert speed["profiled_s"] == pytest.approx(quartered[0].forward_time_s + quartered[0].backward_time_s)
    assert 1.6 < speed["slowdown"] < 12.0, speed  # four times as slow as "when profiled", within this machine's noise
    assert record["machine_slowdown"] == speed["slowdown"]
    assert record["predicted_at_run_speed_s"] == pytest.approx(record["predicted_iteration_time_s"] * speed["slowdown"])
    assert "around the run" in speed_lines(record)[0] and f"x{speed['slowdown']:.2f}" in speed_lines(record)[0]
    at_speed_error = record["measured_iteration_time_s"] / record["predicted_at_run_speed_s"] - 1.0
    said = f"the run took {abs(at_speed_error):.1%} {'less' if at_speed_error < 0 else 'more'} than predicted"
    assert said in speed_lines(record)[0], speed_lines(record)
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    (run,) = load_runs(path)  # the record reads back for calibration, which takes the measured time as it is
    assert run.measured_iteration_time_s == record["measured_iteration_time_s"]

    # costs that are not a measured profile of this host (simulated here) leave the speed unchecked, and say so
    simulated = run_context(plan, Predictor(), {})
    unchecked = execute(plan, load_cluster(cluster_path), str(cluster_path), simulated,
                        RunSettings(steps=1, dtype="fp32", timeout_s=60.0), progress=lambda _: None)  # fmt: skip
    assert not unchecked["measurements"]["machine_speed"]["checked"] and unchecked["machine_slowdown"] == 1.0
    # what else used the cores is measured around both runs (it needs no profile)
    for checked in (record, unchecked):
        others = checked["measurements"]["machine_speed"]["other_work"]
        assert others["checked"] and others["over_s"] > 0, others
        assert others["over"] in ("the steps after the first", "the whole run (the ranks' start included)")


def test_other_work_is_read_over_the_steps_after_the_warm_up_when_they_last(monkeypatch):
    """The readings are taken at the first report of a finished step and at the report of the last; the reports go
    on to the caller's steps_done. Steps spanning under MIN_OTHER_WORK_S leave the whole run read."""
    from profiler.machine import HostTimes
    from runtime import launch

    clock = iter(range(100))
    monkeypatch.setattr(launch, "host_times", lambda: HostTimes(float(next(clock)), 0.0, 0.0, 0.0))
    told: list[tuple[int, int]] = []
    readings = launch.StepReadings(lambda done, steps: told.append((done, steps)))
    for done in (0, 0, 1, 2, 2, 3, 4, 4):
        readings.tell(done, 4)
    assert told[-1] == (4, 4) and len(told) == 8
    monkeypatch.setattr(launch, "MIN_OTHER_WORK_S", 0.5)
    window = readings.steps_window()
    assert window is not None and (window[0].wall_s, window[1].wall_s) == (0.0, 1.0)  # read once each
    monkeypatch.setattr(launch, "MIN_OTHER_WORK_S", 2.0)
    assert readings.steps_window() is None
    _, others = launch.with_other_work(lambda: None, readings)
    assert others["over"] == "the whole run (the ranks' start included)"
    unfinished = launch.StepReadings()
    unfinished.tell(1, 4)
    assert unfinished.steps_window() is None


class _SleepingLayer(torch.nn.Module):
    """A layer whose math takes `seconds` (asleep: the emulator's arithmetic, not its CPU use, is under test); counts
    its calls."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.calls = seconds, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        time.sleep(self.seconds)
        return x


def test_emulation_stops_at_its_target_rather_than_after_the_layer_that_crosses_it():
    """Half speed, 7 ms of real compute: 7 ms more. With 3 ms layers, at most two fit before the deadline and the rest
    is a spin; starting a third layer because the deadline was not yet passed took 9 ms. The first call learns how
    long a layer takes (it may overshoot: a run's first step is its warm-up). Layers are counted rather than the
    overshoot timed: a test process sharing its core may be set aside during the spin."""
    from runtime.context_parallel import ContextParallel
    from runtime.pipeline import Emulator

    tp, cp, layer = TensorParallel(None, 1, 0), ContextParallel(None, 1, 0, 16), _SleepingLayer(0.003)
    emulator = Emulator(0.5, [layer], tp, cp, torch.zeros(1))
    emulator.extend(0.007)
    for _ in range(3):
        layer.calls = 0
        assert emulator.extend(0.007) >= 0.007
        assert layer.calls <= 2
    assert Emulator(1.0, [], tp, cp, torch.zeros(1)).extend(1.0) == 0.0
