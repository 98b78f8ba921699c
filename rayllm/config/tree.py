"""A typed config tree from YAML: any dataclass tree, dotted overrides, errors that name the key.

Unknown keys are refused naming the nearest valid one; values are coerced to the field's type
or refused naming the key and the type. Used by the training config and by prepare's.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from typing import Any, Union

import yaml

from rayllm.errors import ConfigError


def read_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """A YAML config file's top-level mapping, or a ConfigError saying what is wrong with it."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ConfigError(
            f"config file not found: {path!r}. Pass the path of a YAML file, for example configs/tiny.yaml."
        )
    with open(path) as f:
        try:
            raw = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path!r} is not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path!r} must hold a mapping of sections, not {type(raw).__name__}")
    return raw


def build_config(
    cls: type, raw: dict[str, Any], overrides: list[str] | None = None, moved: dict[str, str] | None = None
) -> Any:
    """Any dataclass config tree from a mapping plus dotted overrides, with the same key and type checks.
    ``moved`` maps keys that moved (old dotted prefix -> new): an old one is refused naming the new."""
    raw = _deepcopy(raw)
    moved = moved or {}
    for item in overrides or []:
        _apply_override(raw, item, cls, moved)
    return _build(cls, raw, prefix="", moved=moved)


def _deepcopy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deepcopy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deepcopy(v) for v in value]
    return value


def _apply_override(raw: dict[str, Any], item: str, root: type, moved: dict[str, str]) -> None:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key=value, for example train.max_steps=50")
    key, _, text = item.partition("=")
    key = key.strip()
    _refuse_moved(key, moved)
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        value = text
    node: Any = raw
    parts = key.split(".")
    cls: Any = root
    for i, part in enumerate(parts[:-1]):
        hints = _fields(cls)
        if part not in hints:
            raise ConfigError(_unknown_key_message(".".join(parts[: i + 1]), part, hints))
        cls = _dataclass_of(hints[part])
        if cls is None:
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key!r}: {'.'.join(parts[: i + 1])} is not a section in the file")
    node[parts[-1]] = value


def _fields(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _dataclass_of(tp: Any) -> type | None:
    return tp if dataclasses.is_dataclass(tp) else None


def _refuse_moved(key: str, moved: dict[str, str]) -> None:
    for old, new in moved.items():
        if key == old or key.startswith(old + "."):
            raise ConfigError(
                f"config key '{key}' has moved to '{new}{key[len(old) :]}': write it as '{new}' in the YAML "
                "or the overrides"
            )


def _unknown_key_message(full_key: str, name: str, valid: dict[str, Any]) -> str:
    close = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    prefix = full_key.rsplit(".", 1)[0] + "." if "." in full_key else ""
    hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
    return f"unknown config key '{full_key}'{hint} Valid keys here: {', '.join(sorted(valid))}"


def _build(cls: type, raw: Any, prefix: str, moved: dict[str, str]) -> Any:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config section '{prefix.rstrip('.') or '<root>'}' must be a mapping, got {raw!r}")
    hints = _fields(cls)
    for key in raw:
        _refuse_moved(prefix + str(key), moved)
        if key not in hints:
            raise ConfigError(_unknown_key_message(prefix + str(key), str(key), hints))
    kwargs = {}
    for name, tp in hints.items():
        if name not in raw:
            continue
        full = prefix + name
        sub = _dataclass_of(tp)
        kwargs[name] = _build(sub, raw[name], full + ".", moved) if sub else _coerce(raw[name], tp, full)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` as type ``tp`` or raise a ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        if isinstance(value, list) and any(isinstance(v, dict) for v in value):
            for option in options:
                if typing.get_origin(option) is list and _dataclass_of(typing.get_args(option)[0]):
                    return _coerce(value, option, key)
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _coerce(value, option, key)
            except ConfigError as e:
                errors.append(e)
        raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return {_coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()}
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    sub = _dataclass_of(tp)
    if sub is not None:
        return _build(sub, value, key + ".", {})
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif tp is str:
        if isinstance(value, str):
            return value
    raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in typing.get_args(tp))
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"a mapping of {_type_name(key_tp)} to {_type_name(value_tp)}"
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))
