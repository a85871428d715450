"""Catalogs: the keys the docs promise, published parameter counts, and the FLOP formulas of the literature."""

from __future__ import annotations

from pathlib import Path

import pytest

from specs import ModelSpec, SpecError, device_catalog, get_device, load_model, model_catalog
from specs.catalog import load_catalog, read_catalog
from specs.units import GIB

DEVICE_KEYS = [
    "v100",
    "a100-40gb",
    "a100-80gb",
    "h100",
    "h200",
    "mi250x",
    "mi300x",
    "ascend-910b",
    "gaudi2",
    "l40s",
    "rtx4090",
    "t4",
    "cpu",
]
MODEL_KEYS = [
    "gpt3-1.7b",
    "gpt3-6.7b",
    "gpt3-13b",
    "gpt3-175b",
    "llama2-7b",
    "llama2-13b",
    "llama2-70b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "llama-140b",
    "qwen3-4b",
    "qwen3-32b",
]


def test_catalog_has_every_promised_key():
    assert set(DEVICE_KEYS) <= set(device_catalog())
    assert set(MODEL_KEYS) <= set(model_catalog())


def test_device_units_are_si():
    a100 = get_device("a100")
    assert a100.key == "a100-80gb"
    assert a100.peak_flops_per_s == 312e12
    assert a100.memory_bytes == 80 * GIB
    assert a100.hbm_bw_bytes_per_s == pytest.approx(2.039e12)
    assert get_device("MI250X").collective_library == "rccl"
    assert get_device("910b").collective_library == "hccl"


@pytest.mark.parametrize(
    ("key", "published_params"),
    [
        ("llama2-7b", 6.74e9),  # Hugging Face model card: 6,738,415,616
        ("llama2-13b", 13.0e9),
        ("llama2-70b", 68.98e9),
        ("llama3-8b", 8.03e9),
        ("llama3-70b", 70.6e9),
        ("llama3-405b", 405.9e9),
        ("gpt3-175b", 174.6e9),  # GPT-3 paper: 175.0B with a 50257 vocabulary
        ("gpt3-6.7b", 6.7e9),
        ("gpt3-13b", 13.0e9),
        ("gpt3-1.7b", 1.7e9),
        ("llama-140b", 140e9),
        ("qwen3-4b", 4.0e9),  # Hugging Face model card (heads of 128 at hidden 2560)
        ("qwen3-32b", 32.8e9),
    ],
)
def test_parameter_counts_match_publications(key, published_params):
    assert load_model(key).total_params() == pytest.approx(published_params, rel=0.03)


def test_llama2_7b_parameter_count_is_exact():
    assert load_model("llama2-7b").total_params() == 6_738_415_616


@pytest.mark.parametrize("key", ["gpt3-175b", "gpt3-13b", "gpt3-1.7b"])
def test_gpt_model_flops_equal_narayanan_formula(key):
    """Megatron (Narayanan et al. 2021): 72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)) model FLOPs per iteration."""
    model = load_model(key)
    s, h, layers, vocab, batch = model.seq_length, model.hidden_size, model.num_layers, model.vocab_size, 1536
    expected = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * layers * h))
    assert model.model_flops_per_sequence(s) * batch == pytest.approx(expected, rel=1e-12)


def test_activation_elements_follow_korthikanti_without_dropout():
    """GPT, flash attention, no dropout: 32*s*b*h bytes per layer (Korthikanti's 34 less the two dropout masks'
    2*s*b*h; the 5as/h score term is gone with flash attention)."""
    model = load_model("gpt3-175b")
    replicated, sharded = model.layer_activation_elements_per_token("none")
    assert 2 * (replicated + sharded) == 32 * model.hidden_size
    full_replicated, full_sharded = model.layer_activation_elements_per_token("full")
    assert (full_replicated, full_sharded) == (model.hidden_size, 0.0)


# ---- the one catalog loader (specs/catalog.py) ------------------------------------------------------------------
def _catalog_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text, encoding="utf-8")
    return path


TINY = "  num_layers: 2\n  hidden_size: 64\n  ffn_hidden_size: 256\n  num_attention_heads: 4\n  num_kv_heads: 4\n"
TINY += "  vocab_size: 100\n  seq_length: 32\n  mlp: gelu\n"


def test_a_catalog_is_read_once_and_answers_to_keys_and_aliases():
    models = load_catalog("models.yaml", ModelSpec, "model")
    assert load_catalog("models.yaml", ModelSpec, "model") is models
    assert models.entries is model_catalog()
    assert models.find(" Hethub-140B") is load_model("llama-140b") is models.entries["llama-140b"]
    assert models.find("llama-141b") is None


@pytest.mark.parametrize(
    ("text", "field", "expected"),
    [
        ("tiny:\n" + TINY.replace("hidden_size: 64", "hidden_size: wide"), "tiny.hidden_size", "expected an integer"),
        ("tiny:\n" + TINY.replace("  mlp: gelu\n", ""), "tiny.mlp", "required field is missing"),
        ("tiny:\n" + TINY + "  heads: 4\n", "tiny.heads", "unknown field"),
        ("tiny:\n  key: tiny\n" + TINY, "tiny.key", "remove this field"),
        ("tiny: [1, 2]\n", "tiny", "expected the model's fields (a mapping), got list"),
        ("Tiny:\n" + TINY, "Tiny", "lower case"),
        ("tiny:\n  aliases: [small]\n" + TINY + "small:\n" + TINY, "small", "'small' already names 'tiny'"),
        ("tiny:\n" + TINY + "other:\n  aliases: [tiny]\n" + TINY, "other.aliases[0]", "exactly one model"),
    ],
)
def test_a_bad_catalog_entry_names_the_file_and_the_field(tmp_path, text, field, expected):
    path = _catalog_file(tmp_path, text)
    with pytest.raises(SpecError) as err:
        read_catalog(path, ModelSpec, "model")
    message = str(err.value)
    assert message.startswith(f"{path}: {field}: ") and expected in message and "\n" not in message


def test_a_good_catalog_file_loads_in_file_order(tmp_path):
    path = _catalog_file(tmp_path, "b:\n  aliases: [bee]\n" + TINY + "a:\n" + TINY)
    catalog = read_catalog(path, ModelSpec, "model")
    assert list(catalog.entries) == ["b", "a"] and catalog.get("BEE", "x", "y").key == "b"
    with pytest.raises(SpecError, match=r"^x: y: unknown model 'c'; expected one of: b, a$"):
        catalog.get("c", "x", "y")


def test_an_unknown_device_lists_the_catalog():
    with pytest.raises(
        SpecError, match=r"^c\.yaml: groups\[0\]\.device: unknown device 'v1000'; expected one of: v100, "
    ):
        get_device("v1000", "c.yaml", "groups[0].device")
