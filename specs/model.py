"""Transformer shapes (ModelSpec), the model catalog, Hugging Face config import, and shape formulas.

Formulas (DESIGN.md, "Cost-model facts"): dense decoder layer forward GEMM FLOPs per sequence of length s
are 2*s*(2*h*a*d + 2*h*g*d + k*h*f), k=3 for SwiGLU and 2 for GELU, plus attention 4*s*s*a*d (model FLOPs;
causal flash kernels execute half of it), with a heads of width d (a*d = h but where a model gives its head_dim:
Qwen3-4B has 32 heads of 128 at h 2560) and g kv heads. Backward is 2x forward. For GPT (f=4h, g=a, a*d=h) a layer
is 24*s*h^2 + 4*s^2*h, and model FLOPs per iteration reproduce Narayanan et al. 2021:
72*B*s*l*h^2*(1 + s/(6h) + V/(12*l*h)).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from numbers import Integral
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from specs.catalog import Catalog, load_catalog
from specs.errors import SpecError, also_wrong, expect_argument
from specs.loading import (
    HF_CONFIG,
    MODEL_FILE,
    CheckedModel,
    PositiveInt,
    StrictBool,
    check_file_kind,
    file_kind,
    quote,
    read_mapping,
    validate,
)

if TYPE_CHECKING:  # (specs.training imports this module)
    from specs.training import TrainingSpec

Recompute = Literal["none", "selective", "full"]
RECOMPUTE_MODES: tuple[Recompute, ...] = ("none", "selective", "full")
# what a whole model's costs depend on (a profile's layer shape is profiler.profiles.SHAPE_FIELDS)
MODEL_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "seq_length",
    "mlp",
    "tied_embeddings",
)
# a translated config.json's ModelSpec.source: "translated from the Hugging Face config PATH" (the catalog's sources
# cite "Hugging Face config.json" among others, and name no file of this machine)
HF_SOURCE = "translated from the Hugging Face config "
HEAD_DIM_HINT = " (or give the model's head_dim)"  # (not for GPT-2: its config.json has none)
NO_HEAD_DIM = "no head_dim (heads of hidden_size / num_attention_heads)"  # a shape without one, as a message says it
# config.json's names of the fields, as its errors say them
LLAMA_NAMES = {"num_layers": "num_hidden_layers", "ffn_hidden_size": "intermediate_size",
               "seq_length": "max_position_embeddings", "tied_embeddings": "tie_word_embeddings"}  # fmt: skip
GPT2_NAMES = {"num_layers": "n_layer", "hidden_size": "n_embd", "ffn_hidden_size": "n_inner",
              "num_attention_heads": "n_head", "num_kv_heads": "n_head", "seq_length": "n_positions",
              "tied_embeddings": "tie_word_embeddings"}  # fmt: skip
# a config.json key this close to a field read and missing is taken as its misspelling (difflib's ratio:
# tie_word_embedding for tie_word_embeddings 0.97, kv_head_dim for head_dim 0.84)
CONFIG_MISSPELLING_CUTOFF = 0.9
# the config.json keys the translation reads
GPT2_READ = ("n_layer", "n_embd", "n_inner", "n_head", "vocab_size", "n_positions", "tie_word_embeddings")
LLAMA_READ = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
              "head_dim", "vocab_size", "max_position_embeddings", "tie_word_embeddings", "hidden_act")  # fmt: skip
# the Hugging Face config.json `model_type`s translated: Llama-style ones and GPT-2
HF_MODEL_TYPES = ("llama", "mistral", "qwen", "qwen2", "qwen3", "internlm2", "yi", "baichuan", "gpt2")


class ModelSpec(CheckedModel):
    """A dense decoder-only transformer."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str = "custom"
    aliases: tuple[str, ...] = ()
    name: str = ""
    source: str = ""
    # integers as the other files' (not "8", 8.0 or true): a quoted YAML number was taken as one
    num_layers: PositiveInt
    hidden_size: PositiveInt
    ffn_hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    # the width of one attention head where it is not hidden_size / num_attention_heads (Qwen3-4B: 32 heads of 128
    # at hidden 2560); left out of the spec's files where it is (a value equal to it is dropped)
    head_dim: PositiveInt | None = Field(default=None, exclude_if=lambda value: value is None)
    vocab_size: PositiveInt
    seq_length: PositiveInt
    mlp: Literal["gelu", "swiglu"]
    tied_embeddings: StrictBool = False

    @model_validator(mode="before")
    @classmethod
    def _drop_plain_head_dim(cls, data: Any) -> Any:
        """A head_dim of hidden_size / num_attention_heads is the default written out (Qwen3-8B's config gives
        128 = 4096 / 32): one shape, one spec, whichever way a file says it."""
        if not isinstance(data, dict) or given_head_dim(data) is not None:
            return data
        return {key: value for key, value in data.items() if key != "head_dim"}

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_attention_heads {self.num_attention_heads}"
                + HEAD_DIM_HINT
            )
        if self.mlp == "swiglu" and self.head_size % 2:  # rotary positions turn pairs of a head's elements
            given = (
                f"head_dim {self.head_dim}" if self.head_dim else f"hidden_size / num_attention_heads, {self.head_size}"
            )
            raise ValueError(f"{given}: expected an even head size (a Llama-style model's rotary positions turn pairs)")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        return self

    # ---- shapes -------------------------------------------------------------------------------------------
    def splits_for_tp(self, tp: int) -> bool:
        """Whether TP `tp` splits the layer: its kv heads and its ffn."""
        return self.num_kv_heads % tp == 0 and self.ffn_hidden_size % tp == 0

    def unsplit_by_tp(self, tp: int) -> str:
        """What TP `tp` cannot split into equal parts ("the 8 kv heads", "FFN 9728", or both with "nor"); "" where it
        splits the layer (a message named both where one split: TP 16 splits qwen3-4b's FFN 9728)."""
        parts = [f"the {self.num_kv_heads} kv heads"] if self.num_kv_heads % tp else []
        parts += [f"FFN {self.ffn_hidden_size}"] if self.ffn_hidden_size % tp else []
        return " nor ".join(parts)

    def check_tp_degrees(self, degrees: Iterable[int], flag: str = "--tp") -> None:
        """Each TP degree (of a profile to measure or simulate) splits the layer, or a one-line error."""
        for tp in degrees:
            if not self.splits_for_tp(tp):
                raise SpecError(flag, "", f"{tp} must divide the model's {self.num_kv_heads} kv heads and ffn size")

    @property
    def shape(self) -> tuple[object, ...]:
        """What the model's costs depend on, its names and references aside (a plan file records no catalog model's
        aliases nor source: a loaded plan's model equals the catalog's in shape, not in every field)."""
        return tuple(getattr(self, name) for name in MODEL_SHAPE_FIELDS)

    @property
    def head_size(self) -> int:
        """The width of one attention head: head_dim, else hidden_size / num_attention_heads."""
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of Q (and of the attention output): heads x head size (hidden_size but for a given head_dim)."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of K (and of V): kv heads x head size."""
        return self.num_kv_heads * self.head_size

    @property
    def mlp_gemm_count(self) -> int:
        """k in the FLOP formula: SwiGLU has gate, up and down projections; GELU has two."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def has_biases(self) -> bool:
        """GPT-style layers carry biases and LayerNorm shifts; Llama-style layers do not."""
        return self.mlp == "gelu"

    @property
    def learned_positions(self) -> bool:
        """GPT-style models learn an embedding for each position up to their seq_length, so they train no longer
        sequences; Llama-style models rotate (RoPE) and have no such table."""
        return self.mlp == "gelu"

    def max_tp(self) -> int:
        """Tensor parallelism splits heads: the degree must divide the kv heads."""
        return self.num_kv_heads

    # ---- parameters ---------------------------------------------------------------------------------------
    def layer_params(self) -> int:
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size
        weights = 2 * h * q + 2 * h * kv + self.mlp_gemm_count * h * f
        if self.has_biases:
            return weights + (q + 2 * kv) + h + f + h + 4 * h  # qkv, out, fc1, fc2 biases; two LayerNorms
        return weights + 2 * h  # two RMSNorm scales

    def embedding_params(self) -> int:
        positions = self.seq_length * self.hidden_size if self.learned_positions else 0
        return self.vocab_size * self.hidden_size + positions

    def lm_head_params(self) -> int:
        """Final norm plus the output projection (zero extra when tied to the embedding)."""
        norm = 2 * self.hidden_size if self.has_biases else self.hidden_size
        return norm + (0 if self.tied_embeddings else self.vocab_size * self.hidden_size)

    def total_params(self) -> int:
        return self.num_layers * self.layer_params() + self.embedding_params() + self.lm_head_params()

    # ---- FLOPs --------------------------------------------------------------------------------------------
    def layer_gemm_flops(self, tokens: int) -> float:
        """Forward GEMM FLOPs of one layer for `tokens` tokens."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size
        return 2.0 * tokens * (2 * h * q + 2 * h * kv + self.mlp_gemm_count * h * f)

    def layer_attention_flops(self, micro_batch_size: int, seq_length: int, causal_kernel: bool = False) -> float:
        """Forward QK^T and AV FLOPs: 4*b*s^2*(heads x head size); a causal kernel computes half."""
        flops = 4.0 * micro_batch_size * seq_length * seq_length * self.q_size
        return flops / 2 if causal_kernel else flops

    def layer_elementwise_elements(self, tokens: int, tp: int, sequence_parallel: bool = True) -> float:
        """Elements the forward's memory-bound ops (norms, residuals, rotary, MLP activation) read and write once
        each, for one layer shard: norms and residuals are split by TP only under sequence parallelism."""
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size
        sp_tp = tp if sequence_parallel else 1
        activation = (3 * f if self.mlp == "swiglu" else 2 * f) / tp
        return tokens * (6 * h / sp_tp + 2 * (q + kv) / tp + activation)

    def lm_head_flops(self, tokens: int) -> float:
        return 2.0 * tokens * self.hidden_size * self.vocab_size

    def model_flops_per_sequence(self, seq_length: int) -> float:
        """Model FLOPs (forward + backward, no recompute) for one sequence: the numerator of MFU."""
        forward = self.num_layers * (
            self.layer_gemm_flops(seq_length) + self.layer_attention_flops(1, seq_length)
        ) + self.lm_head_flops(seq_length)
        return 3.0 * forward

    # ---- activations ---------------------------------------------------------------------------------------
    def layer_activation_elements_per_token(self, recompute: Recompute) -> tuple[float, float]:
        """Elements saved for backward per token per layer as (replicated, head/ffn-sharded) across TP ranks.

        With flash/SDPA attention (no s^2 score matrix, Korthikanti et al. 2022's 5as/h term dropped) and no
        dropout. Replicated tensors are split by TP only under sequence parallelism.
          none:      layer input, QKV input, Q/K/V, attention output, post-attention residual, MLP input,
                     MLP intermediates (SwiGLU: gate, up, silu(gate), product; GELU: fc1 out, gelu out)
          selective: recompute norms, core attention and the MLP activation: keep layer input, Q/K/V,
                     post-attention residual and the MLP up-projection outputs
          full:      keep only the layer input and recompute the whole layer
        The profiler measures these with saved-tensor hooks; this is the analytic fallback.
        """
        h, f, q, kv = self.hidden_size, self.ffn_hidden_size, self.q_size, self.kv_size
        if recompute == "full":
            return float(h), 0.0
        if recompute == "selective":
            return 2.0 * h, float(q + 2 * kv + (2 * f if self.mlp == "swiglu" else f))
        intermediates = 4 * f if self.mlp == "swiglu" else 2 * f
        return 4.0 * h, float(q + 2 * kv + q + intermediates)


def given_head_dim(shape: Mapping[str, Any]) -> Any:
    """A shape's head_dim where it is its own, None where it is left out or is hidden_size / num_attention_heads
    (as ModelSpec reads it: a profile or plan written either way is the same shape)."""
    head_dim, hidden, heads = shape.get("head_dim"), shape.get("hidden_size"), shape.get("num_attention_heads")
    whole = all(isinstance(value, Integral) and not isinstance(value, bool) and value > 0
                for value in (head_dim, hidden, heads))  # fmt: skip
    return None if whole and head_dim * heads == hidden else head_dim


def _hf_model_type(data: dict[str, Any], source: str) -> str:
    """A Hugging Face config's `model_type`, one that hetplan translates (lower case)."""
    types = f"{', '.join(HF_MODEL_TYPES[:-1])} or {HF_MODEL_TYPES[-1]}"
    expected = f"a Llama, Mistral, Qwen or GPT-2 config.json (model_type {types})"
    if "model_type" not in data:  # it read "got ''", as if the file said so
        raise SpecError(source, "model_type", f"required field is missing: expected {expected}")
    model_type = str(data["model_type"]).lower()
    if model_type not in HF_MODEL_TYPES:  # (gemma2, qwen3_moe: a newcomer was left with no way on)
        raise SpecError(
            source,
            "model_type",
            f"expected {expected}, got {quote(data['model_type'])}: a dense decoder of another type can be written as "
            "a hetplan model file (num_layers, hidden_size, ffn_hidden_size, num_attention_heads, num_kv_heads, "
            "head_dim, vocab_size, seq_length, mlp)",
        )
    return model_type


def _model_from_hf_config(data: dict[str, Any], source: str, stem: str) -> ModelSpec:
    """Translate a Hugging Face config.json (Llama/Mistral/Qwen-style or GPT-2) into a ModelSpec."""
    model_type = _hf_model_type(data, source)
    _check_misspellings(data, GPT2_READ if model_type == "gpt2" else LLAMA_READ, source)

    def need(field: str) -> Any:
        if field not in data:
            raise SpecError(source, field, f"required by a {model_type} config.json")
        return data[field]

    if model_type == "gpt2":
        hidden = int(need("n_embd"))
        names: Mapping[str, str] = GPT2_NAMES
        fields: dict[str, Any] = {
            "num_layers": need("n_layer"),
            "hidden_size": hidden,
            "ffn_hidden_size": data.get("n_inner") or 4 * hidden,
            "num_attention_heads": need("n_head"),
            "num_kv_heads": need("n_head"),
            "vocab_size": need("vocab_size"),
            "seq_length": data.get("n_positions", 1024),
            "mlp": "gelu",
            "tied_embeddings": data.get("tie_word_embeddings", True),  # GPT-2's default
        }
    else:  # Llama-style: SwiGLU, RMSNorm, rotary positions
        act = str(data.get("hidden_act", "silu")).lower()
        if act not in ("silu", "swish"):
            raise SpecError(source, "hidden_act", f"expected 'silu' (SwiGLU) for a {model_type} config, got {act!r}")
        heads = need("num_attention_heads")
        names = {
            **LLAMA_NAMES,
            "num_kv_heads": "num_key_value_heads" if "num_key_value_heads" in data else "num_attention_heads",
        }
        fields = {
            "num_layers": need("num_hidden_layers"),
            "hidden_size": need("hidden_size"),
            "ffn_hidden_size": need("intermediate_size"),
            "num_attention_heads": heads,
            "num_kv_heads": data.get("num_key_value_heads") or heads,
            "head_dim": data.get("head_dim"),  # Qwen3's 128 beside hidden 2560 / 32 heads
            "vocab_size": need("vocab_size"),
            "seq_length": data.get("max_position_embeddings", 4096),
            "mlp": "swiglu",
            "tied_embeddings": data.get("tie_word_embeddings", False),  # ("false" is no boolean: refused, not true)
        }
    fields.update(key=stem, name=stem, source=f"{HF_SOURCE}{source}")
    try:
        return validate(ModelSpec, fields, source)
    except SpecError as err:  # it named hetplan's fields (num_layers for num_hidden_layers)
        if model_type == "gpt2":
            err = SpecError(err.source, err.field, err.expectation.replace(HEAD_DIM_HINT, ""))
        raise _in_config_names(err, names) from None


def _check_misspellings(data: Mapping[str, Any], read: Iterable[str], source: str) -> None:
    """A key of the config.json that misspells one the translation reads and the file lacks (`tie_word_embedding`),
    refused in one line: Hugging Face ignores it and takes the default, so the model would silently be another."""
    absent = sorted(set(read) - set(data))
    for key in (key for key in data if isinstance(key, str)):  # (JSON's keys are; a mapping's need not be)
        close = difflib.get_close_matches(key, absent, n=1, cutoff=CONFIG_MISSPELLING_CUTOFF)
        if close:
            raise SpecError(
                source, key, f"not a field of the config.json: did you mean {close[0]}? (Hugging Face ignores it)"
            )


def _in_config_names(err: SpecError, names: Mapping[str, str]) -> SpecError:
    """A ModelSpec error in the config.json's own field names; a field named twice so (num_kv_heads is the
    config's num_attention_heads where it gives no num_key_value_heads) is named once."""
    pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")

    def renamed(text: str) -> str:
        return pattern.sub(lambda match: names[match[1]], text)

    field, expectation = renamed(err.field), renamed(err.expectation)
    listed = re.search(r" \(also wrong: ([^()]*)\)$", expectation)
    if listed and " more" not in listed[1]:
        others = [name for name in dict.fromkeys(listed[1].split(", ")) if name != field]
        expectation = expectation[: listed.start()] + also_wrong(others)
    return SpecError(err.source, field, expectation)


def hf_sequence_note(model: ModelSpec, training: TrainingSpec) -> str:
    """What a plan says when a Hugging Face config's longest context is its sequence (a config gives no training
    length): a newcomer's plan trained a Qwen2 config at 32768 tokens, context-parallel 8, without a word."""
    if training.seq_length is not None or not model.source.startswith(HF_SOURCE):
        return ""
    config = model.source.removeprefix(HF_SOURCE)
    longest = "n_positions, else 1024" if model.mlp == "gelu" else "max_position_embeddings, else 4096"  # (GPT-2's)
    return (
        f"note: sequences of {model.seq_length} tokens, the longest context of {config} ({longest}): a config.json "
        "gives no training length; set seq_length in the training file or --seq-len"
    )


def hf_unmodelled_note(model: ModelSpec, seq_length: int | None = None) -> str:
    """What a Hugging Face config sets that hetplan does not model, or "": the costs, the runtime's model and the
    exports' arguments are of the model without it (a newcomer's Mistral was costed with full attention over 32768
    tokens where its config slides a window of 4096, without a word). The config is read again from its path;
    `seq_length`: the training's (a window as long as the sequences changes nothing), else the model's."""
    if not model.source.startswith(HF_SOURCE):
        return ""
    path = model.source.removeprefix(HF_SOURCE)
    try:
        data = read_mapping(Path(path))
    except (SpecError, OSError):
        return ""
    model_type = str(data.get("model_type", "")).lower()
    unmodelled = []
    if model_type == "qwen2" or data.get("attention_bias") is True:  # Qwen2's attention has them, Llama's may
        unmodelled.append("Q/K/V biases")
    if model_type == "qwen3":
        unmodelled.append("per-head Q/K norms")
    window = data.get("sliding_window")
    if isinstance(window, int) and data.get("use_sliding_window", True) and window < (seq_length or model.seq_length):
        unmodelled.append(f"a sliding attention window of {window} tokens (attention costed over whole sequences)")
    if isinstance(data.get("rope_scaling"), Mapping):
        kind = data["rope_scaling"].get("rope_type") or data["rope_scaling"].get("type") or "?"
        unmodelled.append(f"RoPE scaling ({kind})")
    megatron_defaults = {"rope_theta": 10000, "rms_norm_eps": 1e-5}
    numbers = {key: data[key] for key in megatron_defaults if type(data.get(key)) in (int, float)}  # (not a bool)
    given = [f"{key} {value:.10g}" for key, value in numbers.items() if value != megatron_defaults[key]]
    if given:
        unmodelled.append(f"{' and '.join(given)} (no cost; the exports leave Megatron's 10000 and 1e-5: add them)")
    if not unmodelled:
        return ""
    return f"note: {path} sets what hetplan does not model: {'; '.join(unmodelled)}"


def _models() -> Catalog[ModelSpec]:
    return load_catalog("models.yaml", ModelSpec, "model")


def model_catalog() -> dict[str, ModelSpec]:
    """All catalog models by key."""
    return _models().entries


def load_model(
    name_or_path: str | Path | Mapping[str, Any], source: str = "load_model()", field: str = ""
) -> ModelSpec:
    """A catalog key or alias, a model YAML/JSON file, a Hugging Face config.json, or the mapping such a file holds
    (a launcher's own dict: its key and name default to 'model'). An unknown name is an error naming `source` and
    `field` (the CLI's flag, a run record's field)."""
    if isinstance(name_or_path, Mapping):
        return _model_from_mapping(dict(name_or_path), "model mapping", "model")
    taken = "a catalog name, a path of a model YAML/JSON or config.json, or its mapping"
    expect_argument(name_or_path, (str, Path), source, field or "name_or_path", taken)
    found = _models().find(str(name_or_path))
    if found is not None:
        return found
    path = Path(name_or_path)
    if not path.exists() and path.suffix.lower() not in (".yaml", ".yml", ".json"):
        known = ", ".join(model_catalog())
        raise SpecError(source, field, f"unknown model {name_or_path!r}; expected a file or one of: {known}")
    if path.is_dir() and (path / "config.json").is_file():  # a Hugging Face checkpoint's directory, as HF reads it
        path = path / "config.json"
    checkpoint = path.resolve().parent.name if path.stem == "config" else path.stem  # a HF checkpoint's directory
    return _model_from_mapping(read_mapping(path), str(path), path.stem, checkpoint)


def _model_from_mapping(data: dict[str, Any], source: str, named: str, checkpoint: str = "") -> ModelSpec:
    """A model file's mapping (hetplan's fields, or a Hugging Face config's), named `named` where it names nothing
    (a Hugging Face config: `checkpoint`, when given)."""
    if file_kind(data) == HF_CONFIG:
        return _model_from_hf_config(data, source, checkpoint or named)
    check_file_kind(data, source, f"{MODEL_FILE} (num_layers, hidden_size, ...) or {HF_CONFIG}", (MODEL_FILE,))
    data.setdefault("key", named)
    data.setdefault("name", named)
    return validate(ModelSpec, data, source)
