"""Every error vla-rt raises for a mistake a user can fix, one type per boundary where the mistake is made.

    VlaRtError                        base: catch this to catch every user-fixable error (the CLI does)
    ├── CheckpointError(path, problem)  a checkpoint file or directory is missing, unreadable, malformed or not π0
    └── FieldError(field, expected, found)
        ├── ArgumentError             an argument of `load_pi0` / `build_pi0` / `Pi0Policy` or a CLI option
        ├── InputError                an observation or model input at inference time
        ├── NormStatsError            normalisation statistics (from a file, a header or an argument)
        └── ConfigError               an experiment config (hydra), checked once at start

Every type is also a `ValueError`, so callers that already catch ValueError keep working. Messages read
`field: expected E, found F` (or `path: problem` for files): the thing to change, what it should be, what it was.
Anything else that escapes vla-rt is a bug, not a user error, and keeps its traceback.
"""

from __future__ import annotations

from pathlib import Path

_FOUND_LIMIT = 200  # characters of a found value shown; a huge array or string must not flood the terminal


def show(value: object) -> str:
    """A short description of a found value: repr for scalars and short strings, the type for everything else."""
    if isinstance(value, str | bytes):
        text = repr(value)
    elif value is None or isinstance(value, bool | int | float | complex):
        text = repr(value)
    elif isinstance(value, tuple | list) and len(value) <= 8 and all(isinstance(v, int | float | str) for v in value):
        text = repr(value)
    else:
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        text = type(value).__name__ + (f" of shape {tuple(shape)}" if shape is not None else "")
        text += f" dtype {dtype}" if dtype is not None else ""
    return text if len(text) <= _FOUND_LIMIT else text[: _FOUND_LIMIT - 3] + "..."


class VlaRtError(Exception):
    """A mistake in what the user gave vla-rt (a file, an argument, an input, a config), not a bug in vla-rt."""


class FieldError(VlaRtError, ValueError):
    """A named value is wrong: `field: expected E, found F`. `found` is shown through `show` (short, never huge)."""

    def __init__(self, field: str, expected: str, found: object, *, found_text: str | None = None):
        self.field = field
        self.expected = expected
        self.found = found
        self.found_text = found_text if found_text is not None else show(found)
        super().__init__(f"{field}: expected {expected}, found {self.found_text}")


class ArgumentError(FieldError):
    """An argument of a build/load call or a command-line option (checked before any expensive work)."""


class InputError(FieldError):
    """An observation or model input given at inference time."""


class ConfigError(FieldError):
    """An experiment config value (hydra), checked once at start before any thread runs."""


class NormStatsError(FieldError):
    """Normalisation statistics; `source` (a file, a header, `norm_stats`) prefixes the message when known."""

    def __init__(self, field: str, expected: str, found: object, *, source: str = "", found_text: str | None = None):
        self.source = source
        self.entry_field = field  # without the source
        super().__init__(f"{source}: {field}" if source else field, expected, found, found_text=found_text)

    def within(self, prefix: str, source: str = "") -> NormStatsError:
        """The same error for the field seen from outside: `std` inside entry 'state' is `norm_stats['state'].std`."""
        return NormStatsError(
            f"{prefix}.{self.entry_field}" if prefix else self.entry_field,
            self.expected,
            self.found,
            source=source or self.source,
            found_text=self.found_text,
        )


class CheckpointError(VlaRtError, ValueError):
    """A checkpoint (file or directory) cannot be used: `path: problem`.

    `CheckpointError(path, problem)` names the file; `CheckpointError(message)` is a problem whose file is not known
    where it is found (shape inference works on tensors, not files): the file layer (`vla_rt.checkpoints.files`)
    adds the path before it reaches the user.
    """

    def __init__(self, path_or_message: str | Path, problem: str | None = None):
        if problem is None:
            self.path: str | None = None
            self.problem = str(path_or_message)
        else:
            self.path = str(path_or_message)
            self.problem = problem
        super().__init__(self.problem if self.path is None else f"{self.path}: {self.problem}")

    def with_path(self, path: str | Path) -> CheckpointError:
        """This error naming `path` (itself if it already names a file, or the message already shows the path)."""
        if self.path is not None or str(path) in self.problem:
            return self
        return CheckpointError(path, self.problem)


__all__ = [
    "ArgumentError",
    "CheckpointError",
    "ConfigError",
    "FieldError",
    "InputError",
    "NormStatsError",
    "VlaRtError",
    "show",
]
