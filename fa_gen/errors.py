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

    def __reduce__(self):  # keeps path, line and field across process pools
        return _rebuild_spec_error, (self.reason, self.path, self.line, self.field)


class UnsupportedError(FaGenError):
    """A (spec, arch) pair that no backend can implement; carries every reason."""

    def __init__(self, what: str, reasons: list[str]):
        self.what, self.reasons = what, list(reasons)
        super().__init__(f"{what}: " + "; ".join(self.reasons))

    def __reduce__(self):  # rebuilt from (what, reasons): crosses process pools (fa_gen.precompile)
        return type(self), (self.what, self.reasons)


class InputError(FaGenError, ValueError):
    """Tensors passed to a kernel do not match what the kernel was built for."""


class CompileError(FaGenError):
    """The backend compiler rejected rendered source (a bug in fa_gen, reported with context)."""


def _rebuild_spec_error(message, path, line, field) -> SpecError:
    return SpecError(message, path=path, line=line, field=field)
