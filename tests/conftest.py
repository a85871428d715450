"""Shared fixtures: example files and a fake layer-cost source with hand-checkable numbers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from profiler.profile import LayerCost, LayerKind
from specs.model import Recompute

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
ONE_T4_NODE = """
name: one-t4-node
groups:
  - {name: t4, device: t4, nodes: 1, devices_per_node: 4, nics_per_node: 1, nic_gbps: 25}
network: {topology: clos, inter_group_gbps: 25}
"""


@dataclass(frozen=True)
class FixedCosts:
    """Layer costs that are simple numbers, so expected times can be computed by hand."""

    decoder_s: float = 1.0
    embedding_s: float = 0.0
    lm_head_s: float = 0.0
    activation_bytes: float = 0.0

    @property
    def identity(self) -> str:
        return "fixed test costs"

    def layer_cost(self, layer: LayerKind, micro_batch_size: int, tp: int, recompute: Recompute) -> LayerCost:
        total = {"decoder": self.decoder_s, "embedding": self.embedding_s, "lm_head": self.lm_head_s}[layer]
        activation = self.activation_bytes if layer == "decoder" else 0.0
        return LayerCost(total / 3, 2 * total / 3, activation * micro_batch_size)


@pytest.fixture
def write(tmp_path: Path):
    """Write text to a file in the test's temporary directory and return its path."""

    def _write(name: str, text: str) -> Path:
        path = tmp_path / name
        path.write_text(text, encoding="utf-8")
        return path

    return _write
