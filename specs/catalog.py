"""One loader for the shipped catalogs (specs/catalog/*.yaml: devices, models, vendors, engines).

A catalog file maps each entry's key to its fields. Every entry is validated with its pydantic model (an error names
the file and `key.field`), and every name an entry answers to (its key and aliases, lower case) is unique in the
file, so a lookup resolves to exactly one entry. Shipped files are read once per process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Generic, TypeVar

from pydantic import BaseModel

from specs.errors import SpecError
from specs.loading import read_mapping, validate

CATALOG_DIR = Path(__file__).parent / "catalog"

EntryT = TypeVar("EntryT", bound=BaseModel)


@dataclass(frozen=True)
class Catalog(Generic[EntryT]):
    """A catalog's entries by key (file order) and the key every name (key or alias) resolves to."""

    source: str
    kind: str  # what an entry is, for messages: "device", "vendor", ...
    entries: dict[str, EntryT]
    names: dict[str, str]

    def find(self, name: str) -> EntryT | None:
        """The entry a key or alias names (case-insensitive), or None (a name that is not a string names none)."""
        key = self.names.get(name.strip().lower()) if isinstance(name, str) else None
        return None if key is None else self.entries[key]

    def get(self, name: str, source: str, field: str) -> EntryT:
        """The entry a key or alias names; otherwise a one-line SpecError at (source, field) listing the keys."""
        if not isinstance(name, str):
            article = "an" if self.kind[0] in "aeiou" else "a"
            given = f"{type(name).__name__} {name!r:.60}"
            raise SpecError(source, field, f"expected {article} {self.kind} name, got {given}")
        entry = self.find(name)
        if entry is None:
            known = ", ".join(self.entries)
            raise SpecError(source, field, f"unknown {self.kind} {name!r}; expected one of: {known}")
        return entry


def read_catalog(path: Path, model: type[EntryT], kind: str) -> Catalog[EntryT]:
    """Read a catalog file, validate each entry with `model` (which has a `key` field) and index its names."""
    source = str(path)
    entries: dict[str, EntryT] = {}
    names: dict[str, str] = {}
    for key, fields in read_mapping(path).items():
        if not isinstance(key, str):
            raise SpecError(source, str(key), f"a {kind}'s key must be a string (quote it), got {key!r}")
        if not isinstance(fields, dict):
            raise SpecError(source, key, f"expected the {kind}'s fields (a mapping), got {type(fields).__name__}")
        if "key" in fields:
            raise SpecError(source, f"{key}.key", "an entry's key is its name in the file: remove this field")
        entry = validate(model, {"key": key, **fields}, source, prefix=key)
        aliases: tuple[str, ...] = getattr(entry, "aliases", ())
        for field, name in [("", key), *((f".aliases[{i}]", alias) for i, alias in enumerate(aliases))]:
            if name != name.strip().lower() or not name:
                raise SpecError(source, key + field, f"names are lower case without surrounding spaces, got {name!r}")
            if name in names:
                why = f"{name!r} already names {names[name]!r}: a name must resolve to exactly one {kind}"
                raise SpecError(source, key + field, why)
            names[name] = key
        entries[key] = entry
    return Catalog(source, kind, entries, names)


@cache
def load_catalog(filename: str, model: type[EntryT], kind: str) -> Catalog[EntryT]:
    """A shipped catalog (specs/catalog/<filename>), read and validated once per process."""
    return read_catalog(CATALOG_DIR / filename, model, kind)
