"""The one boundary for command-line flags, as specs/loading.py is for files: lists of integers, message sizes,
names from a known set, finite numbers, output files and training overrides, each problem a one-line SpecError
that names the flag and what was expected (and quotes at most QUOTE_CHARS characters of what was given)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specs.errors import SpecError
from specs.loading import QUOTE_CHARS, file_kind, read_mapping
from specs.outputs import check_no_file_above, check_writable
from specs.training import TrainingSpec, load_training

if TYPE_CHECKING:
    from specs.model import ModelSpec

SIZE_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
MAX_MESSAGE_BYTES = 16 * 2**30  # a collective's buffer beyond this is no benchmark a host can run
# training fields whose flag is not `--` + the field with dashes
TRAINING_FLAGS = {"global_batch_size": "--global-batch", "seq_length": "--seq-len"}


def _given(text: str) -> str:
    return repr(text[:QUOTE_CHARS])


def int_list(
    text: str | None, flag: str, low: int = 1, what: str = "integers", high: int | None = None, why: str = ""
) -> list[int] | None:
    """'1,2,4' -> [1, 2, 4], at least one, each once, at least `low` and at most `high` (`what` they are and `why`
    the bound, for the message); None stays None (the flag was not given)."""
    if text is None:
        return None
    try:  # every item an integer: '1,,4' is a slip, not 1 and 4
        values = [int(part) for part in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < low or (high is not None and max(values) > high):
        bounds = f">= {low}" if high is None else f"from {low} to {high}"
        raise SpecError(flag, "", f"expected {what} {bounds} (comma-separated{why}), got {_given(text)}")
    repeated = next((value for index, value in enumerate(values) if value in values[:index]), None)
    if repeated is not None:  # (a profile's second entry of one shape is refused later, by every command reading it)
        raise SpecError(flag, "", f"expected each value once, got {_given(text)} ({repeated} twice)")
    return values


def tp_degrees(text: str | None, model: ModelSpec, defaults: tuple[int, ...]) -> list[int]:
    """`--tp` of a profile: the degrees given (each must split the model's layer), or those of `defaults` that do."""
    if text is None:
        return [tp for tp in defaults if model.splits_for_tp(tp)]
    degrees = int_list(text, "--tp") or []
    model.check_tp_degrees(degrees)
    return degrees


def zero_stages(text: str | None) -> list[int]:
    """`--zero-stages 1,2,3` -> [1, 2, 3] (each 0-3); not given -> [] (the training's stage only)."""
    stages = int_list(text, "--zero-stages", low=0, what="ZeRO stages 0-3") or []
    if any(stage > 3 for stage in stages):
        raise SpecError("--zero-stages", "", f"expected ZeRO stages 0-3 (comma-separated), got {_given(text or '')}")
    return stages


def names(text: str) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']."""
    return [part.strip() for part in text.split(",") if part.strip()]


def choices(text: str, known: Iterable[str], flag: str) -> list[str]:
    """The comma-separated names of `text`, at least one, each one of `known`."""
    known = tuple(known)
    chosen = names(text)
    for name in chosen or [""]:
        if name not in known:
            raise SpecError(flag, "", f"expected some of {', '.join(known)}, got {_given(name)}")
    return chosen


def choice(text: str, known: Iterable[str], flag: str) -> str:
    """One of `known`."""
    known = tuple(known)
    if text not in known:
        raise SpecError(flag, "", f"expected one of {', '.join(known)}, got {_given(text)}")
    return text


def size_bytes(text: str, flag: str) -> int:
    """'4KiB' -> 4096, '1MB' -> 1000000: binary and decimal units, case-insensitive, from 4 B to 16 GiB."""
    stripped = text.strip().lower()
    number = stripped.rstrip("kmgib")
    try:
        size = float(number) * SIZE_UNITS[stripped[len(number) :]]
    except (ValueError, KeyError):
        size = math.nan
    if not 4 <= size <= MAX_MESSAGE_BYTES:  # also false for nan
        raise SpecError(flag, "", f"expected a size from 4B to 16GiB like 4KiB or 256MiB, got {_given(text)}")
    return int(size)


def message_sizes(low_text: str, high_text: str) -> list[int]:
    """--min-size to --max-size in steps of 4x."""
    low, high = size_bytes(low_text, "--min-size"), size_bytes(high_text, "--max-size")
    if low > high:
        raise SpecError("--min-size/--max-size", "", f"expected min-size <= max-size, got {low:,} > {high:,} bytes")
    return [low * 4**i for i in range(32) if low * 4**i <= high]


def finite(value: float | None, flag: str, low: float = 0.0, inclusive: bool = False) -> float | None:
    """A number flag: finite and above `low` (or at least `low`); None stays None."""
    if value is not None and not (math.isfinite(value) and (value >= low if inclusive else value > low)):
        raise SpecError(flag, "", f"expected a finite number {'>=' if inclusive else '>'} {low:g}, got {value}")
    return value


Read = str | Path | None


def output_file(
    path: Path | None,
    flag: str,
    suffixes: tuple[str, ...] = (),
    reads: Mapping[str, Read | Sequence[Read]] | None = None,
    writes: str = "",
) -> Path | None:
    """An output file checked before the work starts: its suffix when the format depends on it, not one of the files
    the command `reads` (by the flag or argument that names it, a repeated flag's files as a list: `plan --out
    cluster.yaml` replaced the cluster with the plan, `fit --runs run.json --out run.json` the run with the
    predictor; a directory read, `--profiles DIR`, is its .json files: `fit --out DIR/cpu.json` replaced a profile,
    and a new one would be read as a profile next time), not a document of another kind than it `writes` ("a
    plan": `simulate-profile --out my.plan.json` replaced a plan with a profile), then specs.outputs.check_writable
    (directory created, writable)."""
    if path is None:
        return None
    if suffixes and path.suffix.lower() not in suffixes:
        raise SpecError(flag, str(path), f"expected a file name ending in {' or '.join(suffixes)}")
    for name, given in (reads or {}).items():
        for read in given if isinstance(given, (list, tuple)) else [given]:
            if read is None:
                continue
            if Path(read).is_dir() and path.suffix.lower() == ".json" and path.resolve().parent == Path(read).resolve():
                raise SpecError(
                    flag, str(path), f"is in the directory {name} reads (its .json files): expected a file elsewhere "
                    "(it would replace one of them, or be read as one next time)"
                )  # fmt: skip
            if Path(read).is_file() and _same_file(path, Path(read)):
                raise SpecError(flag, str(path), f"is the file {name} reads: expected another file (it would be lost)")
    if writes and path.is_file() and path.stat().st_size:
        kind = _kind_of(path)
        if kind and kind != writes:
            raise SpecError(flag, str(path), f"is {kind}: expected a new file or {writes} to replace (it would be "
                            "lost)")  # fmt: skip
    return check_writable(path, flag)


def _kind_of(path: Path) -> str:
    """What kind of the project's documents a file is ("a plan", "a model file"), "" when it is none of them (or
    cannot be read as a mapping: a predictor, a picture)."""
    try:
        return file_kind(read_mapping(path))
    except SpecError:
        return ""


def _same_file(path: Path, other: Path) -> bool:
    """Whether writing `path` would replace `other` (a link to it, or a path through a directory not made yet)."""
    return path.resolve() == other.resolve() or (path.is_file() and path.samefile(other))


def output_directory(path: Path, flag: str, first_file: str) -> Path:
    """An output directory checked before the work starts: created when missing, refused when a file is in its
    place or `first_file` could not be written in it."""
    if path.exists() and not path.is_dir():
        raise SpecError(flag, str(path), "exists and is not a directory; expected a directory to write files into")
    check_no_file_above(path, flag)
    check_writable(path / first_file, flag)
    return path


def training(path: Path | None, **overrides: Any) -> TrainingSpec:
    """The training file (or defaults) with the flags that were given on top (None: not given); a flag's bad value
    is named as the flag, not as the training field it sets."""
    try:
        return load_training(path, overrides, "flags")
    except SpecError as err:
        field = err.field.split(".")[0].split("[")[0]
        if "flags" not in err.source or overrides.get(field) is None:
            raise
        raise SpecError(TRAINING_FLAGS.get(field, "--" + field.replace("_", "-")), "", err.expectation) from None
