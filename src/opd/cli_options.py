"""The options of the `opd` command line, derived from the config fields they set.

An option that sets a config key is declared once, by its key:
`n: Annotated[int | None, field_option(EvalConfig, "n")] = None` takes its help from the field's `description` (with
the choices of a `Literal` field) and shows the field's default, so neither is written twice. Its value is None when
not given (then the YAML file or the field's default applies), and `config_options` collects the options into the
dotted-key dict `opd.config.build_config` merges. Also here: the `--config` and key=value arguments every config
command takes, the legacy `--thinking on|off` spelling, and the small parsers of comma-separated options.
"""

from __future__ import annotations

import inspect
import os
import typing
from typing import Any

import typer
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from opd.config.loader import field_models

OVERRIDES_HELP = "Config overrides as dotted key=value pairs, e.g. `n=4 model.dtype=bf16` (applied last)."
CONFIG_HELP = "YAML file with config keys (see `configs/`); CLI options and key=value overrides take precedence."

_KEY = "opd_config_key"
"""The attribute of a typer option that names the config key it sets (read by `config_options`)."""


def overrides_argument() -> Any:
    """The positional `key=value` overrides of a config command."""
    return typer.Argument(help=OVERRIDES_HELP, show_default=False)


def config_file_option() -> Any:
    """`--config / -c file.yaml` of a config command."""
    return typer.Option("--config", "-c", help=CONFIG_HELP, exists=False, dir_okay=False)


def config_field(model: type[BaseModel], key: str) -> FieldInfo:
    """The pydantic field of dotted `key` in `model` (nested sections followed through their annotations)."""
    cls: Any = model
    field = None
    for part in key.split("."):
        field = cls.model_fields[part]
        models = field_models(field.annotation)
        cls = models[0] if models else None
    assert field is not None
    return field


def shown_default(field: FieldInfo) -> str | None:
    """The field's default as `--help` shows it (on/off, comma-joined lists); None where it has none or is None (the
    description says what None means)."""
    if field.default_factory is not None:
        value = field.default_factory()  # type: ignore[call-arg]
    else:
        value = None if field.default is PydanticUndefined else field.default
    if value is None or value == []:
        return None
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    if isinstance(value, float):
        return repr(value).replace("e-0", "e-")
    return str(value)


def field_help(model: type[BaseModel], key: str) -> str:
    """`<choices>: <description> (<key>). [default: <default>]` of config key `key` of `model`."""
    field = config_field(model, key)
    text = (field.description or "").rstrip(".")
    choices = _literal_choices(field.annotation)
    if choices and not all(choice in text for choice in choices):
        text = f"{' | '.join(choices)}: {text}"
    default = shown_default(field)
    return f"{text} ({key})." + (f" [default: {default}]" if default is not None else "")


def help_with_key(key: str, text: str) -> str:
    """`text` with the config key it sets put before its `[default: …]`: `Seed. [default: 0]` → `Seed (seed).
    [default: 0]`."""
    head, marker, tail = text.partition(" [default:")
    return f"{head.rstrip('.')} ({key})." + (marker + tail if marker else "")


def _literal_choices(annotation: Any) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(arg) for arg in typing.get_args(annotation)]
    return [choice for arg in typing.get_args(annotation) for choice in _literal_choices(arg)]


def field_option(model: type[BaseModel], key: str, *param_decls: str) -> Any:
    """A typer option that sets config key `key` of `model`: help and shown default from the field, value None when
    not given."""
    return config_option(key, *param_decls, help=field_help(model, key))


def config_option(key: str, *param_decls: str, help: str) -> Any:  # noqa: A002 - typer's own name for it
    """A typer option that sets config key `key`, with its help written by the caller (the thinking switch, whose
    spelling every command shares)."""
    option = typer.Option(*param_decls, help=help, show_default=False)
    setattr(option, _KEY, key)
    return option


def config_options(ctx: typer.Context) -> dict[str, Any]:
    """The config keys the command's options set, {dotted key: value}; None (not given) for the others. Paths become
    strings and an empty repeatable option None."""
    callback = inspect.unwrap(ctx.command.callback)  # type: ignore[arg-type]
    options = {}
    for name, hint in typing.get_type_hints(callback, include_extras=True).items():
        key = next((getattr(m, _KEY) for m in getattr(hint, "__metadata__", ()) if hasattr(m, _KEY)), None)
        if key is not None:
            options[key] = _plain(ctx.params.get(name))
    return options


def _plain(value: Any) -> Any:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return list(value) or None
    return value


THINKING_HELP = "Thinking on/off: enable_thinking of the chat template (Qwen3){key}. [default: the template's own]"


def thinking_option(key: str, note: str = "") -> Any:
    """The one spelling of the thinking switch in every command: `--thinking` / `--no-thinking` (as every other
    on/off option of opd). `--thinking on|off`, `opd rollout`'s earlier spelling, still works for one release
    (rewritten by `legacy_thinking`)."""
    shown = f" ({key}; {note})" if note else f" ({key})"
    return config_option(key, "--thinking/--no-thinking", help=THINKING_HELP.format(key=shown))


_ON_OFF = {"on": True, "true": True, "yes": True, "1": True, "off": False, "false": False, "no": False, "0": False}


def legacy_thinking(args: list[str]) -> list[str]:
    """`--thinking on|off` (and `--thinking=on`), the spelling `opd rollout` had, → `--thinking` / `--no-thinking`,
    with a note on stderr; kept for one release. A word after `--thinking` that is neither on/off nor an option nor a
    key=value override is a usage error naming it (it would otherwise be read as a malformed override)."""
    out, i = [], 0
    while i < len(args):
        arg = args[i]
        value = arg.split("=", 1)[1] if arg.startswith("--thinking=") else None
        if arg == "--thinking" and i + 1 < len(args) and not args[i + 1].startswith("-") and "=" not in args[i + 1]:
            value, i = args[i + 1], i + 1
        if value is not None:
            if value.lower() not in _ON_OFF:
                raise ValueError(f"--thinking takes no value, got {value!r}; use --thinking or --no-thinking")
            flag = "--thinking" if _ON_OFF[value.lower()] else "--no-thinking"
            typer.echo(f"note: '--thinking {value}' is deprecated and goes in the next release; use {flag}", err=True)
            arg = flag
        out.append(arg)
        i += 1
    return out


def parse_names(value: str | None) -> list[str] | None:
    """A comma-separated option as its list of names; None when not given."""
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def parse_seeds(value: str | None) -> list[int] | None:
    """`--seeds 0,1,2` as integers; None when not given."""
    try:
        return [int(s) for s in value.split(",") if s.strip()] if value else None
    except ValueError:
        raise ValueError(f"--seeds must be comma-separated integers, got {value!r}") from None
