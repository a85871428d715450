"""Files the commands write besides plans and profiles (which save themselves): JSON bodies (link profiles, run
records) and export directories, each file written whole or not at all (temporary file + rename)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specs.errors import SpecError
from specs.loading import file_sha256, read_mapping, text_sha256
from specs.outputs import write_text_atomic

if TYPE_CHECKING:
    from planner.export import Export


def write_json(path: Path, body: Any) -> None:
    """`body` as indented JSON, atomically."""
    write_text_atomic(path, json.dumps(body, indent=2) + "\n")


def write_export(exported: Export, summary: Mapping[str, Any], out: Path) -> list[str]:
    """The engine's files, `launch.sh` (executable) and `export.json` (the summary) into the directory `out`; the
    files an earlier export there wrote that this one does not (another engine's: deepspeed's ds_config.json beside
    megatron's launch.sh) are removed once it is written. Returns their names. Nothing is written where a file would
    lose the user's work (`changed_by_user`)."""
    earlier = _earlier_export(out)
    kept = changed_by_user(out, exported, earlier)
    if kept:
        it, is_, was = ("them", "are", "were") if len(kept) > 1 else ("it", "is", "was")
        engine = earlier.get("format") or "hetplan"
        whose = (
            f"{is_} not as the earlier {engine} export wrote {it} (changed since, or not written by hetplan)"
            if earlier
            else f"{was} not written by a hetplan export (no export.json beside {it})"
        )
        raise SpecError("--out", str(out), f"{', '.join(kept)} {whose}, and {exported.format}'s export would overwrite "
                        f"or sit beside {it}: move {it} away, or choose another --out")  # fmt: skip
    stale = _earlier_files(out, exported, earlier)
    out.mkdir(parents=True, exist_ok=True)
    for name, content in exported.files.items():
        write_text_atomic(out / name, content)
    (out / "launch.sh").chmod(0o755)
    write_json(out / "export.json", summary)
    for name in stale:
        (out / name).unlink(missing_ok=True)
    return stale


def _earlier_export(out: Path) -> dict[str, Any]:
    """The export.json of an earlier export in `out` ({} when there is none hetplan can read)."""
    try:
        return read_mapping(out / "export.json")
    except SpecError:  # no export there (or no file hetplan can read): nothing there is known to be hetplan's
        return {}


def _earlier_files(out: Path, exported: Export, earlier: Mapping[str, Any]) -> list[str]:
    """The files the earlier export recorded and `exported` does not write that are still there (plain names only:
    none outside `out`)."""
    names = earlier.get("files") if isinstance(earlier.get("files"), list) else []
    plain = [name for name in names if isinstance(name, str) and name == Path(name).name]
    return [name for name in plain if name not in exported.files and (out / name).is_file()]


def changed_by_user(out: Path, exported: Export, earlier: Mapping[str, Any]) -> list[str]:
    """The files in `out` an export would overwrite or leave behind that are not as hetplan wrote them: one the
    earlier export recorded (its SHA-256 in export.json) and that changed since, or one it did not record at all (a
    user's own launch.sh, a hand-tuned ds_config.json of an export from a hetplan that recorded no hashes). A file
    already holding what the export writes loses nothing."""
    hashes = earlier.get("files_sha256") if isinstance(earlier.get("files_sha256"), dict) else {}
    overwritten = [
        name
        for name, content in exported.files.items()
        if (out / name).is_file() and file_sha256(out / name) not in (hashes.get(name), text_sha256(content))
    ]
    left = [name for name in _earlier_files(out, exported, earlier) if hashes.get(name) != file_sha256(out / name)]
    return sorted(overwritten + left)
