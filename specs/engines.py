"""The engine registry (specs/catalog/engines.yaml): what each training engine can express of a plan, as data that
exports and a planner restricted to one engine read without importing the exporters (planner/export.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, model_validator

from specs.catalog import Catalog, load_catalog


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

    @model_validator(mode="after")
    def _tp_per_stage_needs_tp(self) -> Engine:
        if self.per_stage_tp and not self.tensor_parallel:
            raise ValueError("per_stage_tp needs tensor_parallel")
        return self


def _engines() -> Catalog[Engine]:
    return load_catalog("engines.yaml", Engine, "engine")


def engine_catalog() -> dict[str, Engine]:
    """All engines by export format, in the order the CLI lists them."""
    return _engines().entries


def get_engine(name: str, source: str = "--format", field: str = "") -> Engine:
    """The engine a format names; an unknown one is a one-line SpecError listing the known engines."""
    return _engines().get(name, source, field)
