"""Safe YAML/JSON reading and atomic writing, with errors that name the file."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import yaml

from pulse.errors import PulseError


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) file that must hold a mapping."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PulseError(f"{path}: no such file; check the path") from None
    except OSError as exc:
        raise PulseError(f"{path}: cannot read ({exc.strerror})") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PulseError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        if not isinstance(data, dict):
            raise PulseError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        return data
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "malformed YAML"
        raise PulseError(f"{path}: malformed YAML{where}: {problem}; fix the syntax") from None
    if not isinstance(data, dict):
        raise PulseError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def check_keys(data: dict, required: set[str], optional: set[str], where: str) -> None:
    """Reject missing and unknown keys with one clear line."""
    missing = sorted(required - data.keys())
    if missing:
        raise PulseError(f"{where}: missing key '{missing[0]}' (required: {', '.join(sorted(required))})")
    unknown = sorted(data.keys() - required - optional)
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        raise PulseError(f"{where}: unknown key '{unknown[0]}' (allowed: {allowed})")


def require_number(data: dict, key: str, where: str, *, positive: bool = False, integer: bool = False):
    value = data[key]
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads 1.0e9 without a sign as a string: accept it.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PulseError(f"{where}: '{key}' must be a number, got {value!r}")
    if integer and not float(value).is_integer():
        raise PulseError(f"{where}: '{key}' must be a whole number, got {value!r}")
    if positive and value <= 0:
        raise PulseError(f"{where}: '{key}' must be positive, got {value!r}")
    if not positive and value < 0:
        raise PulseError(f"{where}: '{key}' must not be negative, got {value!r}")
    return int(value) if integer else float(value)


def write_atomic(path: str | Path, text: str) -> None:
    """Write via a temporary file in the same folder, fsync, rename: never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; a config file should be readable like any other
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=100)


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"
