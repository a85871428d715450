"""The input boundary: every bad file gives one SpecError line naming the file, the field and the expectation."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specs import HetplanError, SpecError, load_cluster, load_model, load_training
from specs.loading import MAX_DEPTH, QUOTE_CHARS, read_mapping
from specs.outputs import check_writable, write_text_atomic

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CLUSTER_TEXT = (EXAMPLES / "hethub-768.yaml").read_text(encoding="utf-8")


def _error(path: Path, load=read_mapping) -> str:
    with pytest.raises(SpecError) as caught:
        load(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path))
    return message


def test_files_that_are_not_text_or_too_deep_are_refused(tmp_path):
    binary = tmp_path / "c.yaml"
    binary.write_bytes(b"name: x\n\xff\xfe")
    assert "not UTF-8 text (byte 0xff at offset 8)" in _error(binary)
    deep = tmp_path / "deep.yaml"
    deep.write_text("a: " + "[" * 5000 + "]" * 5000, encoding="utf-8")
    assert f"nested deeper than {MAX_DEPTH} levels" in _error(deep)
    deep_json = tmp_path / "deep.json"
    deep_json.write_text('{"a": ' + "[" * 60 + "]" * 60 + "}", encoding="utf-8")
    assert f"nested deeper than {MAX_DEPTH} levels" in _error(deep_json)


def test_a_yaml_alias_bomb_and_a_recursive_alias_are_refused_quickly(tmp_path):
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n", encoding="utf-8")
    message = _error(bomb)
    assert "aliases expand to more than" in message and len(message) < 300
    recursive = tmp_path / "recursive.yaml"
    recursive.write_text("a: &a [*a]\n", encoding="utf-8")
    assert "refers to itself" in _error(recursive)


def test_duplicate_keys_are_refused_in_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "t.yaml"
    yaml_file.write_text("global_batch_size: 64\nglobal_batch_size: 128\n", encoding="utf-8")
    assert "line 2: duplicate key 'global_batch_size'" in _error(yaml_file)
    json_file = tmp_path / "t.json"
    json_file.write_text('{"dtype": "bf16", "dtype": "fp16"}', encoding="utf-8")
    assert "duplicate key 'dtype'" in _error(json_file)
    merged = tmp_path / "merge.yaml"  # a YAML merge key may be overridden: that is not a duplicate
    merged.write_text("base: &b {x: 1}\nuse:\n  <<: *b\n  x: 2\n", encoding="utf-8")
    assert read_mapping(merged)["use"] == {"x": 2}


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("nodes: 16", "nodes: true", "groups[0].nodes: expected an integer, got true"),  # (as the file writes it)
        ("nodes: 16", "nodes: '16'", "groups[0].nodes: expected an integer, got '16'"),
        ("nodes: 16", "nodes: 16.0", "groups[0].nodes: expected an integer, got 16.0"),
        ("devices_per_node: 8", "devices_per_node: 1000000000000", "expected a value <= 4096, got 1000000000000"),
        ("nic_gbps: 200", "nic_gbps: .inf", "nic_gbps: expected a finite number, got inf"),
        ("nic_gbps: 200", "nic_gbps: .nan", "nic_gbps: expected a finite number, got nan"),
        ("nic_gbps: 200", "nic_gbps: fast", "nic_gbps: expected a number, got 'fast'"),
    ],
)
def test_cluster_numbers_must_be_numbers_of_physical_size(tmp_path, old, new, expected):
    assert old in CLUSTER_TEXT
    path = tmp_path / "c.yaml"
    path.write_text(CLUSTER_TEXT.replace(old, new, 1), encoding="utf-8")
    assert expected in _error(path, load_cluster)


def test_training_values_are_strict_and_bounded(tmp_path):
    for text, expected in [
        ('{"global_batch_size": NaN}', "NaN is not a number a spec can use"),
        ('{"global_batch_size": 9223372036854775808}', "expected a value <= 1048576"),
        ('{"global_batch_size": 1024.0}', "expected an integer, got 1024.0"),
        ('{"zero_stage": true}', "zero_stage: expected 0, 1, 2 or 3, got true"),
        ('{"zero_stage": 4}', "zero_stage: expected 0, 1, 2 or 3, got 4"),
        ('{"micro_batch_sizes": [1, true]}', "micro_batch_sizes[1]: expected an integer, got true"),
    ]:
        path = tmp_path / "t.json"
        path.write_text(text, encoding="utf-8")
        assert expected in _error(path, load_training)


def test_error_messages_quote_at_most_a_few_hundred_characters(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("dtype: " + "x" * 100_000 + "\n", encoding="utf-8")
    message = _error(path, load_training)
    assert "dtype" in message and len(message) < len(str(path)) + QUOTE_CHARS + 100


def test_atomic_writes_keep_the_old_file_on_failure_and_outputs_are_checked_first(tmp_path):
    target = tmp_path / "plan.json"
    write_text_atomic(target, "first")
    write_text_atomic(target, "second")
    assert target.read_text(encoding="utf-8") == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]  # no temporary file left
    with pytest.raises(SpecError, match="cannot write: No space left on device"):
        write_text_atomic("/dev/full", "x")
    assert check_writable(tmp_path / "new" / "dir" / "x.json").parent.is_dir()
    with pytest.raises(SpecError, match="is a directory"):
        check_writable(tmp_path)
    existing = tmp_path / "plan.json"
    assert check_writable(existing) == existing and existing.read_text(encoding="utf-8") == "second"  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new", "plan.json"]  # the probe left nothing
    if Path("/proc/version").is_file():  # permission bits let root write where the kernel refuses: tried first
        with pytest.raises(SpecError, match="--out: /proc/version: cannot write"):
            check_writable("/proc/version")
        with pytest.raises(SpecError, match="--png: /proc/x.png: cannot write"):
            check_writable("/proc/x.png", "--png")


def test_every_atomic_write_gets_a_files_mode_and_names_its_file_when_it_fails(tmp_path):
    """Pictures go through the same temporary-file-and-rename as JSON (explain --png was written 0600, the
    temporary's mode, and a failure named the temporary)."""
    import os

    from specs.outputs import write_atomic

    umask = os.umask(0o022)
    try:
        picture = tmp_path / "plan.png"
        write_atomic(picture, lambda temporary: temporary.write_bytes(b"png"), suffix=".png")
        assert picture.read_bytes() == b"png" and picture.stat().st_mode & 0o777 == 0o644
        picture.chmod(0o640)
        write_atomic(picture, lambda temporary: temporary.write_bytes(b"again"), suffix=".png")
        assert picture.stat().st_mode & 0o777 == 0o640  # an existing file keeps its mode
    finally:
        os.umask(umask)
    missing = tmp_path / "no" / "such" / "dir" / "x.png"
    with pytest.raises(SpecError, match=f"^{missing}: cannot write: No such file or directory$"):
        write_atomic(missing, lambda temporary: temporary.write_bytes(b"x"))
    assert [p.name for p in tmp_path.iterdir()] == ["plan.png"]  # no temporary left


def _mutations(text: str, rng: random.Random) -> str:
    """One random edit of a spec file's text: a value, a key, a byte, nesting or a truncation."""
    lines = text.splitlines()
    index = rng.randrange(len(lines))
    line = lines[index]
    choice = rng.randrange(8)
    replacements = ["true", "-1", "0", "1e400", ".inf", "'x'", "[]", "{}", "null", "2e19", "&a [*a]", "0.5", "~"]
    if choice == 0 and ":" in line:
        key, _, _ = line.partition(":")
        lines[index] = f"{key}: {rng.choice(replacements)}"
    elif choice == 1:
        lines.insert(index, line)  # a duplicate key (or list entry)
    elif choice == 2:
        cut = rng.randrange(len(text))
        return text[:cut]
    elif choice == 3:
        data = bytearray(text.encode("utf-8"))
        data[rng.randrange(len(data))] = rng.randrange(256)
        return data.decode("utf-8", errors="replace")
    elif choice == 4:
        lines[index] = "  " * rng.randrange(6) + line.strip()
    elif choice == 5:
        del lines[index]
    elif choice == 6:
        lines[index] = line.replace(":", rng.choice([" =", "::", ": :", ""]), 1)
    else:
        lines[index] = "x: " + "[" * rng.randrange(40, 80) + "]" * rng.randrange(40, 80)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    ("source", "loader"),
    [
        (EXAMPLES / "hethub-768.yaml", load_cluster),
        (EXAMPLES / "four-vendor-256.yaml", load_cluster),
        (EXAMPLES / "training" / "hethub-140b.yaml", load_training),
        (EXAMPLES / "models" / "tiny-llama.yaml", load_model),
    ],
)
def test_fuzzed_spec_files_load_or_fail_with_one_line(tmp_path, source, loader):
    """Seeded random edits of the bundled files: each loads, or raises a HetplanError of one line; nothing else."""
    rng = random.Random(f"{source.name}")
    text = source.read_text(encoding="utf-8")
    failures = 0
    for attempt in range(150):
        path = tmp_path / f"{attempt}{source.suffix}"
        path.write_text(_mutations(text, rng), encoding="utf-8")
        try:
            loader(str(path))
        except HetplanError as err:
            failures += 1
            assert "\n" not in str(err) and len(str(err)) < 600, str(err)
    assert failures > 30  # the edits do break files: the test exercises the error paths


def test_json_specs_are_fuzzed_too(tmp_path):
    rng = random.Random(7)
    base = {"global_batch_size": 64, "dtype": "bf16", "micro_batch_sizes": [1, 2], "recompute": ["none"]}
    values = [True, None, -1, 0, 2**70, 1.5, "x", [], {}, [[[]]], "bf16"]
    failures = 0
    for attempt in range(100):
        data = dict(base)
        data[rng.choice([*base, "unknown"])] = rng.choice(values)
        path = tmp_path / f"{attempt}.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        try:
            load_training(path)
        except HetplanError as err:
            failures += 1
            assert "\n" not in str(err)
    assert failures > 30


def test_cpu_groups_need_no_nic_and_one_group_or_cpu_clusters_no_network(tmp_path):
    """A laptop's cluster is two lines of group; what it leaves out is assumed (and listed for the plan to record),
    while accelerator groups and mixed clusters must still say what their network is."""
    laptop = tmp_path / "laptop.yaml"
    laptop.write_text("name: laptop\ngroups:\n  - {name: cpu, device: cpu, nodes: 1, devices_per_node: 2}\n")
    cluster = load_cluster(laptop)
    group = cluster.groups[0]
    assert (group.nics_per_node, group.nic_bw_bytes_per_s) == (1, 10e9 / 8)
    assert (cluster.topology, cluster.inter_group_bw_bytes_per_s) == ("clos", 10e9 / 8)
    assert dict(cluster.defaults) == {
        "groups[0].nics_per_node": 1,
        "groups[0].nic_gbps": 10.0,
        "network.topology": "clos",
        "network.inter_group_gbps": 10.0,
    }
    short = load_cluster(EXAMPLES / "cpu-hetero.yaml")  # written without NICs and network
    full = tmp_path / "cpu-hetero.yaml"
    nic = "nodes: 1, devices_per_node: 2, nics_per_node: 1, nic_gbps: 10"
    full.write_text(
        f"name: cpu-hetero\ngroups:\n  - {{name: fast, device: cpu, {nic}}}\n"
        f"  - {{name: slow, device: cpu, {nic}, emulate_speed: 0.5}}\n"
        "network: {topology: clos, inter_group_gbps: 10}\n"
    )
    written = load_cluster(full)
    assert written.groups == short.groups and written.defaults == () and len(short.defaults) == 6
    assert written.inter_group_bw_bytes_per_s == short.inter_group_bw_bytes_per_s
    gpu = tmp_path / "gpu.yaml"
    gpu.write_text("name: g\ngroups:\n  - {name: a, device: a100, nodes: 1, devices_per_node: 8, nic_gbps: 200}\n")
    assert _error(gpu, load_cluster) == (
        f"{gpu}: groups[0].nics_per_node: required for a100-80gb devices (only cpu groups default to 1 NIC of 10 Gb/s)"
    )
    one_gpu_group = gpu.read_text().replace("nic_gbps: 200", "nics_per_node: 4, nic_gbps: 200")
    gpu.write_text(one_gpu_group)
    assert load_cluster(gpu).inter_group_bw_bytes_per_s == 200e9 / 8  # one group: no network needed either
    gpu.write_text(one_gpu_group + "  - {name: c, device: cpu, nodes: 1, devices_per_node: 2}\n")
    assert "network: required for a cluster of several groups with accelerators" in _error(gpu, load_cluster)


def test_training_on_cpu_devices_defaults_to_fp32_unless_a_dtype_is_chosen(tmp_path):
    from specs.training import on_devices

    default = load_training(None)
    assert default.dtype == "bf16"
    chosen, note = on_devices(default, {"cpu"})
    assert chosen.dtype == "fp32" and note.startswith("note: training in fp32 on cpu devices")
    assert chosen.model_dump(exclude={"dtype"}) == default.model_dump(exclude={"dtype"})
    assert on_devices(default, {"cpu", "nvidia"}) == (default, "")
    asked = load_training(None, {"dtype": "bf16"})
    assert on_devices(asked, {"cpu"}) == (asked, "")  # a dtype the user chose stays
    written = tmp_path / "t.yaml"
    written.write_text("dtype: fp16\n")
    assert on_devices(load_training(written), {"cpu"})[0].dtype == "fp16"
    # devices without bf16 (V100 beside A100): fp16, said; a chosen dtype stays (the planner names what it lacks)
    chosen, note = on_devices(default, {"nvidia"}, ["v100"])
    assert chosen.dtype == "fp16" and note.startswith("note: training in fp16 (v100 has no bf16)")
    assert on_devices(asked, {"nvidia"}, ["v100"]) == (asked, "")
    # FP8 chosen stays, and where a device has none the note says its GEMMs run bf16 (it was taken without a word)
    fp8 = load_training(None, {"dtype": "fp8"})
    assert on_devices(fp8, {"cpu"}, [], ["cpu"]) == (fp8, "note: cpu has no FP8: its GEMMs run in bf16 (as predicted)")
    assert on_devices(fp8, {"nvidia"}, [], ["a100", "v100"])[1].startswith("note: a100, v100 have no FP8: their")
    assert on_devices(fp8, {"nvidia"}) == (fp8, "")
