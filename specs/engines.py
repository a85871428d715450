"""The engine registry (specs/catalog/engines.yaml): what each training engine can express of a plan, as data that
exports and a planner restricted to one engine read without importing the exporters (planner/export.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from specs.catalog import Catalog, load_catalog
from specs.model import RECOMPUTE_MODES, Recompute
from specs.training import TRAINING_ENGINES


class Engine(BaseModel):
    """A training engine: which parts of a hetplan plan it can run, and how torchrun starts it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    key: str  # the export format
    uneven_layers: bool  # stages with different numbers of layers
    tensor_parallel: bool  # tensor parallelism at all
    per_stage_tp: bool  # stages at different TP degrees
    uneven_batch: bool  # replicas with different numbers of micro-batches
    per_stage_recompute: bool  # a recompute mode per stage
    interleaving: bool  # interleaved 1F1B (virtual stages)
    mixed_vendors: bool  # one job over several vendors' collective libraries
    pipeline_families: bool  # several pipeline families in one job
    script: str  # what torchrun starts (the engine's training script, or "" for the user's own)
    zero_stages: tuple[int, ...]  # the ZeRO stages it runs with pipeline parallelism
    zero_note: str  # how it shards (what a stage it lacks becomes)
    fp8: bool  # an FP8 switch (Transformer-Engine-style FP8 GEMMs)
    fp16: bool  # fp16 mixed precision (without it an fp16 plan trains in fp32)
    context_parallel: bool  # sequences split over ranks (ring attention)
    hybrid_shard: bool  # ZeRO sharding inside a node, replicated across nodes
    kernels: str  # the training.engine whose kernel efficiency the cost model predicts ("": the training's)
    # interleaves micro-batches in groups of at least the pipeline's stages, so refuses fewer (Megatron); PyTorch's
    # interleaved schedules run them
    interleaving_groups_of_stages: bool = False
    # the recompute modes it can run (DeepSpeed's pipeline engine checkpoints whole layers or none: no selective)
    recompute_modes: tuple[Recompute, ...] = RECOMPUTE_MODES

    @model_validator(mode="after")
    def _consistent(self) -> Engine:
        if self.per_stage_tp and not self.tensor_parallel:
            raise ValueError("per_stage_tp needs tensor_parallel")
        if not self.zero_stages or not set(self.zero_stages) <= {0, 1, 2, 3}:
            raise ValueError("zero_stages: one or more of 0, 1, 2, 3")
        if not self.recompute_modes or "none" not in self.recompute_modes:
            raise ValueError("recompute_modes: none and any of selective, full")
        if self.kernels not in ("", *TRAINING_ENGINES):
            raise ValueError(f"kernels: one of {', '.join(TRAINING_ENGINES)}, or empty for the training's own")
        return self


def _engines() -> Catalog[Engine]:
    return load_catalog("engines.yaml", Engine, "engine")


def engine_catalog() -> dict[str, Engine]:
    """All engines by export format, in the order the CLI lists them."""
    return _engines().entries


def get_engine(name: str, source: str = "get_engine()", field: str = "name") -> Engine:
    """The engine a format names; an unknown one is a one-line SpecError listing the known engines."""
    return _engines().get(name, source, field)
