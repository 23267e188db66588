"""A diffusers pipeline folder with a new backbone, written whole or not at all (every backend's export).

::

    out/.. /.OUT.tmp-<pid>/   every part of the input pipeline but the backbone, copied as it is
                  <backbone>/ written by the backend (torch: save_pretrained; MindSpore: config.json
                              copied + safetensors by diffusers' names)
    rename .OUT.tmp-<pid> ─▶ OUT        (an OUT that exists is complete; an existing OUT is refused)

Framework-free: the backend hands in the function that fills the backbone folder.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Callable, Mapping

from pulse.data.pipeline_folder import PipelineFolder
from pulse.errors import PulseError


def check_new_folder(out: Path, flag: str = "--out") -> None:
    """Refuse an existing export target (said before any training or writing, by every entry)."""
    if out.exists() or out.is_symlink():  # a dangling link too: never written through
        raise PulseError(f"{flag}: '{out}' exists: choose a new folder (export never overwrites)")
    if not out.parent.is_dir():  # the new folder is asked for, its parents are not
        raise PulseError(f"{flag}: no folder '{out.parent}'; create it first (PULSE makes no folder it was not "
                         "asked for)")


def check_backbone_tensors(want: Mapping[str, tuple[int, ...]], got: Mapping[str, tuple[int, ...]], where: str,
                           backbone: Path, error: type[PulseError] = PulseError) -> None:
    """``got`` (trained tensors' shapes by diffusers name) is exactly the backbone's ``want``: one line if not."""
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    if missing or extra:
        first = f"lacks '{missing[0]}'" if missing else f"holds '{extra[0]}', which the backbone has not"
        raise error(f"{where}: {len(missing)} parameter(s) missing, {len(extra)} unknown: it {first} "
                    f"({backbone}): another model's weights?")
    for name, shape in want.items():
        if tuple(got[name]) != tuple(shape):
            raise error(f"{where}: '{name}' has shape {tuple(got[name])}, {backbone}'s is {tuple(shape)}")


def write_pipeline_folder(folder: PipelineFolder, out: Path, write_backbone: Callable[[Path], None]) -> None:
    """``out``: ``folder``'s other parts copied, ``write_backbone(temp/<backbone>)`` for the backbone.

    Built beside ``out`` and renamed when whole, so a crash leaves no half-written pipeline.
    """
    check_new_folder(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    try:
        skip = folder.backbone_name
        shutil.copytree(folder.root, temp, ignore=lambda d, names: [skip] if Path(d) == folder.root else [])
        write_backbone(temp / skip)
        os.rename(temp, out)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
