"""The one exception hierarchy: every user-facing failure is a HetplanError with a one-line message."""

from __future__ import annotations


class HetplanError(Exception):
    """A failure the user can act on; the CLI prints its message on one line and exits 2."""


class SpecError(HetplanError):
    """A spec file (or flag) is invalid: names the file, the field and what was expected."""

    def __init__(self, source: str, field: str, expectation: str) -> None:
        self.source = source
        self.field = field
        self.expectation = expectation
        where = f"{source}: {field}" if field else source
        super().__init__(f"{where}: {expectation}")


class DoesNotFitError(HetplanError):
    """No strategy fits device memory; carries the smallest shortfall found."""

    def __init__(self, message: str, shortfall_bytes: float) -> None:
        self.shortfall_bytes = shortfall_bytes
        super().__init__(message)


class TorchMissingError(HetplanError):
    """A command that measures or runs needs torch, which is an optional extra."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what} needs PyTorch, which is not installed: pip install 'hetplan[torch]' (from a clone: make test; "
            "CPU-only, first: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
        )
