"""User-facing errors.

Every error a user can cause derives from `FaGenError`; the CLI prints these
without a traceback. `SpecError` points at the offending place in a spec file.
"""

from __future__ import annotations


class FaGenError(Exception):
    """Base class of the errors that a user of fa_gen can cause and fix."""


class SpecError(FaGenError, ValueError):
    """A spec is invalid: names the file, the line, the field, the value and what is allowed."""

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None):
        self.path = path
        self.line = line
        self.field = field
        self.reason = message
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        prefix = f"{field}: " if field else ""
        super().__init__(f"{where}{prefix}{message}")


class UnsupportedError(FaGenError):
    """A (spec, arch) pair that no backend can implement; carries every reason."""

    def __init__(self, what: str, reasons: list[str]):
        self.reasons = list(reasons)
        super().__init__(f"{what}: " + "; ".join(self.reasons))


class InputError(FaGenError, ValueError):
    """Tensors passed to a kernel do not match what the kernel was built for."""


class CompileError(FaGenError):
    """The backend compiler rejected rendered source (a bug in fa_gen, reported with context)."""
