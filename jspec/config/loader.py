"""Loading configs: named YAML files or paths, dotted `key=value` overrides, names and types checked
against the dataclasses, then every section validated."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.resources
import pathlib
import types
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from jspec.config.errors import ConfigError
from jspec.config.run import Config


def _config_dir() -> pathlib.Path:
    """The named configs: the top-level configs/, installed as the package data of jspec.configs
    (so `load("demo")` works from any folder), or read beside the package in a source checkout
    that was not installed (where `jspec.configs` may still import as an empty namespace)."""
    checkout = pathlib.Path(__file__).resolve().parents[2] / "configs"
    try:
        installed = pathlib.Path(str(importlib.resources.files("jspec.configs")))
    except (ModuleNotFoundError, TypeError):
        return checkout
    return installed if any(installed.glob("*.yaml")) else checkout


CONFIG_DIR = _config_dir()


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _build(cls: type, data: Any, where: str) -> Any:
    """Builds dataclass `cls` from a nested dict, checking names and coercing scalar types."""
    if data is None:
        return None
    if not isinstance(data, dict):
        raise ConfigError(f"{where or 'config'} must be a mapping of fields, got {data!r}.")
    types_ = _field_types(cls)
    unknown = sorted(set(data) - set(types_))
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(types_), n=1)
        prefix = f"{where}." if where else ""
        hint = f"; did you mean {prefix}{close[0]}?" if close else "."
        raise ConfigError(
            f"unknown config field {prefix}{name}{hint} Known fields: {', '.join(types_)}."
        )
    kwargs = {
        name: _coerce(types_[name], value, f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _coerce(args[0], value, where)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, where)
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.strip("()[] ").split(",") if v.strip()]
        elif isinstance(value, int | float):  # one value for a list of one
            value = [value]
        if not isinstance(value, Sequence):
            raise ConfigError(f"{where}={value!r} must be a list.")
        (elem, *_) = typing.get_args(tp)
        return tuple(_coerce(elem, v, where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "1", "yes"):
            return True
        if str(value).lower() in ("false", "0", "no"):
            return False
        raise ConfigError(f"{where}={value!r} is not a boolean; use true or false.")
    if tp in (int, float):
        try:
            out = tp(value) if tp is float else int(str(value), 0)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}={value!r} is not {tp.__name__}.") from None
        return out
    if tp is str:
        return str(value)
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {dotted}: {key} is a value, not a section.")
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> dict:
    """Turns `["model.num_layers=4", "seed=1"]` into a nested dict (values parsed as YAML)."""
    tree: dict = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(
                f"override {item!r} has no '='; write overrides as dotted.key=value, "
                "e.g. model.num_layers=4."
            )
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), _yaml(raw, f"override {item!r}") if raw else "")
    return tree


def _yaml(text: str, what: str) -> Any:
    """`text` parsed as YAML; a ConfigError naming `what` and the parser's complaint if it is not
    YAML."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"{what} is not valid YAML: {' '.join(str(error).split())}") from None


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def resolve_path(name_or_path: str | pathlib.Path) -> pathlib.Path:
    """A config name (`tiny`) shipped in `configs/`, or a path to a YAML file."""
    path = pathlib.Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
        raise ConfigError(
            f"config {str(name_or_path)!r} not found at {path}; pass a YAML path or one of: "
            f"{', '.join(known)}."
        )
    return path


def load(name_or_path: str | pathlib.Path = "tiny", overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config, applies dotted overrides, validates, and returns a frozen Config."""
    path = resolve_path(name_or_path)
    data = _yaml(path.read_text(), f"config {path}") or {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config {path} holds a {type(data).__name__}, not sections: write it as a mapping, "
            "e.g. 'model:' with 'num_layers: 4' under it."
        )
    data.setdefault("name", path.stem)
    data = _merge(data, parse_overrides(overrides))
    return _build(Config, data, "").validate()


def to_dict(config: Any) -> dict:
    """The plain nested dict of a config (for logs, checkpoints and YAML)."""
    return dataclasses.asdict(config)
