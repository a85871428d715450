"""Spec files: good ones load, bad ones fail with one line naming the file, the field and the expectation."""

from __future__ import annotations

import json

import pytest

from planner.plan import load_plan
from specs import SpecError, load_cluster, load_model, load_training
from specs.units import GIB
from tests.conftest import EXAMPLES

GOOD_CLUSTER = """
name: mixed
groups:
  - name: fast
    device: a100-80gb
    nodes: 2
    devices_per_node: 8
    nics_per_node: 8
    nic_gbps: 200
  - name: slow
    device: v100
    nodes: 1
    devices_per_node: 8
    nics_per_node: 4
    nic_gbps: 100
    memory_GB: 16
network:
  topology: rail-optimized
  inter_group_gbps: 100
"""


def test_good_cluster_loads_with_overrides_in_si_units(write):
    cluster = load_cluster(write("c.yaml", GOOD_CLUSTER))
    assert cluster.num_devices == 24
    slow = cluster.group("slow")
    assert slow.device.key == "v100"
    assert slow.device.memory_bytes == 16 * GIB  # the override, not the catalog's 32
    assert cluster.group("fast").nic_bw_per_device_bytes_per_s == pytest.approx(200e9 / 8)
    assert cluster.inter_group_bw_bytes_per_s == pytest.approx(100e9 / 8)


def test_cluster_json_equals_yaml(write):
    import yaml

    from_yaml = load_cluster(write("c.yaml", GOOD_CLUSTER))
    from_json = load_cluster(write("c.json", json.dumps(yaml.safe_load(GOOD_CLUSTER))))
    assert from_yaml.groups == from_json.groups


@pytest.mark.parametrize(
    ("edit", "field", "expectation"),
    [
        (lambda t: t.replace("nodes: 2", "nodes: 0"), "groups[0].nodes", "expected a value >= 1, got 0"),
        (lambda t: t.replace("nodes: 2", "nodes: two"), "groups[0].nodes", "expected an integer, got 'two'"),
        (lambda t: t.replace("device: v100", "device: v1000"), "groups[1].device", "unknown device 'v1000'"),
        (
            lambda t: t.replace("    nic_gbps: 100\n", "    nic_gbps: 100\n    nic_gpbs: 1\n", 1),
            "groups[1].nic_gpbs",
            "unknown field: did you mean nic_gbps?",  # an optional field is suggested too (it said "unknown field")
        ),
        (lambda t: t.replace("topology:", "topolgy:"), "network.topolgy", "unknown field: did you mean topology?"),
        # a misspelt required field is named as the misspelling, not as the field it left missing
        (lambda t: t.replace("nodes: 2", "node: 2"), "groups[0].node", "unknown field: did you mean nodes (required"),
        (lambda t: t.replace("name: slow", "name: fast"), "groups", "used twice"),
        (lambda t: t.replace("topology: rail-optimized", "topology: torus"), "network.topology", "rail-only"),
        (lambda t: t.replace("  inter_group_gbps: 100\n", ""), "network.inter_group_gbps", "required field is missing"),
        (lambda t: t.replace("name: mixed\n", ""), "name", "required field is missing"),
    ],
)
def test_bad_cluster_names_file_field_and_expectation(write, edit, field, expectation):
    path = write("bad.yaml", edit(GOOD_CLUSTER))
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: {field}: "), message
    assert expectation in message
    assert "\n" not in message


def test_every_wrong_field_is_named_on_the_one_line(write):
    """A file with several mistakes names the first with its expectation and the others by field (it said "(and 1
    more error)", leaving the user to find it by running again)."""
    path = write("bad.yaml", GOOD_CLUSTER.replace("nodes: 2", "nodes: 0").replace("nic_gbps: 100", "nic_gbps: x"))
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: groups[0].nodes: "), message
    assert message.endswith("(also wrong: groups[1].nic_gbps)"), message
    # a misspelling's missing field is the same error, in its own group only
    path = write("typo.yaml", GOOD_CLUSTER.replace("nodes: 2", "nodse: 2").replace("nodes: 1", "nodes: 0"))
    with pytest.raises(SpecError) as caught:
        load_cluster(path)
    assert str(caught.value).startswith(f"{path}: groups[0].nodse: unknown field: did you mean nodes")
    assert str(caught.value).endswith("(also wrong: groups[1].nodes)")


def test_unreadable_files_give_one_line(write, tmp_path):
    with pytest.raises(SpecError, match="file not found"):
        load_cluster(tmp_path / "missing.yaml")
    with pytest.raises(SpecError, match=r"broken.yaml: line 3: invalid YAML"):
        load_cluster(write("broken.yaml", "name: x\ngroups: [\n"))
    with pytest.raises(SpecError, match="expected a mapping at the top level, got a list"):
        load_cluster(write("list.yaml", "- 1\n- 2\n"))
    with pytest.raises(SpecError, match=r"empty.yaml: the file is empty: expected a mapping"):
        load_cluster(write("empty.yaml", "# nothing yet\n"))
    with pytest.raises(SpecError, match="invalid JSON"):
        load_cluster(write("broken.json", "{"))


def test_every_example_cluster_loads():
    paths = sorted(EXAMPLES.glob("*.yaml"))
    assert len(paths) >= 3
    for path in paths:
        assert load_cluster(path).num_devices > 0
    assert load_training(EXAMPLES / "training" / "hethub-140b.yaml").global_batch_size == 1024
    assert load_model(str(EXAMPLES / "models" / "tiny-llama.yaml")).num_layers == 8


def test_model_from_catalog_alias_yaml_and_hf_configs(write):
    assert load_model("LLAMA-2-70B").key == "llama2-70b"
    custom = load_model(
        str(
            write(
                "tiny.yaml",
                """
num_layers: 4
hidden_size: 256
ffn_hidden_size: 1024
num_attention_heads: 8
num_kv_heads: 2
vocab_size: 1000
seq_length: 128
mlp: swiglu
""",
            )
        )
    )
    assert custom.key == "tiny" and custom.kv_size == 64
    llama = load_model(
        str(
            write(
                "config.json",
                json.dumps(
                    {
                        "model_type": "llama",
                        "hidden_size": 4096,
                        "intermediate_size": 14336,
                        "num_hidden_layers": 32,
                        "num_attention_heads": 32,
                        "num_key_value_heads": 8,
                        "vocab_size": 128256,
                        "max_position_embeddings": 8192,
                        "hidden_act": "silu",
                        "tie_word_embeddings": False,
                    }
                ),
            )
        )
    )
    assert llama.total_params() == load_model("llama3-8b").total_params()
    assert llama.key == llama.name == write("x", "").parent.name  # a config.json is named by its directory


QWEN3_4B = {  # Hugging Face config.json of Qwen/Qwen3-4B, the fields hetplan reads
    "model_type": "qwen3",
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}


def test_a_config_heads_wider_than_hidden_over_heads_are_costed_at_their_width(write):
    """Qwen3-4B's 32 heads of 128 at hidden 2560 were refused (and, before, costed as heads of 80: 3.7B parameters
    for the model card's 4.0B); they are the catalog's qwen3-4b in shape."""
    qwen3 = load_model(str(write("config.json", json.dumps(QWEN3_4B))))
    assert qwen3.head_dim == qwen3.head_size == 128 and qwen3.q_size == 4096 and qwen3.kv_size == 1024
    assert qwen3.total_params() == pytest.approx(4.0e9, rel=0.01)  # model card: 4.0B, 3.6B without the embedding
    catalog = load_model("qwen3-4b")
    assert qwen3.model_copy(update={"seq_length": 4096}).shape == catalog.shape  # (the config's longest: 40960)
    assert qwen3.layer_params() == catalog.layer_params()
    # a layer's weights are its GEMMs: 2 FLOPs per weight and token (RMSNorm scales aside)
    assert qwen3.layer_gemm_flops(1) == 2 * (qwen3.layer_params() - 2 * qwen3.hidden_size)
    assert qwen3.layer_attention_flops(1, 10) == 4 * 10 * 10 * 4096


def test_a_head_dim_of_hidden_over_heads_is_the_default_model(write):
    """Qwen3-8B's config gives head_dim 128 = 4096 / 32: the same spec as without it, files and plans alike."""
    plain = {**QWEN3_4B, "hidden_size": 4096, "intermediate_size": 12288}
    given = load_model(str(write("given.json", json.dumps(plain))))
    implied = load_model(str(write("implied.json", json.dumps({**plain, "head_dim": None}))))
    left_out = load_model(str(write("left-out.json", json.dumps({k: v for k, v in plain.items() if k != "head_dim"}))))
    assert given.head_dim is None and given.shape == implied.shape == left_out.shape and given.head_size == 128
    assert "head_dim" not in given.model_dump()
    wide = load_model(str(write("wide.json", json.dumps(QWEN3_4B))))
    assert wide.model_dump()["head_dim"] == 128


def test_a_head_dim_lets_heads_not_divide_the_hidden_size(write):
    """Gemma-7B's 16 heads of 256 at hidden 3072; 7 heads do not divide 3072, and need their head_dim."""
    shape = {"num_layers": 2, "hidden_size": 3072, "ffn_hidden_size": 256, "num_attention_heads": 16,
             "num_kv_heads": 16, "vocab_size": 100, "seq_length": 64, "mlp": "swiglu"}  # fmt: skip
    assert load_model(str(write("gemma.yaml", json.dumps({**shape, "head_dim": 256})))).q_size == 4096
    assert load_model(str(write("gemma.yaml", json.dumps({**shape, "head_dim": 192})))).head_dim is None
    seven = {**shape, "num_attention_heads": 7, "num_kv_heads": 7}
    assert load_model(str(write("seven.yaml", json.dumps({**seven, "head_dim": 256})))).q_size == 7 * 256
    with pytest.raises(SpecError, match="must be a multiple of num_attention_heads 7 .or give the model's head_dim"):
        load_model(str(write("bad.yaml", json.dumps(seven))))
    with pytest.raises(SpecError, match=r"odd.yaml: head_dim 255: expected an even head size \(a Llama-style"):
        load_model(str(write("odd.yaml", json.dumps({**seven, "head_dim": 255}))))


def test_a_checkpoints_directory_given_for_the_model_reads_its_config(write):
    """`--model hf/qwen3-0.6b` said "expected a file, got a directory" with no word of the config.json in it; then
    named the config.json and still refused: a Hugging Face checkpoint's directory is how its tools take a model."""
    config = write("config.json", json.dumps(QWEN3_4B))
    from_directory = load_model(config.parent)
    assert from_directory == load_model(config) and from_directory.key == config.parent.name
    assert from_directory.source.endswith(str(config))
    with pytest.raises(SpecError, match="expected a file, got a directory$"):  # one without a config.json
        load_model(config.parent.parent)


def test_a_config_json_given_from_its_directory_is_named_by_it(write, monkeypatch):
    """`--model config.json` in the checkpoint's directory: the model's name was '' (the bare path's parent)."""
    config = write(
        "config.json", json.dumps({"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100})
    )
    monkeypatch.chdir(config.parent)
    model = load_model("config.json")
    assert model.key == model.name == config.parent.name != ""


def test_gpt2_configs_load(write):
    gpt2 = load_model(
        str(
            write(
                "gpt2.json",
                json.dumps(
                    {
                        "model_type": "gpt2",
                        "n_embd": 768,
                        "n_layer": 12,
                        "n_head": 12,
                        "vocab_size": 50257,
                        "n_positions": 1024,
                    }
                ),
            )
        )
    )
    assert gpt2.mlp == "gelu" and gpt2.ffn_hidden_size == 3072 and gpt2.tied_embeddings  # GPT-2's default
    assert gpt2.total_params() == pytest.approx(124.4e6, rel=0.01)  # GPT-2 small: 124M parameters
    untied = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 100}
    untied_path = write("untied.json", json.dumps({**untied, "tie_word_embeddings": False}))
    assert not load_model(str(untied_path)).tied_embeddings
    wrong = write("wrong.json", json.dumps({**untied, "tie_word_embeddings": "no"}))
    with pytest.raises(SpecError, match=r"wrong.json: tie_word_embeddings: expected true or false, got 'no'"):
        load_model(str(wrong))  # in the config's own name


QWEN = '"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28'


@pytest.mark.parametrize(
    ("text", "field", "expectation"),
    [
        ('{"model_type": "t5"}', "model_type", "expected a Llama, Mistral, Qwen or GPT-2"),
        ('{"model_type": "gemma2"}', "model_type", "got 'gemma2': a dense decoder of another type can be written as a"),
        ('{"model_type": "llama", "hidden_size": 64}', "num_attention_heads", "required"),
        (
            '{"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
            '"num_attention_heads": 5, "vocab_size": 10}',
            "",
            "multiple of num_attention_heads",
        ),
        # named by the config's own fields (it said num_layers, num_kv_heads, n_embd's hetplan names)
        (
            f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": "28"}}',
            "num_hidden_layers",
            "expected an integer, got '28'",
        ),
        (f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 0}}', "num_hidden_layers", "expected a value >= 1, got 0"),
        (
            f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 28, "num_key_value_heads": 5}}',
            "",
            "num_attention_heads 28 must be a multiple of num_key_value_heads 5",
        ),
        ('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 5, "vocab_size": 10}', "", "n_embd 64 must be"),
        # without num_key_value_heads the kv heads are the heads: one wrong field named once
        (
            '{"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": "28", '
            '"vocab_size": 10, "num_hidden_layers": 28}',
            "num_attention_heads",
            "expected an integer, got '28'",
        ),
        # "false" was taken as tied (bool of a non-empty string)
        (
            f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 28, "tie_word_embeddings": "false"}}',
            "tie_word_embeddings",
            "expected true or false, got 'false'",
        ),
        (f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 28, "head_dim": "128"}}', "head_dim", "got '128'"),
        # a misspelt key Hugging Face would ignore (the model read untied), or one that would be said missing
        (
            f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 28, "tie_word_embedding": true}}',
            "tie_word_embedding",
            "not a field of the config.json: did you mean tie_word_embeddings? (Hugging Face ignores it)",
        ),
        (f'{{{QWEN}, "vocab_size": 10, "num_hidden_layer": 28}}', "num_hidden_layer", "mean num_hidden_layers?"),
        (f'{{{QWEN}, "vocab_size": 10, "num_hidden_layers": 28, "head_dim": 0}}', "head_dim", ">= 1, got 0"),
    ],
)
def test_bad_hf_configs(write, text, field, expectation):
    path = write("config.json", text)
    with pytest.raises(SpecError) as caught:
        load_model(str(path))
    assert str(caught.value).startswith(f"{path}: {field}")
    assert expectation in str(caught.value) and "also wrong" not in str(caught.value)


@pytest.mark.parametrize(
    "config",
    [
        {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 64},
        {"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128},  # read as hetplan's, misspelt
        {"n_layer": 2, "n_embd": 64},
    ],
)
def test_a_hf_config_without_model_type_says_it_is_missing_and_which_are_translated(write, config):
    """A config.json without `model_type` said "got ''" (as if the file gave an empty one) or, without
    `architectures` too, "num_hidden_layers: unknown field: did you mean num_layers"."""
    path = write("config.json", json.dumps(config))
    with pytest.raises(SpecError) as caught:
        load_model(str(path))
    assert str(caught.value) == (
        f"{path}: model_type: required field is missing: expected a Llama, Mistral, Qwen or GPT-2 config.json "
        "(model_type llama, mistral, qwen, qwen2, qwen3, internlm2, yi, baichuan or gpt2)"
    )


FILES_OF_EACH_KIND = {  # a file of each kind a user may give in the wrong place: its name, its text, what it is
    "plan": ("plan.json", '{"schema": "hetplan.plan/1", "cluster": "mixed", "pipelines": []}', "a plan"),
    "profile": ("h100.json", '{"schema": "hetplan.profile/1", "entries": []}', "a device profile"),
    "cluster": ("cluster.yaml", GOOD_CLUSTER, "a cluster file"),
    "model": ("model.yaml", (EXAMPLES / "models" / "tiny-gpt.yaml").read_text(), "a model file"),
    "training": ("training.yaml", (EXAMPLES / "training" / "cpu-run.yaml").read_text(), "a training file"),
}
LOADERS = {  # each loader: its message for a file of another kind, and the kinds tried
    load_cluster: ("expected a cluster file (name, groups, network), got {}", ("plan", "profile", "model", "training")),
    load_model: (
        "expected a model file (num_layers, hidden_size, ...) or a Hugging Face config.json, got {}",
        ("plan", "cluster", "training"),
    ),
    load_training: ("expected a training file (global_batch_size, dtype, ...), got {}", ("plan", "cluster", "model")),
    load_plan: (
        "schema: expected 'hetplan.plan/1': a plan, as `hetplan plan --out` writes (got {})",
        ("profile", "training"),
    ),
}


@pytest.mark.parametrize(("load", "given"), [(load, kind) for load, (_, kinds) in LOADERS.items() for kind in kinds])
def test_a_file_of_another_kind_is_named_as_what_it_is_and_what_was_expected(write, load, given):
    """`plan --cluster plan.json` listed the plan's fields as misspelt ("schema: unknown field (also wrong: name,
    groups, cluster and 32 more)"); so did the model and training loaders for a file of another kind."""
    name, text, what = FILES_OF_EACH_KIND[given]
    path = write(name, text)
    with pytest.raises(SpecError) as caught:
        load(str(path))
    assert str(caught.value) == f"{path}: {LOADERS[load][0].format(what)}"


def test_unknown_model_lists_catalog_and_names_who_asked(tmp_path):
    """From Python the error names load_model() (it named the CLI's --model); from a run record, its file and field."""
    with pytest.raises(SpecError, match=r"^load_model\(\): unknown model 'gpt5'.*llama-140b"):
        load_model("gpt5")
    from predictor.runs import load_runs

    strategy = {"group": "cpu", "tp": 1, "pp": 1, "dp": 4, "micro_batch_size": 1, "recompute": "none"}
    record = {"schema": "hetplan.run/1", "name": "r", "source": "s", "cluster": str(EXAMPLES / "cpu-2x2.yaml"),
              "model": "gpt5", "measured_iteration_time_s": 1.0, "strategy": strategy}  # fmt: skip
    path = tmp_path / "run.json"
    path.write_text(json.dumps(record))
    with pytest.raises(SpecError, match=rf"^{path}: model: unknown model 'gpt5'"):
        load_runs(path)


def test_training_flags_override_file(write):
    path = write("t.yaml", "global_batch_size: 512\nrecompute: full\nzero_stage: 0\n")
    training = load_training(path, {"global_batch_size": 256, "dtype": None})
    assert training.global_batch_size == 256
    assert training.recompute == ("full",)
    assert training.zero_stage == 0
    with pytest.raises(SpecError, match=r"t\.yaml: zero_stage: "):
        load_training(write("t.yaml", "zero_stage: 4\n"))
    # a Python caller's overrides are named as such (they read "training flags", which Python has none of)
    with pytest.raises(SpecError, match=r"^load_training\(\): overrides: dtype: "):
        load_training(None, {"dtype": "int4"})
    with pytest.raises(SpecError, match=r"t\.yaml \(with overrides\): dtype: "):
        load_training(write("t.yaml", "global_batch_size: 8\n"), {"dtype": "int4"})
    with pytest.raises(SpecError, match=r"^training flags: dtype: "):  # the CLI's
        load_training(None, {"dtype": "int4"}, "flags")
    # a misspelt optional field names the field it may have meant (it said "unknown field (check the spelling...")
    with pytest.raises(SpecError, match=r"t\.yaml: global_batch: unknown field: did you mean global_batch_size\?$"):
        load_training(write("t.yaml", "global_batch: 8\n"))


def test_specs_load_from_a_path_object_or_from_the_mapping_a_file_holds():
    """A launcher builds its cluster and training in code: load_cluster(dict) and load_training(dict) failed with a
    TypeError, and load_model(Path) with an AttributeError; a mapping is checked as its file would be."""
    import yaml

    cluster_file = EXAMPLES / "cpu-2x2.yaml"
    from_mapping_cluster = load_cluster(yaml.safe_load(cluster_file.read_text()))
    assert from_mapping_cluster.groups == load_cluster(cluster_file).groups
    assert from_mapping_cluster.source == "cluster mapping"
    model_file = EXAMPLES / "models" / "tiny-llama.yaml"
    assert load_model(model_file) == load_model(str(model_file))
    from_mapping = load_model(yaml.safe_load(model_file.read_text()))
    assert from_mapping.key == "model" and from_mapping.num_layers == load_model(model_file).num_layers
    assert load_training({"global_batch_size": 16}, {"dtype": "fp16"}).dtype == "fp16"
    with pytest.raises(SpecError, match=r"^cluster mapping: groups: required field is missing$"):
        load_cluster({"name": "x"})
    with pytest.raises(SpecError, match=r"^training mapping: global_batch: unknown field"):
        load_training({"global_batch": 16})


def test_a_spec_built_in_code_is_refused_in_one_line_as_its_file_would_be():
    """TrainingSpec(...) and ModelSpec(...) raised pydantic's multi-line ValidationError; files still name the file."""
    from specs import ModelSpec, TrainingSpec

    with pytest.raises(SpecError) as caught:
        TrainingSpec(global_batch_size=-1)
    assert str(caught.value) == "TrainingSpec(): global_batch_size: expected a value >= 1, got -1"
    with pytest.raises(SpecError) as caught:
        ModelSpec(name="x")
    assert str(caught.value).startswith("ModelSpec(): num_layers: required field is missing (also wrong: hidden_size")
    assert "\n" not in str(caught.value)
    with pytest.raises(SpecError, match=r"^training mapping: global_batch_size: expected a value >= 1, got -1$"):
        load_training({"global_batch_size": -1})
    assert TrainingSpec(global_batch_size=8).global_batch_size == 8


def test_a_model_shape_is_a_whole_number_as_in_every_other_file():
    """A quoted YAML number ("num_layers": "8") was taken as 8 where the cluster and training files refuse it."""
    shape = load_model("llama2-7b").model_dump(exclude_none=True)
    with pytest.raises(SpecError, match=r"^model mapping: num_layers: expected an integer, got '8'$"):
        load_model({**shape, "num_layers": "8"})
    with pytest.raises(SpecError, match=r"^model mapping: hidden_size: expected an integer, got 4096\.0$"):
        load_model({**shape, "hidden_size": 4096.0})
    assert load_model({**shape, "num_layers": 8}).num_layers == 8
    # numpy's integers (a launcher's arrays) are integers: strict validation refused them as "not an integer"
    import numpy as np

    assert type(load_model({**shape, "num_layers": np.int64(8)}).num_layers) is int
    assert load_training(None, {"global_batch_size": np.int32(64)}).global_batch_size == 64
    with pytest.raises(SpecError, match=r"num_layers: expected an integer, got true$"):
        load_model({**shape, "num_layers": True})


def test_only_a_translated_config_json_is_said_to_train_at_its_longest_context(write):
    """The note keyed on a source beginning "Hugging Face config": a model file citing "Hugging Face config.json of
    ..." (as the catalog's do) was told it came from a config."""
    from specs.model import hf_sequence_note

    shape = load_model("llama2-7b").model_dump(exclude_none=True)
    cited = load_model({**shape, "source": "Hugging Face config.json of meta-llama/Llama-2-7b-hf"})
    assert hf_sequence_note(cited, load_training()) == ""
    config = write("config.json", json.dumps({
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 2048,
    }))  # fmt: skip
    translated = load_model(str(config))
    assert hf_sequence_note(translated, load_training()).startswith(
        f"note: sequences of 2048 tokens, the longest context of {config} (max_position_embeddings, else 4096)"
    )
    assert hf_sequence_note(translated, load_training(None, {"seq_length": 512})) == ""


def test_what_a_config_json_sets_and_hetplan_does_not_model_is_said(write):
    """Mistral's sliding window (costed as full attention over 32768 tokens), Llama 3.1's RoPE scaling and rope base,
    Qwen2's Q/K/V biases, Qwen3's Q/K norms: read and dropped without a word, as a newcomer found."""
    from specs.model import hf_unmodelled_note

    shape = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
             "vocab_size": 100, "max_position_embeddings": 32768}  # fmt: skip

    def note(**config: object) -> str:
        return hf_unmodelled_note(load_model(str(write("config.json", json.dumps({**shape, **config})))))

    said = "sets what hetplan does not model: "
    plain = note(model_type="llama", rope_theta=10000.0, rms_norm_eps=1e-5)  # Megatron's own values
    assert plain == ""
    mistral = note(model_type="mistral", sliding_window=4096)
    assert mistral.endswith(said + "a sliding attention window of 4096 tokens (attention costed over whole sequences)")
    path = write("config.json", json.dumps({**shape, "model_type": "mistral", "sliding_window": 4096}))
    assert hf_unmodelled_note(load_model(str(path)), seq_length=4096) == ""  # no sequence longer than the window
    assert note(model_type="qwen2", sliding_window=4096, use_sliding_window=False).endswith(said + "Q/K/V biases")
    assert note(model_type="qwen3").endswith(said + "per-head Q/K norms")
    llama = note(model_type="llama", rope_theta=500000.0, rope_scaling={"rope_type": "llama3", "factor": 8.0})
    expected = "RoPE scaling (llama3); rope_theta 500000 (no cost; the exports leave Megatron's 10000 and 1e-5: "
    expected += "add them)"
    assert llama.endswith(said + expected)
    assert note(model_type="llama", attention_bias=True).endswith(said + "Q/K/V biases")
    cited = load_model({**load_model("llama2-7b").model_dump(exclude_none=True), "source": "Hugging Face config.json"})
    assert hf_unmodelled_note(cited) == ""  # a model file, not a translated config


def test_a_plan_without_its_schema_is_still_named_a_plan(tmp_path):
    """A plan has a top-level zero_stage and dtype, a training file's marks: without `schema` it read as a training
    file ('got a training file') and passed load_training's kind check."""
    from planner import plan

    made = plan(load_cluster(EXAMPLES / "cpu-2x2.yaml"), load_model(EXAMPLES / "models" / "tiny-llama.yaml"),
                load_training(overrides={"global_batch_size": 8}))  # fmt: skip
    written = made.to_dict()
    del written["schema"]
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(written))
    with pytest.raises(SpecError, match=r"expected a training file .*, got a plan$"):
        load_training(path)
    with pytest.raises(SpecError, match=r"schema"):
        load_plan(path)


def test_a_cluster_given_as_run_records_is_named():
    """`hetplan validate cluster.yaml` said "schema: expected 'hetplan.run/1', ... got None"."""
    from predictor.runs import load_runs

    with pytest.raises(SpecError, match=r"cpu-2x2\.yaml: expected a run record .*, got a cluster file$"):
        load_runs(EXAMPLES / "cpu-2x2.yaml")


def test_a_predictor_file_where_a_spec_is_expected_is_named(tmp_path):
    """`hetplan explain p.joblib` said 'not UTF-8 text (byte 0x80 at offset 0)'."""
    from predictor.predictor import default_predictor, save_predictor

    saved = tmp_path / "p.joblib"
    save_predictor(default_predictor(), saved)
    with pytest.raises(
        SpecError, match=r"p\.joblib: expected YAML or JSON text, got a predictor \(from hetplan fit\)$"
    ):
        load_cluster(saved)
    with pytest.raises(SpecError, match=r"got a predictor"):
        load_plan(saved)
