"""Experiment configs checked once, at start, against typed schemas: hydra structured configs plus ranges.

A hydra config is a tree of YAML values and command-line overrides; without a schema `realtime=no` is the truthy
string "no", `robot.camera.fps=-30` builds a camera that never delivers a frame (while the event log grows), and
`runtime.control_hz=0` ends in a ZeroDivisionError in a thread. `validate(cfg, Schema)` merges the config into
`OmegaConf.structured(Schema)` (so types are enforced and converted: "no" becomes False, "abc" for an int is an
error, an unknown key is an error), then checks every field against the `LIMITS` its dataclass declares and any
cross-field rule in its `check(node)`. Each mistake is one `ConfigError(field, expected, found)` with the full dotted
path (`robot.camera.fps: expected a number > 0 (frames per second), found -30.0`), raised before any thread starts.
The result is the typed, merged DictConfig, so code downstream reads it as before.

A schema is a dataclass (nested dataclasses for nested keys, `Any` for a subtree validated separately) with
`LIMITS: ClassVar[dict[str, Limit]]` and optionally `check(node) -> list[ConfigError]`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, MissingMandatoryValue, ValidationError

from vla_rt.arguments import LIMITS  # the build limits every benchmark case must respect
from vla_rt.config import PRESETS
from vla_rt.errors import ConfigError, FieldError


@dataclass(frozen=True)
class Limit:
    """The accepted range of one numeric field (bounds inclusive unless gt / lt), or its accepted choices."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple | None = None
    why: str = ""

    def expected(self, integer: bool = False) -> str:
        if self.choices is not None:
            text = f"one of {list(self.choices)}"
        else:
            low = (
                f"> {_num(self.gt)}" if self.gt is not None else (f">= {_num(self.ge)}" if self.ge is not None else "")
            )
            high = (
                f"< {_num(self.lt)}" if self.lt is not None else (f"<= {_num(self.le)}" if self.le is not None else "")
            )
            kind = "an integer" if integer else "a number"
            text = f"{kind} " + " and ".join(b for b in (low, high) if b) if low or high else f"a finite {kind[2:]}"
        return f"{text} ({self.why})" if self.why else text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return True  # Optional fields: None means "not set"; the type says whether None is allowed
        if self.choices is not None:
            return value in self.choices
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return False
        return (
            (self.gt is None or value > self.gt)
            and (self.ge is None or value >= self.ge)
            and (self.lt is None or value < self.lt)
            and (self.le is None or value <= self.le)
        )


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e18 else f"{x:g}"


def _is_int(tp: Any) -> bool:
    return tp is int or int in typing.get_args(tp) and float not in typing.get_args(tp)


def positive(why: str = "", le: float | None = None) -> Limit:
    return Limit(gt=0, le=le, why=why)


def non_negative(why: str = "", le: float | None = None) -> Limit:
    return Limit(ge=0, le=le, why=why)


def bench_backends(
    requested: list[str] | tuple[str, ...] | None,
    cuda: bool,
    field: str = "backends",
    error: type[FieldError] = ConfigError,
) -> tuple[str, ...]:
    """The backends a latency run times: the device's defaults when none are named, else every name checked (an
    unknown name would otherwise be timed as the static-torch engine and reported under the wrong name)."""
    from vla_rt.bench.latency import CPU_BACKENDS, CUDA_BACKENDS

    default = CUDA_BACKENDS if cuda else CPU_BACKENDS
    known = (*CUDA_BACKENDS, "folded") if cuda else CPU_BACKENDS
    if requested is None:
        return default
    names = tuple(str(b).strip() for b in requested)
    if not names or any(b not in known for b in names):
        device = "cuda" if cuda else "cpu"
        raise error(field, f"names from {list(known)} (on {device})", None, found_text=repr(",".join(names)))
    return names


def _join(path: str, key: object) -> str:
    return f"{path}.{key}" if path else str(key)


def _field_type(schema: type, dotted: str) -> Any:
    """The annotated type of a dotted field inside a schema (for the 'expected' of a type error)."""
    tp: Any = schema
    for part in dotted.split("."):
        if not dataclasses.is_dataclass(tp):
            return None
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return None
        tp = hints[part]
    return tp


def _describe_type(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return f"{_describe_type(args[0])} or null"
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def _schema_error(e: Exception, schema: type, path: str, cfg: Any) -> ConfigError:
    key = str(getattr(e, "full_key", "") or getattr(e, "key", "") or "")
    field = _join(path, key) if key else path or "config"
    if isinstance(e, ConfigKeyError | ConfigAttributeError):
        parent = _field_type(schema, key.rsplit(".", 1)[0]) if "." in key else schema
        known = [f.name for f in dataclasses.fields(parent)] if dataclasses.is_dataclass(parent) else []
        return ConfigError(field, f"a key of {known}" if known else "a known key", None, found_text="an unknown key")
    if isinstance(e, MissingMandatoryValue):
        return ConfigError(field, "a value", None, found_text="none (???)")
    tp = _field_type(schema, key) if key else None
    found = OmegaConf.select(cfg, key, default=getattr(e, "value", None)) if key and OmegaConf.is_config(cfg) else None
    return ConfigError(field, _describe_type(tp) if tp is not None else str(e).splitlines()[0], found)


@functools.cache
def _structured(schema: type) -> DictConfig:
    """The schema as an (unchanging) OmegaConf tree: building it from the dataclass is most of a validation's cost."""
    return OmegaConf.structured(schema)


def validate(cfg: DictConfig | Mapping[str, Any], schema: type, path: str = "") -> DictConfig:
    """`cfg` merged into `schema` (types enforced and converted), every declared range and rule checked.

    Raises ConfigError naming the first wrong field by its full dotted path (prefixed with `path`)."""
    if not OmegaConf.is_config(cfg):
        cfg = OmegaConf.create(dict(cfg))
    try:
        merged = OmegaConf.merge(_structured(schema), cfg)
        OmegaConf.to_container(merged, resolve=True, throw_on_missing=True)
    except (ValidationError, ConfigKeyError, ConfigAttributeError, MissingMandatoryValue) as e:
        raise _schema_error(e, schema, path, cfg) from None
    check_node(merged, schema, path)
    return merged


def check_node(node: DictConfig, schema: type, path: str) -> None:
    """Every LIMITS entry of `schema` and of its nested dataclasses, then its `check` rules."""
    limits: dict[str, Limit] = getattr(schema, "LIMITS", {})
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        value = node[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            check_node(value, hints[f.name], _join(path, f.name))
        elif f.name in limits and not limits[f.name].accepts(value):
            raise ConfigError(_join(path, f.name), limits[f.name].expected(_is_int(hints[f.name])), value)
    rules = getattr(schema, "check", None)
    if rules is not None:
        for problem in rules(node):
            raise ConfigError(
                _join(path, problem.field), problem.expected, problem.found, found_text=problem.found_text
            )


# ----- the latency benchmark's schema (experiments/benchmark_latency.py; configs/experiment/benchmark_latency.yaml) -
@dataclass
class BenchmarkLatencyConfig:
    preset: str | None = None
    cases: list[Any] = dataclasses.field(default_factory=list)  # [[views, prompt_len, chunk], ...]
    backends: list[str] | None = None
    iters: int = 200
    warmup: int = 20
    compile_budget_s: float = 420.0
    out_dir: str | None = None  # None: a new run folder under benchmarks/raw/ (bench.report.run_dir)

    LIMITS: ClassVar[dict[str, Limit]] = {
        "iters": Limit(ge=1, le=1_000_000, why="timed calls per row"),
        "warmup": non_negative("untimed calls before a row", le=100_000),
        "compile_budget_s": positive("seconds for the torch.compile row", le=86_400),
    }

    @staticmethod
    def check(node: DictConfig) -> list[ConfigError]:
        if node.preset is not None and node.preset not in PRESETS:
            return [ConfigError("preset", f"null or one of {sorted(PRESETS)}", node.preset)]
        if not node.cases:
            return [ConfigError("cases", "at least one [views, prompt_len, chunk] case", None, found_text="none")]
        for i, case in enumerate(node.cases):
            values = list(case) if OmegaConf.is_list(case) or isinstance(case, list | tuple) else None
            ok = (
                values is not None
                and len(values) == 3
                and all(isinstance(v, int) and not isinstance(v, bool) for v in values)
            )
            ok = ok and all(
                LIMITS[n][0] <= v <= LIMITS[n][1] for n, v in zip(("num_views", "prompt_len", "chunk"), values)
            )
            if not ok:
                bounds = ", ".join(
                    f"{n} in [{LIMITS[n][0]}, {LIMITS[n][1]}]" for n in ("num_views", "prompt_len", "chunk")
                )
                return [
                    ConfigError(f"cases[{i}]", f"[views, prompt_len, chunk] with {bounds}", None, found_text=str(case))
                ]
        return []
