"""What each validation image is drawn with: prompt, negative prompt, steps, guidance scale, seed, size.

::

    --sample-prompt TEXT (repeatable)        ─┐  each prompt with the run's --validation-negative-prompt,
    --sample-prompts FILE (kohya's format)   ─┴▶ --num-inference-steps, --guidance-scale, --validation-seed
        a castle --n blurry --s 30 --l 7.5 --d 1234 --w 512 --h 512        (a line's own options win)
                                              ─▶ [ValidationPrompt, ...]  ─▶ the backend's pipeline call

The file is read as kohya-ss sd-scripts' ``--sample_prompts`` (``library/train_util.py``:
``load_prompts``, ``line_to_prompt_dict``): a ``.txt`` file holds one prompt a line (blank lines and
lines starting with ``#`` skipped), options after `` --``: ``n`` negative prompt, ``s`` steps (kept
in 1..1000, as kohya), ``l`` guidance scale, ``d`` seed, ``w`` / ``h`` width and height; a ``.json``
file a list of such lines or of objects with kohya's keys (prompt, negative_prompt, sample_steps,
scale, seed, width, height). An option PULSE does not draw with (kohya's sampler ``ss``, ``cn``, ...)
is refused in one line rather than dropped without a word. Framework-free.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

from pulse.errors import PulseError

# kohya's option letters -> (field, parse); the order of kohya's own matches ("ss" is not "s")
_OPTIONS: dict[str, tuple[str, Any]] = {
    "w": ("width", int), "h": ("height", int), "d": ("seed", int),
    "s": ("steps", lambda v: max(1, min(1000, int(v)))), "l": ("guidance_scale", float),
    "n": ("negative_prompt", str),
}
_OPTION = re.compile(r"^(\w+) (.+)$", re.DOTALL)
_JSON_KEYS = {"prompt": "prompt", "negative_prompt": "negative_prompt", "sample_steps": "steps",
              "scale": "guidance_scale", "seed": "seed", "width": "width", "height": "height"}
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit seed


@dataclass(frozen=True)
class ValidationPrompt:
    """One prompt's drawing settings; None: the run's default (then the pipeline's)."""

    prompt: str
    negative_prompt: str | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    seed: int | None = None
    width: int | None = None
    height: int | None = None

    def call_arguments(self) -> dict[str, Any]:
        """The diffusers pipeline call's keyword arguments this prompt sets (what it leaves None is the pipeline's)."""
        named = {"negative_prompt": self.negative_prompt, "num_inference_steps": self.steps,
                 "guidance_scale": self.guidance_scale, "width": self.width, "height": self.height}
        return {k: v for k, v in named.items() if v is not None}


def parse_prompt_line(line: str, where: str = "prompt") -> ValidationPrompt:
    """One kohya prompt line: ``text --n negative --s 30 --l 7.5 --d 1234 --w 512 --h 512``."""
    text, *options = line.strip().split(" --")
    settings: dict[str, Any] = {}
    for option in options:
        match = _OPTION.match(option.strip())
        name = match.group(1).lower() if match else option.strip()
        if match is None or name not in _OPTIONS:
            raise PulseError(f"{where}: option '--{option.strip()}' is not one PULSE draws with; a prompt line takes "
                             "--n NEGATIVE, --s STEPS, --l GUIDANCE, --d SEED, --w WIDTH, --h HEIGHT (kohya's format)")
        field, parse = _OPTIONS[name]
        try:
            settings[field] = parse(match.group(2).strip())
        except ValueError:
            raise PulseError(f"{where}: '--{option.strip()}' needs a number after --{name}") from None
    return checked(ValidationPrompt(text.strip(), **settings), where)


def checked(prompt: ValidationPrompt, where: str) -> ValidationPrompt:
    """``prompt`` if its numbers can draw an image, else one line saying which is wrong."""
    if not prompt.prompt:
        raise PulseError(f"{where}: the prompt text is empty")
    for name in ("width", "height"):
        value = getattr(prompt, name)
        if value is not None and not 8 <= value <= 16384:
            raise PulseError(f"{where}: {name} {value} is outside 8..16384 pixels")
    if prompt.seed is not None and not 0 <= prompt.seed <= MAX_SEED:
        raise PulseError(f"{where}: seed {prompt.seed} is outside 0..2^63-1")
    if prompt.guidance_scale is not None and not 0.0 <= prompt.guidance_scale <= 1e3:
        raise PulseError(f"{where}: guidance scale {prompt.guidance_scale} is outside 0..1000")
    return prompt


def read_prompt_file(path: str | Path) -> list[ValidationPrompt]:
    """Every prompt of a kohya ``--sample_prompts`` file (.txt lines, or a .json list of lines or objects)."""
    path = Path(path)
    if path.exists() and not path.is_file():  # a named pipe would block the read forever
        raise PulseError(f"--sample-prompts {path}: not a regular file; name a .txt or .json prompt file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PulseError(f"--sample-prompts {path}: cannot read it ({exc.__class__.__name__}: {exc})") from None
    if path.suffix.lower() == ".json":
        prompts = _json_prompts(text, path)
    else:
        prompts = [parse_prompt_line(line, f"{path}:{n}") for n, line in enumerate(text.splitlines(), 1)
                   if line.strip() and not line.startswith("#")]
    if not prompts:
        raise PulseError(f"--sample-prompts {path}: no prompt in it (one a line; '#' starts a comment)")
    return prompts


def _json_prompts(text: str, path: Path) -> list[ValidationPrompt]:
    try:
        items = json.loads(text)
    except ValueError as exc:
        raise PulseError(f"--sample-prompts {path}: not JSON ({exc})") from None
    if not isinstance(items, list):
        raise PulseError(f"--sample-prompts {path}: a JSON prompt file holds a list of prompts")
    prompts = []
    for n, item in enumerate(items):
        where = f"{path}: item {n}"
        if isinstance(item, str):
            prompts.append(parse_prompt_line(item, where))
            continue
        unknown = sorted(set(item) - set(_JSON_KEYS)) if isinstance(item, dict) else None
        if unknown is None or unknown or not isinstance(item.get("prompt"), str):
            raise PulseError(f"{where}: a prompt is a line or an object with 'prompt' and kohya's keys "
                             f"({', '.join(_JSON_KEYS)}){'; unknown: ' + ', '.join(unknown) if unknown else ''}")
        try:
            prompts.append(checked(ValidationPrompt(**{_JSON_KEYS[k]: v for k, v in item.items()}), where))
        except TypeError as exc:
            raise PulseError(f"{where}: {exc}") from None
    return prompts


def validation_prompts(texts: Sequence[str], prompt_file: str | None, negative_prompt: str | None = None,
                       steps: int | None = None, guidance_scale: float | None = None,
                       seed: int | None = None) -> list[ValidationPrompt]:
    """The run's prompts (the file's, else the texts), each setting a line left out taken from the run's."""
    prompts = read_prompt_file(prompt_file) if prompt_file else [ValidationPrompt(t) for t in texts]
    defaults = {"negative_prompt": negative_prompt, "steps": steps, "guidance_scale": guidance_scale, "seed": seed}
    return [replace(p, **{k: v for k, v in defaults.items() if getattr(p, k) is None}) for p in prompts]
