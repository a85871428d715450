"""A directory of device profiles: the files in it, and the profiles checked against the model to plan.

A profile times one layer shape; planning another model with it would silently mistime every layer, so loading
refuses a profile whose shape differs, a second profile of the same device, two entries for one point and times
no device could reach (they would make every plan look impossibly fast). Link profiles (`hetplan profile-comm`,
"hetplan.links/1") in the directory belong to the device profile of their device: they are attached to it
(`DeviceProfile.link_files`), so that costs from the directory use this machine's measured collectives too. Torch-free.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from pydantic import ValidationError

from profiler.profile import PROFILE_SCHEMA, DeviceProfile, LinkFileRecord, ProfileEntry, load_profile
from specs.errors import SpecError
from specs.loading import file_sha256, read_mapping
from specs.model import NO_HEAD_DIM, ModelSpec, given_head_dim

# the fields that decide a decoder layer's cost: a profile must have been measured with the same
SHAPE_FIELDS = ("hidden_size", "ffn_hidden_size", "num_attention_heads", "num_kv_heads", "head_dim", "vocab_size",
                "mlp")  # fmt: skip
LINKS_SCHEMA = "hetplan.links/1"
# no device computes faster than this (the catalog's fastest: 1.3e15 dense 16-bit FLOP/s); a time that says so is
# wrong (a unit slip, a clock that did not wait for the device)
MAX_FLOPS_PER_S = 1e17


def _forward_flops(model: ModelSpec, entry: ProfileEntry, seq_length: int) -> float:
    """The FLOPs one TP rank computes in the entry's forward (0 for the embedding: a lookup)."""
    tokens = entry.micro_batch_size * seq_length
    if entry.layer == "decoder":
        attention = model.layer_attention_flops(entry.micro_batch_size, seq_length, causal_kernel=True)
        return (model.layer_gemm_flops(tokens) + attention) / entry.tp
    return model.lm_head_flops(tokens) / entry.tp if entry.layer == "lm_head" else 0.0


def check_profile(profile: DeviceProfile, model: ModelSpec | None = None) -> None:
    """Refuse two entries for one (layer, micro-batch, TP, recompute) and a forward or backward time shorter than
    its forward FLOPs at MAX_FLOPS_PER_S (`model`: the layer shape, else the profile's own when it is valid)."""
    first: dict[tuple[str, int, int, str], int] = {}
    for index, entry in enumerate(profile.entries):
        point = (entry.layer, entry.micro_batch_size, entry.tp, entry.recompute)
        if point in first:
            where = f"{entry.layer} b={entry.micro_batch_size} tp={entry.tp} {entry.recompute}"
            raise SpecError(profile.path, f"entries[{index}]", f"a second entry for {where} (entries[{first[point]}])")
        first[point] = index
    if model is None:
        try:
            model = ModelSpec.model_validate(profile.model)
        except ValidationError:  # the fit reads the shape itself and says what is wrong with it
            return
    for index, entry in enumerate(profile.entries):
        flops = _forward_flops(model, entry, profile.seq_length)
        for field in ("forward_time_s", "backward_time_s"):
            seconds = getattr(entry, field)
            if seconds is not None and flops > seconds * MAX_FLOPS_PER_S:
                raise SpecError(
                    profile.path,
                    f"entries[{index}].{field}",
                    f"{seconds:g} s means {flops / seconds:.1e} FLOP/s; expected at least "
                    f"{flops / MAX_FLOPS_PER_S:.2g} s (no device computes {MAX_FLOPS_PER_S:.0e} FLOP/s)",
                )


def _json_files(directory: Path) -> list[Path]:
    """The *.json files of a directory, sorted (deterministic order), but for the project's other documents kept
    beside the profiles (a plan, a run record: their `schema` says what they are); refused when it is not a
    directory."""
    if not directory.is_dir():
        missing = "" if directory.exists() else "not found: "
        raise SpecError(str(directory), "", f"{missing}expected a directory of profile JSON files")
    return [path for path in sorted(directory.glob("*.json")) if not _another_document(path)]


def _another_document(path: Path) -> bool:
    """Whether a JSON file is one of the project's documents that is neither a profile nor a link profile."""
    try:
        schema = read_mapping(path).get("schema")
    except SpecError:
        return False  # read again as a profile, it says what is wrong with it
    return isinstance(schema, str) and schema.startswith("hetplan.") and schema not in (PROFILE_SCHEMA, LINKS_SCHEMA)


def is_link_profile(path: Path) -> bool:
    """Whether a JSON file is a link profile (`hetplan profile-comm`) rather than a device profile."""
    try:
        return read_mapping(path).get("schema") == LINKS_SCHEMA
    except SpecError:
        return False


def profile_files(directory: Path) -> list[Path]:
    """The device profile files of a directory, at least one (a fit from an empty directory is a user error)."""
    paths = [path for path in _json_files(directory) if not is_link_profile(path)]
    if not paths:  # a plan alone in it read as "no profiles" with no word of the file that is there
        others = [f"{path.name} ({read_mapping(path)['schema']})" for path in sorted(directory.glob("*.json"))
                  if _another_document(path)]  # fmt: skip
        besides = f": {', '.join(others)} {'is' if len(others) == 1 else 'are'} not a profile" if others else ""
        raise SpecError(str(directory), "", f"no *.json profiles in this directory{besides}")
    return paths


def link_profile_files(directory: Path) -> list[Path]:
    """The link profiles of a directory (`hetplan fit --profiles DIR` fits them with the device profiles)."""
    return [path for path in _json_files(directory) if is_link_profile(path)]


def checked_profile_files(directory: Path) -> list[Path]:
    """`profile_files`, each loaded and checked (`check_profile`) before a fit learns from it."""
    paths = profile_files(directory)
    for path in paths:
        check_profile(load_profile(path))
    return paths


def load_profiles(
    directory: Path | None, model: ModelSpec, devices: Collection[str] | None = None
) -> dict[str, DeviceProfile]:
    """Measured (or saved simulated) profiles by device key; each must describe this model's layer shape. With
    `devices` (the cluster's device keys), profiles of other devices are left out unchecked: a directory can keep
    the profiles of devices (and models) the cluster does not have."""
    if directory is None:
        return {}
    return load_profile_files(_json_files(directory), model, f"in {directory}", devices)


def load_profile_files(
    paths: list[Path], model: ModelSpec, where: str = "", devices: Collection[str] | None = None
) -> dict[str, DeviceProfile]:
    """These profile files by device key (at most one per device), each checked against this model's layer shape
    (`where` the files are, for the message about a second profile of one device); link profiles among them are
    attached to their device's profile. With `devices`, only those devices' profiles (and link profiles)."""
    profiles: dict[str, DeviceProfile] = {}
    links: list[tuple[Path, dict]] = []
    for path in paths:
        data = read_mapping(path)
        if data.get("schema") == LINKS_SCHEMA:
            links.append((path, data))
            continue
        profile = load_profile(path)
        if devices is not None and str(profile.device.get("key", "")) not in devices:
            continue
        for field in SHAPE_FIELDS:
            profiled = given_head_dim(profile.model) if field == "head_dim" else profile.model.get(field)
            planned = getattr(model, field)
            if profiled != planned:
                about_head_dim = field == "head_dim"
                profiled_text, planned_text = (
                    NO_HEAD_DIM if v is None and about_head_dim else repr(v) for v in (profiled, planned)
                )
                raise SpecError(
                    str(path), f"model.{field}", f"profiled {profiled_text}, the model to plan has {planned_text}"
                )
        check_profile(profile, model)
        key = str(profile.device.get("key", ""))
        if key in profiles:
            raise SpecError(str(path), "device.key", f"a second profile for device {key!r} {where}".rstrip())
        profiles[key] = profile
    for path, data in links:
        from specs.device import get_device

        named = data.get("device") or ("cpu" if data.get("backend") == "gloo" else None)
        key = get_device(str(named), str(path), "device").key if named else ""
        if devices is not None and key not in devices:
            continue
        if key not in profiles:
            raise SpecError(
                str(path), "device", f"a link profile of device {key!r} needs that device's profile beside it {where}"
            )
        profiles[key].link_files.append(LinkFileRecord(str(path), file_sha256(path), data))
    return profiles
