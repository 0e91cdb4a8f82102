"""Loading a command's config: defaults < a YAML file < CLI options < dotted `key=value` overrides, validated.

Unknown keys and wrong types fail at once with the dotted key's name and a close-match suggestion (`ConfigError`,
one line); the resolved config is saved into the run dir (`save_config`).
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from opd.io import atomic_write_text

Model = TypeVar("Model", bound=BaseModel)


class ConfigError(ValueError):
    """A config problem, described in one line that names the key, the value and what is accepted."""


def _all_keys(model_cls: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model_cls.model_fields.items():
        keys.append(prefix + name)
        for candidate in field_models(field.annotation):
            keys.extend(_all_keys(candidate, prefix + name + "."))
    return keys


def field_models(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models in a field's annotation (`X`, `X | None`, `list[X]`, …), outermost first."""
    args = getattr(annotation, "__args__", None) or ()
    found = [annotation] if isinstance(annotation, type) and issubclass(annotation, BaseModel) else []
    for arg in args:
        found.extend(field_models(arg))
    return found


def _suggest(key: str, model_cls: type[BaseModel]) -> str:
    matches = difflib.get_close_matches(key, _all_keys(model_cls), n=1, cutoff=0.6)
    return f" (did you mean '{matches[0]}'?)" if matches else ""


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=value` → ("a.b", parsed value); the value is read as YAML so `1e-6`, `true`, `[a, b]` work."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' is not of the form key=value (e.g. sampling.temperature=0.7)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError:
        value = raw
    if isinstance(value, str) and _looks_like_float(value):
        value = float(value)  # YAML 1.1 reads "1e-6" as a string
    return key, value


def _looks_like_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return any(c in text.lower() for c in "e.") and text.strip().lower() not in {"nan", "inf", "-inf"}


def flatten_dotted(data: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1}: nested config data as dotted keys (the inverse of `set_dotted`)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten_dotted(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text; expected a UTF-8 YAML file") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def build_config(
    model_cls: type[Model],
    *,
    config_file: str | Path | None = None,
    options: dict[str, Any] | None = None,
    overrides: list[str] | None = None,
) -> Model:
    """Merge defaults < YAML file < CLI options (dotted keys, None = not given) < `key=value` overrides; validate."""
    data: dict = read_yaml(config_file) if config_file else {}
    for key, value in (options or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    for text in overrides or []:
        key, value = parse_override(text)
        set_dotted(data, key, value)
    return validate_config(model_cls, data)


def validate_config(model_cls: type[Model], data: dict) -> Model:
    try:
        return model_cls.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, model_cls)) from None


def _describe(error: ValidationError, model_cls: type[BaseModel]) -> str:
    errors = error.errors()
    first = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    key = ".".join(str(part) for part in first["loc"] if not str(part).startswith("function-"))
    if first["type"] == "extra_forbidden":
        return f"unknown config key '{key}'{_suggest(key, model_cls)}"
    if first["type"] == "missing":
        return f"config key '{key}' is required ({_field_description(model_cls, key)})"
    if first["type"] == "value_error" and "error" in first.get("ctx", {}):  # a model validator's own sentence
        return f"config key '{key}': {first['ctx']['error']}" if key else str(first["ctx"]["error"])
    given = first.get("input")
    shown = repr(given) if not isinstance(given, dict) else "a mapping"
    return f"config key '{key}': {first['msg']}, got {shown}"


def _field_description(model_cls: type[BaseModel], key: str) -> str:
    cls: Any = model_cls
    field = None
    for part in key.split("."):
        field = cls.model_fields.get(part) if isinstance(cls, type) and issubclass(cls, BaseModel) else None
        if field is None:
            return "see --help"
        models = field_models(field.annotation)
        cls = models[0] if models else None
    return (field.description or "see --help") if field else "see --help"


def save_config(config: BaseModel, run_dir: str | Path) -> Path:
    """Save the fully resolved config as `run_dir/config.yaml`."""
    path = Path(run_dir) / "config.yaml"
    atomic_write_text(path, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
    return path
