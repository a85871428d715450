"""Shared test helpers: example files, the CLI in a fresh interpreter, and a fake layer-cost source with
hand-checkable numbers."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest

from profiler.profile import LayerCost, LayerKind
from specs.model import Recompute

ROOT = Path(__file__).resolve().parent.parent
# the shipped predictor's cache goes to a directory of this test session (inherited by the CLI subprocesses and
# the xdist workers), removed when the process that made it exits
if "HETPLAN_CACHE_DIR" not in os.environ:
    os.environ["HETPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hetplan-test-cache-")
    atexit.register(shutil.rmtree, os.environ["HETPLAN_CACHE_DIR"], ignore_errors=True)
EXAMPLES = ROOT / "examples"
ONE_T4_NODE = """
name: one-t4-node
groups:
  - {name: t4, device: t4, nodes: 1, devices_per_node: 4, nics_per_node: 1, nic_gbps: 25}
network: {topology: clos, inter_group_gbps: 25}
"""

NO_TORCH = (
    "import sys\n"
    "class NoTorch:  # any `import torch` now raises ImportError, as on a machine without it\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name == 'torch' or name.startswith('torch.'):\n"
    "            raise ImportError('No module named torch')\n"
    "sys.meta_path.insert(0, NoTorch())\n"
    "import cli\n"
    "sys.argv = ['hetplan', *sys.argv[1:]]\n"
    "try:\n"
    "    cli.main()\n"
    "finally:\n"
    "    assert 'torch' not in sys.modules, 'torch was imported'\n"
)


def write_plan(out, cluster, model: str, global_batch: int) -> None:
    """`hetplan plan ... --out out` (fp16: the example clusters include V100s)."""
    args = ["--cluster", str(cluster), "--model", model, "--dtype", "fp16", "--global-batch", str(global_batch)]
    made = hetplan("plan", *args, "--out", str(out), "--json")
    assert made.returncode == 0, made.stderr


def hetplan(*args: str, torch_allowed: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a fresh interpreter; unless allowed, torch cannot be imported there."""
    command = ["-m", "cli"] if torch_allowed else ["-c", NO_TORCH]
    return subprocess.run([sys.executable, *command, *args], cwd=ROOT, capture_output=True, text=True, timeout=300)


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
