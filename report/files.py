"""Files the commands write besides plans and profiles (which save themselves): JSON bodies (link profiles, run
records) and export directories, each file written whole or not at all (temporary file + rename)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specs.errors import SpecError
from specs.loading import file_sha256, read_mapping
from specs.outputs import write_text_atomic

if TYPE_CHECKING:
    from planner.export import Export


def write_json(path: Path, body: Any) -> None:
    """`body` as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(body, indent=2) + "\n")


def write_export(exported: Export, summary: Mapping[str, Any], out: Path) -> list[str]:
    """The engine's files, `launch.sh` (executable) and `export.json` (the summary) into the directory `out`; the
    files an earlier export there wrote that this one does not (another engine's: deepspeed's ds_config.json beside
    megatron's launch.sh) are removed once it is written. Returns their names."""
    stale = stale_export_files(out, exported)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in exported.files.items():
        write_text_atomic(out / name, content)
    (out / "launch.sh").chmod(0o755)
    write_json(out / "export.json", summary)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    return stale


def stale_export_files(out: Path, exported: Export) -> list[str]:
    """The files that the export recorded in `out`/export.json wrote and `exported` does not write, each as that
    export wrote it (the SHA-256 it recorded). One changed since, or from a hetplan that recorded no hashes, may be
    the user's work: the export is refused, naming it, rather than leave two engines' files mixed or delete it."""
    try:
        earlier = read_mapping(out / "export.json")
    except SpecError:  # no export there (or no file hetplan can read): nothing there is known to be hetplan's
        return []
    names = earlier.get("files") if isinstance(earlier.get("files"), list) else []
    hashes = earlier.get("files_sha256") if isinstance(earlier.get("files_sha256"), dict) else {}
    plain = [name for name in names if isinstance(name, str) and name == Path(name).name]  # none outside `out`
    stale = [name for name in plain if name not in exported.files and (out / name).is_file()]
    changed = [name for name in stale if hashes.get(name) != file_sha256(out / name)]
    if changed:
        engine = earlier.get("format") or "hetplan"
        it, is_ = ("them", "are") if len(changed) > 1 else ("it", "is")
        raise SpecError("--out", str(out), f"{', '.join(changed)} {is_} the earlier {engine} export's, changed since "
                        f"(or not recorded as written), and {exported.format}'s files would sit beside {it}: move {it} "
                        "away, or choose another --out")  # fmt: skip
    return stale
