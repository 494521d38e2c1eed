"""Load the config from YAML plus ``KVSTORE_*`` environment overrides.

``KVSTORE_<SECTION>__<FIELD>`` sets a field of a section, ``KVSTORE_<FIELD>`` a
top-level field (``KVSTORE_CONNECTOR=sidecar``, ``KVSTORE_TIERS=host,lmdb``: a
list field takes a comma list) and ``KVSTORE_CONFIG`` names the config file when
the caller gives none. An unknown field of a known section is an error (the
variable is plainly meant for kvstore, so it is a typo); any other unknown
``KVSTORE_*`` variable is logged as a warning naming the closest field, since it
may belong to another tool (``KVSTORE_TEST_*`` belong to the test suite and are
left alone).

Every failure becomes one :class:`ConfigError` listing *all* problems, each
naming the file (or environment variable), the field path, what was given and
what is allowed; never a raw traceback.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kvstore.config.removed import replacement
from kvstore.config.schema import KVStoreConfig
from kvstore.errors import KVStoreError

ENV_PREFIX = "KVSTORE_"
_ENV_SEP = "__"
CONFIG_PATH_VAR = "KVSTORE_CONFIG"
"""Names the config file when the caller passes no path."""
_NOT_CONFIG_PREFIXES = (CONFIG_PATH_VAR, "KVSTORE_TEST_")

log = logging.getLogger(__name__)


class ConfigError(KVStoreError):
    """The config is invalid. ``problems`` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"invalid config {source}:\n{lines}")


def env_overrides(environ: Mapping[str, str]) -> dict[tuple[str, ...], tuple[str, Any]]:
    """Field path -> (variable name, parsed value) for every ``KVSTORE_*`` config variable.

    Values are parsed as YAML scalars, so ``true``, ``12`` and ``null`` get
    their types; ``4GiB`` stays a string for the size parser. A string given
    for a top-level list field is a comma list. A variable without ``__`` that
    names no top-level field is skipped with a logged warning.
    """
    out: dict[tuple[str, ...], tuple[str, Any]] = {}
    top_level = KVStoreConfig.model_fields
    for name, raw in environ.items():
        if not name.startswith(ENV_PREFIX) or name.startswith(_NOT_CONFIG_PREFIXES):
            continue
        path = tuple(part.lower() for part in name[len(ENV_PREFIX) :].split(_ENV_SEP))
        if len(path) == 1 and path[0] not in top_level:
            _warn_unknown(name)
            continue
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if len(path) == 1 and isinstance(value, str) and getattr(top_level[path[0]].annotation, "__origin__", None) is list:
            value = [item.strip() for item in value.split(",") if item.strip()]
        out[path] = (name, value)
    return out


def _warn_unknown(name: str) -> None:
    fields: list[str] = []
    for top, field in KVStoreConfig.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            fields += [f"{ENV_PREFIX}{top}{_ENV_SEP}{sub}".upper() for sub in ann.model_fields]
        else:
            fields.append(f"{ENV_PREFIX}{top}".upper())
    hint = difflib.get_close_matches(name, [*fields, CONFIG_PATH_VAR], n=1)
    log.warning("ignoring environment variable %s: it names no config field%s", name,
                f"; did you mean {hint[0]}?" if hint else "")


def _read_yaml(path: Path) -> dict[str, Any]:
    source = str(path)
    if not path.exists():
        raise ConfigError(source, ["no such file"])
    if path.is_dir():
        raise ConfigError(source, ["is a directory, expected a YAML file"])
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(source, [f"cannot read file: {exc}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(source, [f"not valid YAML: {where}{problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(source, [f"top level must be a mapping of sections, got {type(data).__name__}"])
    return data


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model that ``loc`` (the parent of an unknown key) points into."""
    model: type[BaseModel] | None = KVStoreConfig
    for part in loc:
        if model is None:
            return []
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return list(model.model_fields) if model is not None else []


def _format_errors(exc: ValidationError, env_names: dict[tuple[str, ...], str]) -> list[str]:
    problems: list[str] = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        dotted = ".".join(loc) if loc else "(top level)"
        origin = f" (from environment variable {env_names[loc]})" if loc in env_names else ""
        if err["type"] == "extra_forbidden" and replacement(dotted) is not None:
            problems.append(f"'{dotted}'{origin} was removed: {replacement(dotted)}")
            continue
        if err["type"] == "extra_forbidden":
            allowed = _allowed_keys(loc[:-1])
            hint = difflib.get_close_matches(loc[-1], allowed, n=1)
            msg = f"unknown key '{dotted}'{origin}"
            if hint:
                msg += f"; did you mean '{'.'.join((*loc[:-1], hint[0]))}'?"
            if allowed:
                msg += f" (allowed here: {', '.join(allowed)})"
            problems.append(msg)
            continue
        given = err.get("input")
        msg = err["msg"].removeprefix("Value error, ")
        hide = err["type"] == "missing" or isinstance(given, dict) or "(got " in msg
        shown = "" if hide else f" (got {given!r})"
        problems.append(f"{dotted}: {msg}{shown}{origin}")
    return problems


def _apply_override(data: dict[str, Any], path: tuple[str, ...], value: Any, var: str, source: str) -> None:
    node: Any = data
    for part in path[:-1]:
        child = node.get(part) if isinstance(node, dict) else None
        if child is None:
            child = {}
            node[part] = child
        if not isinstance(child, dict):
            raise ConfigError(source, [f"{var}: cannot set '{'.'.join(path)}' because '{part}' is not a section"])
        node = child
    node[path[-1]] = value


def parse_config(data: Mapping[str, Any], source: str = "<dict>", environ: Mapping[str, str] | None = None) -> KVStoreConfig:
    """Validate a mapping (plus env overrides from ``environ``) into a :class:`KVStoreConfig`."""
    merged: dict[str, Any] = _deep_copy(dict(data))
    overrides = env_overrides(environ or {})
    env_names: dict[tuple[str, ...], str] = {}
    for path, (var, value) in sorted(overrides.items()):
        _apply_override(merged, path, value, var, source)
        env_names[path] = var
    try:
        return KVStoreConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(source, _format_errors(exc, env_names)) from None


def config_file(path: str | os.PathLike[str] | None = None,
                environ: Mapping[str, str] | None = None) -> str | None:
    """The file :func:`load_config` reads for ``path``: ``path``, else ``$KVSTORE_CONFIG``, else ``None`` (defaults)."""
    env = os.environ if environ is None else environ
    if path is None and env.get(CONFIG_PATH_VAR):
        return env[CONFIG_PATH_VAR]
    return None if path is None else os.fspath(path)


def load_config(path: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None) -> KVStoreConfig:
    """Read ``path`` (else ``$KVSTORE_CONFIG``, else use all defaults), apply env overrides, validate.

    ``environ`` defaults to ``os.environ``. Raises :class:`ConfigError`.
    """
    env = os.environ if environ is None else environ
    source_suffix = f" (from {CONFIG_PATH_VAR})" if path is None and env.get(CONFIG_PATH_VAR) else ""
    path = config_file(path, env)
    if path is None:
        return parse_config({}, "<defaults>", env)
    p = Path(path)
    source = f"{p}{source_suffix}"
    try:
        data = _read_yaml(p)
    except ConfigError as exc:
        raise ConfigError(source, exc.problems) from None
    return parse_config(data, source, env)


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
