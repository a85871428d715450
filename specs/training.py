"""Training settings: batch, sequence, dtype and the strategy options the planner may choose from."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args

from pydantic import ConfigDict, Field, field_validator

from specs.errors import SpecError, expect_argument
from specs.loading import (
    TRAINING_FILE,
    CheckedModel,
    StrictFloat,
    StrictInt,
    check_file_kind,
    quote,
    read_mapping,
    validate,
)
from specs.model import RECOMPUTE_MODES, Recompute

if TYPE_CHECKING:
    from specs.cluster import DeviceGroup

Dtype = Literal["bf16", "fp16", "fp32", "fp8"]
# bytes of a stored weight, activation or transferred value; fp8 training (Transformer Engine) keeps them in bf16 and
# runs the GEMMs on fp8 copies
DTYPE_BYTES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp32": 4, "fp8": 2}
DEFAULT_GLOBAL_BATCH_SIZE = 1024
MAX_GLOBAL_BATCH = 2**20  # sequences: far past any published run (Llama 3: 2,048 of 8K tokens)
MAX_SEQ_LENGTH = 2**24  # tokens
MAX_CONTEXT_PARALLEL = 1024
# The CP degrees searched when the training does not choose: none below 16K tokens; above, powers of two that leave
# each rank at least 4K tokens (shorter blocks cannot hide the ring under their attention), at most 32.
AUTO_CONTEXT_PARALLEL_FROM_TOKENS = 16384
AUTO_LEAST_TOKENS_PER_CP_RANK = 4096
AUTO_MAX_CONTEXT_PARALLEL = 32
# the training frameworks whose kernel efficiency calibration tells apart (TrainingSpec.engine)
TrainingEngine = Literal["megatron", "deepspeed", "fsdp", "torchtitan", "other"]
TRAINING_ENGINES: tuple[str, ...] = get_args(TrainingEngine)


class TrainingSpec(CheckedModel):
    """What to train and which strategy choices are allowed; flags override file values."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    global_batch_size: StrictInt = Field(
        default=DEFAULT_GLOBAL_BATCH_SIZE, ge=1, le=MAX_GLOBAL_BATCH, description="sequences per iteration"
    )
    seq_length: StrictInt | None = Field(default=None, ge=1, le=MAX_SEQ_LENGTH, description="default: the model's")
    dtype: Dtype = "bf16"
    recompute: tuple[Recompute, ...] = RECOMPUTE_MODES
    zero_stage: Literal[0, 1, 2, 3] = Field(
        default=1,
        description="0: replicated optimizer; 1: optimizer state sharded over DP (Megatron's distributed optimizer); "
        "2: gradients too (reduce-scattered every micro-batch, DeepSpeed); 3: parameters too (all-gathered per layer "
        "in forward and backward, FSDP)",
    )
    zero_shard: Literal["dp", "node"] = Field(
        default="dp",
        description="where ZeRO 1-3 shard: over the whole DP group (dp), or over its ranks inside one node with the "
        "shards replicated across nodes (node: FSDP's hybrid shard, Megatron's --num-distributed-optimizer-instances;"
        " less memory saved, no weight gathers and only a 1/node-ranks gradient share over the network)",
    )
    micro_batch_sizes: tuple[StrictInt, ...] = (1, 2, 4, 8, 16)
    virtual_stages: tuple[StrictInt, ...] = Field(
        default=(1, 2, 4), description="interleaved 1F1B chunks per device the planner may use (1: plain 1F1B)"
    )
    sequence_parallel: bool = True
    context_parallel: tuple[StrictInt, ...] | None = Field(
        default=None,
        description="context-parallel degrees the planner may use (each replica's sequences split over that many "
        "ranks, K/V passed around a ring); default: by sequence length, 1 below 16K tokens, else the powers of two "
        "that leave every rank at least 4K tokens (at most 32)",
    )
    uneven_batch: Literal["off", "refine", "exhaustive"] = Field(
        default="off",
        description="replica counts that do not divide the global batch (replicas run whole micro-batches within one "
        "of each other; gradients weighted by share). off: even splits only (the default: fastest search); refine: "
        "around the best even candidates; exhaustive: wherever a group fits one more stage (exact, a longer search)",
    )
    families: Literal["off", "auto", "search"] = Field(
        default="auto",
        description="off: one pipeline family (every replica the same device mix); search: also split the groups "
        "into families, each with its own pipelines and a share of the batch, gradients weighted by share (every "
        "partition of the groups: seconds for 3-4 groups); auto: search when the cluster has two groups (one "
        "partition), off otherwise",
    )
    attention: Literal["flash", "materialized"] = Field(
        default="flash",
        description="flash: fused kernels (causal half of 4*b*s^2*h FLOPs, no score matrix); materialized: "
        "pre-2023 Megatron, the b*a*s^2 scores are written, soft-maxed and dropped out in memory",
    )
    # What the engine overlaps with compute. Defaults: what hetplan's exports switch on (Megatron itself defaults the
    # first two to off; say so here when the engine will run without them).
    overlap_grad_reduce: bool = Field(
        default=True, description="DP gradient reduction overlaps the backward it follows (bucketed)"
    )
    overlap_param_gather: bool = Field(
        default=True,
        description="ZeRO weight all-gathers overlap a forward: the next iteration's first (Megatron's distributed "
        "optimizer, ZeRO 1/2) or the layer's own, prefetched (ZeRO 3 / FSDP)",
    )
    tp_comm_overlap: bool = Field(
        default=False, description="TP collectives overlap the GEMMs (Transformer Engine userbuffers; off in Megatron)"
    )
    overlap_p2p_comm: bool = Field(
        default=True,
        description="interleaved schedules overlap pipeline sends with compute (Megatron's default; plain 1F1B "
        "always waits for them)",
    )
    engine: TrainingEngine = Field(
        default="megatron",
        description="the training framework whose kernels run the layers: calibration learns each framework's kernel "
        "efficiency relative to Megatron's fused kernels (megatron: Megatron-LM and its forks, e.g. ModelLink, "
        "FlagScale; deepspeed: DeepSpeed's pipeline engine; fsdp: PyTorch FSDP models such as llm-foundry's)",
    )
    fp32_matmul: Literal["ieee", "tf32"] = Field(
        default="ieee",
        description="fp32 training: matmuls in IEEE fp32 (PyTorch's default) or TF32/XF32 on devices that have it",
    )
    memory_reserve_fraction: StrictFloat = Field(
        default=0.08, ge=0, lt=1, description="device memory kept free for allocator fragmentation and workspaces"
    )

    @field_validator("uneven_batch", mode="before")
    @classmethod
    def _uneven_from_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "exhaustive" if value else "off"
        return value

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_not_bool(cls, value: Any) -> Any:
        if isinstance(value, bool):
            raise ValueError(f"expected 0, 1, 2 or 3, got {quote(value)}")
        return value

    @field_validator("recompute", mode="before")
    @classmethod
    def _recompute_list(cls, value: Any) -> Any:
        return (value,) if isinstance(value, str) else value

    @field_validator("recompute")
    @classmethod
    def _recompute_non_empty(cls, value: tuple[Recompute, ...]) -> tuple[Recompute, ...]:
        if not value:
            raise ValueError("allow at least one recompute mode (none, selective, full)")
        return tuple(mode for mode in RECOMPUTE_MODES if mode in value)

    @field_validator("context_parallel")
    @classmethod
    def _context_parallel_degrees(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is not None and (not value or any(d < 1 or d > MAX_CONTEXT_PARALLEL for d in value)):
            raise ValueError(f"expected a non-empty list of integers from 1 to {MAX_CONTEXT_PARALLEL}")
        return None if value is None else tuple(sorted(set(value)))

    def context_parallel_degrees(self, seq_length: int) -> tuple[int, ...]:
        """The CP degrees to search: the chosen ones, or by sequence length (see the field), of those the sequence
        splits into 2 x degree equal chunks for (causal load balance)."""
        if self.context_parallel is not None:
            return self.context_parallel
        if seq_length < AUTO_CONTEXT_PARALLEL_FROM_TOKENS:
            return (1,)
        degrees, degree = [], 1
        while degree <= AUTO_MAX_CONTEXT_PARALLEL and seq_length // degree >= AUTO_LEAST_TOKENS_PER_CP_RANK:
            if splits_for_context_parallel(seq_length, degree):
                degrees.append(degree)
            degree *= 2
        return tuple(degrees)

    def check_context_parallel(
        self, seq_length: int, source: str = "training", field: str = "context_parallel"
    ) -> None:
        """A chosen CP degree must cut the sequence into 2 x degree equal chunks (causal load balance: every rank
        holds chunks i and 2cp-1-i), as the runtime and every command that evaluates a plan require."""
        for degree in self.context_parallel or ():
            if not splits_for_context_parallel(seq_length, degree):
                raise SpecError(
                    source,
                    field,
                    f"context parallel {degree} cuts each sequence into 2 x {degree} equal chunks (causal load "
                    f"balance), which {seq_length} tokens do not make: choose degrees whose double divides it",
                )

    @field_validator("micro_batch_sizes", "virtual_stages")
    @classmethod
    def _positive_sizes(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if not value or any(size < 1 or size > MAX_GLOBAL_BATCH for size in value):
            raise ValueError(f"expected a non-empty list of integers from 1 to {MAX_GLOBAL_BATCH:,}")
        return tuple(sorted(set(value)))

    def check_micro_batches(self, source: str, field: str = "micro_batch_sizes") -> None:
        """The micro-batch sizes a search may use: one at most the global batch, else no plan can split it (the
        search said only that the batch must split into replicas x micro-batches). A given layout (predict's
        flags) uses its own micro-batch and none of these."""
        if min(self.micro_batch_sizes) > self.global_batch_size:
            raise SpecError(
                source, field, f"the micro-batch sizes {list(self.micro_batch_sizes)} are all larger than the global "
                f"batch ({self.global_batch_size} sequences), which no plan can then split: allow a micro-batch of at "
                "most the batch, or train a larger batch",
            )  # fmt: skip

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def load_training(
    path: str | Path | Mapping[str, Any] | None = None,
    overrides: Mapping[str, Any] | None = None,
    overrides_are: str = "overrides",
) -> TrainingSpec:
    """Read an optional training file (or the mapping such a file holds), then apply overrides (None values are
    ignored: not given). `overrides_are` what a message calls them: the CLI's are "flags" ("training flags: dtype"),
    a Python caller's "overrides" ("load_training(): overrides: dtype")."""
    if isinstance(path, Mapping):
        data, source = dict(path), "training mapping"
    else:
        if path is not None:
            taken = "a path of a training YAML/JSON file, its mapping, or None"
            expect_argument(path, (str, Path), "load_training()", "path", taken)
        data = read_mapping(Path(path)) if path is not None else {}
        source = str(path) if path is not None else f"training {overrides_are}"
        if path is None and overrides_are == "overrides":
            source = "load_training(): overrides"
    check_file_kind(data, source, f"{TRAINING_FILE} (global_batch_size, dtype, ...)", (TRAINING_FILE,))
    if overrides is not None:
        expect_argument(overrides, Mapping, "load_training()", "overrides", "a mapping of training fields to values")
    for field, value in (overrides or {}).items():
        if value is not None:
            data[field] = value
            source = f"{source} (with {overrides_are})" if overrides_are not in source else source
    return validate(TrainingSpec, data, source)


def splits_for_context_parallel(seq_length: int, cp: int) -> bool:
    """Whether a sequence cuts into the 2 x cp equal chunks of causal load balancing (every CP rank holds chunks i
    and 2cp-1-i); CP 1 cuts nothing."""
    return cp == 1 or seq_length % (2 * cp) == 0


def on_devices(
    training: TrainingSpec, vendors: set[str], without_bf16: Sequence[str] = (), without_fp8: Sequence[str] = ()
) -> tuple[TrainingSpec, str]:
    """The training's dtype on a cluster of these device `vendors`, unless the training file or a flag chose one:
    fp32 on only CPU devices (the runtime computes in fp32 there, and most CPUs have no fast 16-bit matmuls), fp16 where
    some devices have no bf16 (`without_bf16`: their keys), as mixed-precision training on them runs; the note says
    so ("" when nothing changed). FP8 chosen on devices without it (`without_fp8`) stays, with a note: their GEMMs run
    bf16 (DeviceSpec.runs_dtype), which a user asking for FP8 would not expect."""
    if training.dtype == "fp8" and without_fp8:
        has, its = ("has", "its") if len(without_fp8) == 1 else ("have", "their")
        return training, f"note: {', '.join(without_fp8)} {has} no FP8: {its} GEMMs run in bf16 (as predicted)"
    if "dtype" in training.model_fields_set:
        return training, ""
    if vendors == {"cpu"} and training.dtype != "fp32":
        dtype, why = "fp32", "on cpu devices (hetplan's runtime computes in fp32 there)"
    elif without_bf16 and training.dtype == "bf16":
        dtype, why = "fp16", f"({', '.join(without_bf16)} {'has' if len(without_bf16) == 1 else 'have'} no bf16)"
    else:
        return training, ""
    note = f"note: training in {dtype} {why}; set dtype or --dtype to choose"
    return TrainingSpec.model_validate({**training.model_dump(exclude_unset=True), "dtype": dtype}), note


def on_groups(training: TrainingSpec, groups: Sequence[DeviceGroup]) -> tuple[TrainingSpec, str]:
    """The training on these device groups (`on_devices` with their vendors and the devices lacking bf16 or FP8),
    and its note ("" when there is none): what `hetplan plan` and Python's plan() both train with."""
    without_bf16 = sorted({group.device.key for group in groups if not group.device.supports_bf16})
    without_fp8 = sorted({group.device.key for group in groups if group.device.peak_fp8_tflops is None})
    return on_devices(training, {group.device.vendor for group in groups}, without_bf16, without_fp8)
