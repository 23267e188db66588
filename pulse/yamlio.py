"""Safe YAML/JSON reading and atomic writing, with errors that name the file."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml

from pulse.errors import PulseError

# LibYAML's parser and emitter where PyYAML was built with it (its wheels are): the same safe
# constructor and representer in Python, the scanning and emitting in C, 7-9x faster on a plan or a
# cost table (a 6.7 kB profile: 42 -> 4.8 ms to read). Its dumps read back as the data under both
# parsers, and PULSE's own files dump to the same text. A text LibYAML refuses is read again by the
# pure parser, whose verdict and message stand: they name the offending character or alias where
# LibYAML's do not, and it accepts a few texts LibYAML refuses (a lone surrogate escape). LibYAML
# reads a few valid texts the pure parser refused (a tab inside a flow collection). tests/test_yaml_libyaml.py
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
SAFE_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


def load_mapping(path: str | Path) -> dict[str, Any]:
    """Read a YAML (or JSON) file that must hold a mapping.

    YAML goes through ``yaml.safe_load`` only (no ``!!python/...`` tags); a key
    written twice in one mapping is refused rather than silently overwritten.
    """
    path = Path(path)
    text = read_text(path)
    if path.suffix == ".json":
        try:
            data = json.loads(text, object_pairs_hook=_unique_json_pairs)
        except json.JSONDecodeError as exc:
            raise PulseError(f"{path}: malformed JSON at line {exc.lineno}, column {exc.colno}: {exc.msg}") from None
        except _DuplicateKey as exc:
            raise PulseError(f"{path}: key '{_flat(exc.key)}' is written twice in one mapping; keep one") from None
        except RecursionError:
            raise PulseError(f"{path}: JSON nested too deeply") from None
        except ValueError as exc:  # an integer of thousands of digits (Python's int-string conversion limit)
            raise PulseError(f"{path}: {_too_long_number(exc)}") from None
        if not isinstance(data, dict):
            raise PulseError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
        return data
    try:
        data, duplicate = _parse_yaml(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or getattr(exc, "reason", None) or "malformed YAML"
        if isinstance(exc, yaml.reader.ReaderError):
            where = f" at position {exc.position}"
        problem = " ".join(str(problem).split())
        if "python/" in problem:
            problem += " (only plain YAML is read: Python tags are refused)"
        raise PulseError(f"{path}: malformed YAML{where}: {problem}; fix the syntax") from None
    except RecursionError:
        raise PulseError(f"{path}: YAML nested too deeply") from None
    except ValueError as exc:  # an integer of thousands of digits (Python's int-string conversion limit)
        raise PulseError(f"{path}: {_too_long_number(exc)}") from None
    if duplicate:
        key, line = duplicate
        raise PulseError(f"{path}: key '{_flat(key)}' is written twice in one mapping (line {line}); keep one")
    if not isinstance(data, dict):
        raise PulseError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _too_long_number(exc: ValueError) -> str:
    digits = re.search(r"value has (\d+) digits", str(exc))
    return (f"a number of {digits.group(1) if digits else 'too many'} digits; no setting needs one that long "
            "(fix the file)") if digits or "digits" in str(exc) else f"unreadable value ({' '.join(str(exc).split())[:120]})"


def read_text(path: str | Path) -> str:
    """A file's text, or a PulseError naming the file (missing, unreadable, not UTF-8)."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a named pipe would block the open forever; a device never ends
        what = "a folder" if path.is_dir() else "a pipe, socket or device, not a regular file"
        raise PulseError(f"{path}: cannot read {what}; name a YAML or JSON file")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PulseError(f"{path}: no such file; check the path") from None
    except UnicodeDecodeError as exc:
        raise PulseError(f"{path}: not UTF-8 text (byte {exc.start}); is this the right file?") from None
    except OSError as exc:
        raise PulseError(f"{path}: cannot read ({exc.strerror or exc})") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_json_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _parse_yaml(text: str) -> tuple[Any, tuple[str, int] | None]:
    """``yaml.safe_load(text)`` and, when it is a mapping, its first repeated key (``_duplicate_yaml_key``),
    from one parse: the text is composed into nodes once, checked, then constructed (safely)."""
    try:
        return _parse_with(SAFE_LOADER, text)
    except yaml.YAMLError:
        if SAFE_LOADER is yaml.SafeLoader:
            raise
    return _parse_with(yaml.SafeLoader, text)


def _parse_with(loader_class: type, text: str) -> tuple[Any, tuple[str, int] | None]:
    loader = loader_class(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    finally:
        loader.dispose()
    return data, (_duplicate_yaml_key(root) if isinstance(data, dict) else None)


def _duplicate_yaml_key(root: yaml.Node) -> tuple[str, int] | None:
    """(key, line) of the first key repeated within one YAML mapping, if any.

    Walks the composed node graph (nodes, never Python objects: as safe as
    ``safe_load``); ``<<`` merge keys are exempt.
    """
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys: set[tuple[str, str]] = set()
            for key_node, value_node in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    ident = (key_node.tag, key_node.value)
                    if ident in keys:
                        return key_node.value, key_node.start_mark.line + 1
                    keys.add(ident)
                stack += [key_node, value_node]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return None


def check_keys(data: dict, required: set[str], optional: set[str], where: str) -> None:
    """Reject missing and unknown keys with one clear line."""
    missing = sorted(required - data.keys())
    if missing:
        raise PulseError(f"{where}: missing key '{missing[0]}' (required: {', '.join(sorted(required))})")
    unknown = sorted(data.keys() - required - optional, key=str)
    if unknown:
        allowed = ", ".join(sorted(required | optional))
        raise PulseError(f"{where}: unknown key '{_flat(unknown[0])}' (allowed: {allowed})")


def require_number(data: dict, key: str, where: str, *, positive: bool = False, integer: bool = False,
                   allow_negative: bool = False):
    """A finite number (an int if ``integer``), >= 0 (any sign if ``allow_negative``), or > 0 if ``positive``."""
    value = data[key]
    if isinstance(value, str):
        # PyYAML (YAML 1.1) reads 1.0e9 without a sign as a string: accept it.
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PulseError(f"{where}: '{key}' must be a number, got {_show(value)}")
    if not math.isfinite(value):
        raise PulseError(f"{where}: '{key}' must be a finite number, got {value!r}")
    if integer and not float(value).is_integer():
        raise PulseError(f"{where}: '{key}' must be a whole number, got {value!r}")
    if positive and value <= 0:
        raise PulseError(f"{where}: '{key}' must be positive, got {value!r}")
    if not positive and not allow_negative and value < 0:
        raise PulseError(f"{where}: '{key}' must not be negative, got {value!r}")
    return int(value) if integer else float(value)


def require_text(data: dict, key: str, where: str) -> str:
    """A non-empty name on one line (quote names YAML would read as numbers, booleans or null)."""
    value = data[key]
    if not isinstance(value, str) or not value.strip():
        hint = " (quote it)" if value is None or isinstance(value, (bool, int, float)) else ""
        raise PulseError(f"{where}: '{key}' must be a non-empty text string, got {_show(value)}{hint}")
    if not value.isprintable():
        raise PulseError(f"{where}: '{key}' must be printable text on one line, got {_show(value)}")
    return value


def require_mapping(data: dict, key: str, where: str) -> dict:
    """A mapping with text keys; a missing or null value counts as empty."""
    value = data.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PulseError(f"{where}: '{key}' must be a mapping, got {_show(value)}")
    bad = [k for k in value if not isinstance(k, str)]
    if bad:
        raise PulseError(f"{where}: '{key}' has a non-text key {bad[0]!r}; quote it")
    return value


def require_list(data: dict, key: str, where: str, *, non_empty: bool = False) -> list:
    """A list; a missing or null value counts as empty (unless ``non_empty``)."""
    value = data.get(key)
    if value is None and not non_empty:
        return []
    if not isinstance(value, list) or (non_empty and not value):
        what = "a non-empty list" if non_empty else "a list"
        raise PulseError(f"{where}: '{key}' must be {what}, got {_show(value)}")
    return value


def _flat(value: Any) -> str:
    """Text for an error line: whitespace runs (newlines too) become one space."""
    return " ".join(str(value).split())


def _show(value: Any) -> str:
    """A value for an error line: its repr, cut short, on one line."""
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def dump_yaml(data: Any) -> str:
    return yaml.dump(data, Dumper=SAFE_DUMPER, sort_keys=False, default_flow_style=None, width=100)


def dump_json(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"
