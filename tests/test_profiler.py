"""The profiler on this machine's CPU: real torch layers, activation bytes against the analytic formula,
recompute correctness, partial profiles, and plans made from measured profiles."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from planner import plan  # noqa: E402
from profiler import load_profile, measure  # noqa: E402
from profiler.layers import DecoderLayer  # noqa: E402
from profiler.measure import build_layer, profile_layer, profile_model, saved_activation_bytes  # noqa: E402
from specs import load_cluster, load_model, load_training  # noqa: E402
from specs.model import ModelSpec, Recompute  # noqa: E402
from tests.conftest import EXAMPLES, hetplan  # noqa: E402

TINY_LLAMA = load_model(str(EXAMPLES / "models" / "tiny-llama.yaml"))
TINY_GPT = load_model(str(EXAMPLES / "models" / "tiny-gpt.yaml"))
# heads wider than hidden / heads (Qwen3's): 8 heads of 128 at hidden 512
WIDE_HEADS = ModelSpec.model_validate({**TINY_LLAMA.model_dump(), "head_dim": 128})
MODELS = pytest.mark.parametrize("model", [TINY_LLAMA, TINY_GPT, WIDE_HEADS], ids=["llama", "gpt", "wide-heads"])
CPU = torch.device("cpu")


def analytic_bytes(model: ModelSpec, tokens: int, tp: int, mode: Recompute) -> float:
    """The planner's formula for a TP shard without sequence parallelism (replicated tensors stay whole),
    fp32, plus flash attention's fp32 log-sum-exp."""
    replicated, sharded = model.layer_activation_elements_per_token(mode)
    lse = model.num_attention_heads / tp if mode == "none" else 0
    return 4.0 * tokens * (replicated + sharded / tp + lse)


def implementation_extra_bytes(model: ModelSpec, tokens: int, tp: int, mode: Recompute) -> float:
    """What our torch layer keeps beyond the formula: the norms' own state. RMSNorm (unfused on CPU) keeps
    x * rsqrt(mean(x^2)) (h) and rsqrt (1) per norm; LayerNorm keeps mean and rstd (2) per norm. A fused RMSNorm
    kernel (Apex, Transformer Engine) keeps only rsqrt. Selective and full recompute rebuild the norms."""
    if mode != "none":
        return 0.0
    h = model.hidden_size
    norms = 2 * (h + 1) if model.mlp == "swiglu" else 2 * 2
    return 4.0 * tokens * norms


@MODELS
def test_the_torch_layer_has_the_formulas_parameters(model):
    """The profiled (and run) layer holds what ModelSpec.layer_params counts, and a TP 2 shard half of what TP
    splits (norms, and GPT's row-parallel biases, whole on every rank)."""
    whole = sum(p.numel() for p in DecoderLayer(model, 1, "none").parameters())
    assert whole == model.layer_params()
    h, q, kv = model.hidden_size, model.q_size, model.kv_size
    replicated = 2 * h if model.mlp == "swiglu" else 4 * h + 2 * h  # norms; GPT: LayerNorm shifts, out and fc2 biases
    assert sum(p.numel() for p in DecoderLayer(model, 2, "none").parameters()) == (whole - replicated) / 2 + replicated
    assert DecoderLayer(model, 1, "none").qkv.out_features == q + 2 * kv


@MODELS
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize(("micro_batch_size", "tp"), [(1, 1), (2, 2)])
def test_measured_activation_bytes_equal_formula_plus_known_artefacts(model, mode, micro_batch_size, tp):
    layer, inputs = build_layer(model, "decoder", micro_batch_size, model.seq_length, tp, mode, CPU, torch.float32)
    x = inputs[0].requires_grad_()
    _, measured = saved_activation_bytes(layer, lambda: layer(x))
    tokens = micro_batch_size * model.seq_length
    expected = analytic_bytes(model, tokens, tp, mode) + implementation_extra_bytes(model, tokens, tp, mode)
    assert measured == pytest.approx(expected, rel=1e-9)


@MODELS
@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_gives_the_same_gradients(model, mode):
    torch.manual_seed(0)
    reference = DecoderLayer(model, 2, "none").double()
    layer = DecoderLayer(model, 2, mode).double()
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, model.seq_length, model.hidden_size, dtype=torch.float64, requires_grad=True)
    x2 = x.detach().clone().requires_grad_()
    grad = torch.randn_like(x)
    reference(x).backward(grad)
    layer(x2).backward(grad)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-10, atol=1e-10)
    for (name, ours), theirs in zip(layer.named_parameters(), reference.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-10, atol=1e-10, msg=name)


def test_profile_layer_on_a_user_module():
    module = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
    x = torch.randn(64, 256)
    result = profile_layer(module, [x], repeats=3, min_time_s=0.05)
    assert 0 < result.forward_time_min_s <= result.forward_time_s <= result.forward_time_max_s
    assert result.backward_time_s > 0 and result.repeats >= 3
    # saved: the input (64x256), the first GEMM's output (GELU input) and GELU's output (64x1024 each)
    assert result.activation_bytes == 4 * (64 * 256 + 2 * 64 * 1024)


def small_profile(**kwargs) -> object:
    return profile_model(
        TINY_GPT,
        device=CPU,
        device_key="cpu",
        dtype="fp32",
        seq_length=TINY_GPT.seq_length,
        micro_batch_sizes=(1, 2),
        tp_degrees=(1,),
        recompute_modes=("none",),
        **{"repeats": 2, "passes": 1, "min_time_s": 0.0, **kwargs},
    )


def test_progress_counts_timings_over_the_passes_and_ends_at_the_total():
    """Two sizes x (decoder, embedding, head) = 6 entries, timed once per pass over 2 passes: 12 timings, counted
    0..11 with the pass named, then 12/12 (not the 6 entries against the 12 timings)."""
    said: list[tuple[int, int, str]] = []
    profile = small_profile(progress=lambda done, total, what: said.append((done, total, what)), passes=2)
    assert len(profile.entries) == 6
    assert [done for done, _, _ in said] == [*range(12), 12]
    assert {total for _, total, _ in said} == {12}
    assert said[0][2].startswith("pass 1/2 ") and said[11][2].startswith("pass 2/2 ")
    assert said[-1][2] == "layers done"


def test_sizes_that_run_out_of_memory_are_recorded_not_fatal(monkeypatch):
    real = measure.build_layer

    def failing(model, layer, size, *args, **kwargs):
        if layer == "decoder" and size == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real(model, layer, size, *args, **kwargs)

    monkeypatch.setattr(measure, "build_layer", failing)
    profile = small_profile()
    misfits = [e for e in profile.entries if not e.fits]
    assert [(e.layer, e.micro_batch_size) for e in misfits] == [("decoder", 2)]
    assert all(e.forward_time_s for e in profile.entries if e.fits)
    cost = profile.layer_cost("decoder", 2, 1, "none")  # extrapolated from the sizes that fit
    assert cost.time_s > 0


def test_ctrl_c_keeps_what_was_measured(monkeypatch):
    real = measure.build_layer
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # 1 warm-up + 2 entries measured, then Ctrl-C
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "build_layer", interrupted)
    profile = small_profile()
    assert profile.environment["interrupted"] is True
    assert len(profile.entries) == 2


@pytest.mark.slow
def test_cli_profile_then_plan_uses_the_measurements(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    out = profiles / "cpu.json"
    result = hetplan(
        "profile",
        "--model",
        str(EXAMPLES / "models" / "tiny-gpt.yaml"),
        "--device",
        "cpu",
        "--micro-batches",
        "1,2",
        "--tp",
        "1,2",
        "--recompute",
        "none,full",
        "--repeats",
        "2",
        "--seq-len",
        "32",
        "--no-host",  # measured by default; the next test follows it there (profiler/host.py has its own tests)
        "--out",
        str(out),
        torch_allowed=True,
    )
    assert result.returncode == 0, result.stderr
    profile = load_profile(out)
    assert profile.source == "measured" and profile.dtype == "fp32" and profile.host is None
    assert profile.environment["torch"].startswith("2.") and profile.environment["threads"] >= 1
    assert len(profile.entries) == 2 * 2 * (2 + 2)
    body = json.loads(out.read_text())
    assert body["schema"] == "hetplan.profile/1"

    cluster = load_cluster(EXAMPLES / "cpu-2x2.yaml")
    training = load_training(
        None,
        {
            "dtype": "fp32",
            "global_batch_size": 8,
            "seq_length": 32,
            "recompute": ["none", "full"],
            "micro_batch_sizes": [1, 2],
        },
    )
    measured = plan(cluster, TINY_GPT, training, {"cpu": profile})
    simulated = plan(cluster, TINY_GPT, training)
    assert "measured profile" in measured.context.predictor_identity
    assert measured.evaluation.iteration_time_s != simulated.evaluation.iteration_time_s
    # the plan's stage times are the measured layer times (plus collectives), not the datasheet's
    pipeline = measured.strategy.pipelines[0]
    stage = measured.evaluation.stages[0]
    layer = profile.layer_cost("decoder", pipeline.micro_batch_size, stage.stage.tp, measured.strategy.recompute)
    assert stage.compute_time_s >= stage.stage.num_layers * layer.time_s


def test_cli_profile_measures_the_host_by_default_at_the_profiles_shape(tmp_path, monkeypatch, capsys):
    """On the CPU the profile's host section is measured unless --no-host: with the profile's sequence, dtype and
    smallest micro-batch, and written beside the layers. (The measurement itself, 1-3 minutes of processes timing
    each other, is tests/test_host_profiler.py's; here it stands in.)"""
    import cli
    from profiler import host
    from profiler.profile import ConcurrencyPoint, HostCosts
    from report.failures import exit_status

    measured = HostCosts(
        cores=2,
        concurrency=[ConcurrencyPoint(processes=2, busy_stretch=1.1)],
        optimizer_s_per_param=1e-9,
        flatten_s_per_param=2e-9,
        microbatch_overhead_s=1e-3,
        layer_overhead_s=0.0,
        batch_s=2e-3,
        batch_s_per_sample=0.0,
    )
    asked: list[tuple[object, ...]] = []

    def stand_in(model, seq_length, dtype, micro_batch_size, say):  # type: ignore[no-untyped-def]
        asked.append((model.name, seq_length, dtype, micro_batch_size))
        return measured

    monkeypatch.setattr(host, "measure_host", stand_in)
    args = ["profile", "--model", str(EXAMPLES / "models" / "tiny-llama.yaml"), "--device", "cpu", "--seq-len", "16"]
    args += ["--micro-batches", "4,2", "--tp", "1", "--recompute", "none", "--repeats", "1", "--quiet"]
    assert exit_status(cli.app, [*args, "--out", str(tmp_path / "cpu.json")]) == 0
    assert asked == [(TINY_LLAMA.name, 16, torch.float32, 2)]
    assert load_profile(tmp_path / "cpu.json").host == measured
    assert exit_status(cli.app, [*args, "--no-host", "--out", str(tmp_path / "layers.json")]) == 0
    assert len(asked) == 1 and load_profile(tmp_path / "layers.json").host is None
    capsys.readouterr()


def test_profile_without_torch_is_a_clear_error():
    result = hetplan("profile", "--model", "llama2-7b", "--out", "x.json")
    assert result.returncode == 2
    assert "needs PyTorch" in result.stderr and "pip install" in result.stderr


def test_profile_refuses_a_dtype_it_cannot_time_before_anything_else(tmp_path):
    """fp8 is a planning dtype (Transformer Engine's GEMMs): the profiler says so in one line, as a flag error (it was
    an internal KeyError once the layers were built)."""
    result = hetplan("profile", "--model", "llama2-7b", "--dtype", "fp8", "--out", str(tmp_path / "x.json"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--dtype: expected one of auto, bf16, fp16, fp32, got 'fp8'" in result.stderr


def test_profile_target_defaults_to_fp32_on_the_cpu_and_the_catalog_key_asked_for():
    assert measure.profile_target("cpu", "auto", None) == (CPU, "fp32", "cpu")
    assert measure.profile_target("cpu", "bf16", "a100") == (CPU, "bf16", "a100-80gb")


def test_ctrl_c_during_cli_profile_writes_what_was_measured_and_exits_130(tmp_path, monkeypatch, capsys):
    """The partial profile is kept (and loads), the run still ends as interrupted (it used to exit 0)."""
    import cli
    from report.failures import exit_status

    real = measure.build_layer
    calls = {"n": 0}

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:  # the warm-up and two entries, then Ctrl-C
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(measure, "build_layer", interrupted)
    out = tmp_path / "deeper" / "cpu.json"  # its directory is created before measuring
    args = ["profile", "--model", str(EXAMPLES / "models" / "tiny-llama.yaml"), "--device", "cpu", "--out", str(out)]
    code = exit_status(cli.app, [*args, "--micro-batches", "1", "--tp", "1", "--recompute", "none", "--repeats", "1"])
    captured = capsys.readouterr()
    assert code == 130 and captured.err.strip().splitlines()[-1] == "hetplan: interrupted"
    assert "(interrupted: partial profile)" in " ".join(captured.out.split())  # the console wraps long paths
    assert len(load_profile(out).entries) == 2


FAULTS_OF_FIVE_STEPS = """
import resource, sys, torch
from profiler.measure import keep_freed_host_memory
policy = keep_freed_host_memory() if sys.argv[1] == "keep" else "default"
weights, grads = torch.ones(2**23), torch.ones(2**23)  # 32 MiB each: beyond glibc's default mmap threshold


def step() -> None:  # an update's temporaries, made and freed every step
    moment = weights * 0.9
    denominator = grads.sqrt() + 1e-8
    weights.addcdiv_(moment, denominator)


step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(policy, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_processes_that_are_timed_reuse_freed_host_memory_instead_of_faulting_in_fresh_pages():
    """What the profile's process and every local rank call: a step's large temporaries reuse the pages of the
    last step's instead of faulting in fresh ones (by default glibc maps and unmaps each: 3 x 8192 pages a step)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", FAULTS_OF_FIVE_STEPS, mode], cwd=ROOT, check=True,
                             capture_output=True, text=True, timeout=120).stdout.split()  # fmt: skip
        return " ".join(out[:-1]), int(out[-1])

    policy, kept = faults("keep")
    if "mmap threshold 1024 MiB" not in policy:
        pytest.skip(f"this C library keeps only smaller blocks ({policy or 'no mallopt'})")
    default = faults("default")[1]
    assert default > 5 * 3 * 8192 * 0.9 and kept < default / 3, (policy, kept, default)


def test_pass_speeds_read_each_pass_against_the_entries_medians():
    """Three entries over four passes, the third pass 1.4x slower for all of them: the passes read 1, 1, 1.4, 1 (each
    entry against its own median over the passes), and the drift is 40%; entries missing a pass do not count."""
    per_pass = {0: [1.0, 1.0, 1.4, 1.0], 1: [2.0, 2.0, 2.8, 2.0], 2: [5.0, 5.0, 7.0, 5.0], 3: [9.0]}
    speeds = measure.pass_speeds(per_pass)
    assert speeds == pytest.approx([1.0, 1.0, 1.4, 1.0])
    assert measure.pass_drift(speeds) == pytest.approx(0.4)
    assert measure.pass_speeds({0: [1.0]}) == [] and measure.pass_drift([]) == 0.0


def test_cli_profile_says_when_the_machine_drifted_between_passes(tmp_path, monkeypatch, capsys):
    """A machine 1.5x slower from the second of four passes on: the profile is written with its pass speeds, and the
    command says that the machine's speed moved (in one line, on stderr); a steady machine gets no such line."""
    import cli
    from report.failures import exit_status

    real = measure._sample_layer
    calls = {"n": 0}

    def drifting(*args, **kwargs):
        # The timings are set, not measured: on a shared host a real pass can itself be 1.35x slow (a clean clone's CI
        # read pass speeds 0.904, 1.0, 0.99, 1.01 under a 1.5x injected drift).
        calls["n"] += 1
        taken = real(*args, **kwargs)
        slowdown = 1.5 if calls["n"] > 4 else 1.0  # the warm-up and a pass over the three entries, then slow passes
        taken.forward_s = [0.010 * slowdown for _ in taken.forward_s]
        taken.backward_s = [0.020 * slowdown for _ in taken.backward_s]
        return taken

    monkeypatch.setattr(measure, "_sample_layer", drifting)
    out = tmp_path / "cpu.json"
    args = ["profile", "--model", str(EXAMPLES / "models" / "tiny-llama.yaml"), "--device", "cpu", "--out", str(out)]
    args += ["--micro-batches", "1", "--tp", "1", "--recompute", "none", "--repeats", "2", "--no-host"]
    assert exit_status(cli.app, args) == 0
    speeds = load_profile(out).environment["pass_speeds"]
    assert speeds == pytest.approx([1 / 1.5, 1.0, 1.0, 1.0], abs=1e-3)
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note: the slowest pass")]
    assert len(notes) == 1 and "the machine's speed moved while it was profiled" in notes[0]
    monkeypatch.setattr(measure, "_sample_layer", real)
    monkeypatch.setattr(measure, "pass_speeds", lambda per_pass: [1.0, 1.02, 0.99, 1.01])
    assert exit_status(cli.app, args) == 0
    assert "note: the slowest pass" not in capsys.readouterr().err


def test_a_cpu_profile_of_a_layer_larger_than_the_memory_is_refused_in_one_line(monkeypatch):
    """`profile --model llama3-405b --tp 1` sat at "starting" while the machine swapped, until stopped."""
    from specs.errors import SpecError

    monkeypatch.setattr(measure, "available_host_memory_bytes", lambda: 16 * 2**30)
    said = r"^--model: llama3-405b: one decoder layer at micro-batch 1, TP 1 and recompute none needs about 33\.3 GiB "
    with pytest.raises(SpecError, match=said + r".* than 80% of the 16\.0 GiB .* available: profile more TP ranks"):
        measure.check_layer_fits_host(load_model("llama3-405b"), 8192, "fp32", 1, 1)
    measure.check_layer_fits_host(load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")), 256, "fp32", 8, 1)
    monkeypatch.setattr(measure, "available_host_memory_bytes", lambda: None)  # no /proc/meminfo: nothing to check
    measure.check_layer_fits_host(load_model("llama3-405b"), 8192, "fp32", 1, 1)
