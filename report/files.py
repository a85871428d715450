"""Files the commands write besides plans and profiles (which save themselves): JSON bodies (link profiles, run
records) and export directories, each file written whole or not at all (temporary file + rename)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specs.outputs import write_text_atomic

if TYPE_CHECKING:
    from planner.export import Export


def write_json(path: Path, body: Any) -> None:
    """`body` as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(body, indent=2) + "\n")


def write_export(exported: Export, summary: Mapping[str, Any], out: Path) -> None:
    """The engine's files, `launch.sh` (executable) and `export.json` (the summary) into the directory `out`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, content in exported.files.items():
        write_text_atomic(out / name, content)
    (out / "launch.sh").chmod(0o755)
    write_json(out / "export.json", summary)
