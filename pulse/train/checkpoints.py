"""Checkpoints that survive a crash and load under another plan: the framework-free half.

::

    DIR/step-6/rank-0.pt ... rank-<W-1>.pt     each rank: its layers' parameters and optimizer state
                                                by parameter name ("<layer>.<param>"), its RNG
                                                states, the step and the data position
                                                (rank-<r>.npz from MindSpore: pulse_mindspore.checkpoint)
    DIR/step-6/manifest.json                    written last, by rank 0, once every rank file is
                                                on disk: files, sizes, sha256, layers per file,
                                                plan (model, pp, dp, placement, batch), run identity

A step directory without a manifest, or whose files do not match it, was
interrupted and is never loaded. Everything is keyed by layer name, so a rank
of another plan (other pp, placement, folds, dp) reads the layers it now owns
from whichever files hold them. Only replica 0 saves weights: data-parallel
replicas hold identical ones after every all-reduced step. This module finds,
checks, prunes and describes checkpoints and decides which one a run resumes;
what a rank file holds and how tensors are read is the backend's
(``pulse_torch.checkpoint``). Step directories assume a filesystem every rank
can read.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from pulse.errors import PulseError
from pulse.layout import Layout
from pulse.train.run_config import RunConfig

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_RANK_FILE = re.compile(r"^rank-\d+\.(pt|npz)$")  # the only names a manifest may list: inside its step folder
_TEMP_FILE = re.compile(r"^\.(rank-\d+\.(pt|npz)|manifest\.json)\..+$")  # write_atomic_bytes' leftovers


class CheckpointError(PulseError):
    """A checkpoint that cannot be written, found or loaded (one line, says which file)."""


def sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step}"


# -- housekeeping -----------------------------------------------------------------------------------
def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """Every ``step-<k>`` directory under ``root``, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir())


def remove_temp_files(root: Path, keep_step: int | None = None) -> list[Path]:
    """Delete the temporary files a crash left in step directories (not in ``keep_step``'s, being written)."""
    removed = []
    for step, path in step_dirs(root):
        if step == keep_step:
            continue
        for file in path.iterdir():
            if _TEMP_FILE.match(file.name) and file.is_file():
                file.unlink(missing_ok=True)
                removed.append(file)
    return removed


def prune(root: Path, keep: int, identity: Mapping[str, Any]) -> list[Path]:
    """Keep the newest ``keep`` complete checkpoints of this run; delete its older ones and older
    interrupted ones.

    Only what is provably this run's goes: a complete step whose manifest records ``identity``, or
    an interrupted step holding nothing but rank files and their temporaries. Never through a
    link: a linked ``root`` prunes nothing, a linked ``step-<k>`` is never touched (a folder merely
    named ``step-<k>``, another run's checkpoint or a link out of the run stays where it is).
    Rank 0 calls it after writing a manifest: every rank has finished its file by then.
    """
    if root.is_symlink():
        return []
    complete = []
    removed = []
    for step, path in reversed(step_dirs(root)):
        if path.is_symlink():
            continue
        try:
            manifest = check_step(path, step)
        except CheckpointError:
            if complete and _only_rank_files(path):  # an interrupted step older than a complete one: never resumed
                shutil.rmtree(path, ignore_errors=True)
                removed.append(path)
            continue
        if identity_mismatch(Found(step, path, manifest), identity):  # not this run's: not ours to delete
            continue
        complete.append(path)
        if len(complete) > keep:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _only_rank_files(path: Path) -> bool:
    """Whether a step folder holds only what a rank writes there (rank files, their temporaries)."""
    return all((_RANK_FILE.match(p.name) or _TEMP_FILE.match(p.name)) and not p.is_symlink() and p.is_file()
               for p in path.iterdir())


# -- finding the newest complete checkpoint -------------------------------------------------------
@dataclass(frozen=True)
class Found:
    step: int
    path: Path
    manifest: dict


def check_step(path: Path, step: int) -> dict:
    """The manifest of a complete step directory; ``CheckpointError`` saying what is wrong otherwise."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError("no manifest (interrupted while writing)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest["step"] != step or not isinstance(files, list):
            raise ValueError("step or file list mismatch")
        checks = [(path / f["name"], int(f["bytes"]), str(f["sha256"]), f["layers"]) for f in files]
        names = [str(f["name"]) for f in files]
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable manifest ({exc})") from None
    outside = [n for n in names if not _RANK_FILE.match(n)]
    if outside:  # '../step-5/rank-1.pt', '/etc/...': never read a file the step folder does not hold
        raise CheckpointError(f"manifest names '{outside[0][:80]}', not a rank-<r>.pt file of its own folder: refused")
    for file, size, sha, _ in checks:
        if not file.is_file():
            raise CheckpointError(f"{file.name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(f"{file.name} has {file.stat().st_size} bytes, the manifest says {size}")
        if sha256_of(file) != sha:
            raise CheckpointError(f"{file.name} does not match its sha256")
    return manifest


def find_latest(root: Path) -> tuple[Found | None, list[str]]:
    """The newest complete step under ``root`` and one note per newer step that was skipped."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        try:
            return Found(step, path, check_step(path, step)), skipped
        except CheckpointError as exc:
            skipped.append(f"{path.name}: {exc}")
    return None, skipped


def layer_files(found: Found) -> dict[str, str]:
    """Layer name -> the file (of this step) holding its parameters and optimizer state."""
    where: dict[str, str] = {}
    for f in found.manifest["files"]:
        for layer in f["layers"]:
            where.setdefault(layer, f["name"])
    return where


def files_of_layers(found: Found, chunk_layers: list[tuple[Any, str]]) -> dict[str, list[tuple[Any, str]]]:
    """The file of this step holding each (chunk, layer name), grouped by file; a layer no file holds
    (another model's checkpoint) is one line. The chunk is the backend's, carried along."""
    holders = layer_files(found)
    missing = [layer for _, layer in chunk_layers if layer not in holders]
    if missing:
        raise CheckpointError(f"{found.path}: holds no parameters for layers {missing} (another model?)")
    by_file: dict[str, list[tuple[Any, str]]] = {}
    for chunk, layer in chunk_layers:
        by_file.setdefault(holders[layer], []).append((chunk, layer))
    return by_file


# -- what the launcher records ------------------------------------------------------------------------
def layers_by_rank(plan: Any, spec: Any) -> dict[int, list[str]]:
    """Global rank -> the layers its file holds: its stage's chunks on replica 0, nothing elsewhere."""
    out = {}
    for rank in range(plan.pp * plan.dp):
        stage, replica = Layout(plan.pp, plan.dp, rank).stage, Layout(plan.pp, plan.dp, rank).replica
        chunks = [plan.placement.chunks[c] for c in plan.placement.chunks_of(stage)] if replica == 0 else []
        out[rank] = [layer.name for c in chunks for layer in spec.layers[c.start:c.end]]
    return out


def data_position(step: int, global_batch: int, num_samples: int) -> dict[str, int]:
    """Where the sample stream is after ``step`` steps (informative: the sampler is a function of step)."""
    seen = step * global_batch
    return {"step": step, "samples_seen": seen, "epoch": seen // num_samples, "index": seen % num_samples}


def run_identity(plan: Any, spec: Any, seed: int, data_name: str) -> dict[str, Any]:
    """What makes a checkpoint this run's: model (name, options, architecture), seed and data.

    The plan's pipeline (pp, dp, placement, folds) may change on resume: checkpoints reshard.
    """
    arch = hashlib.sha256(json.dumps([[layer.name, layer.params] for layer in spec.layers]).encode()).hexdigest()
    return {"model": plan.model, "model_options": dict(sorted(plan.model_options.items())),
            "architecture": arch[:16], "seed": seed, "data": data_name}


def identity_mismatch(found: Found, identity: Mapping[str, Any]) -> list[str]:
    """How the checkpoint's run differs from ``identity`` ("key: saved -> now" each); [] if it is this run's."""
    saved = found.manifest.get("identity")
    if not isinstance(saved, dict):
        return ["it records no run identity"]
    return [f"{key} {saved.get(key)!r} -> {value!r}" for key, value in identity.items() if saved.get(key) != value]


def manifest_info(plan: Any, spec: Any, seed: int, data: Mapping[str, int],
                  identity: Mapping[str, Any] | None = None, preempted: str | None = None,
                  optimizer: str = "adamw") -> dict[str, Any]:
    """What a manifest records beside its files; ``preempted``: the signal ("SIGTERM") whose stop wrote it;
    ``optimizer``: whose state the rank files hold (``--optimizer``)."""
    info = {"identity": dict(identity or {}), "plan": {"model": plan.model, "pp": plan.pp, "dp": plan.dp, "placement": plan.placement.kind,
                     "folds": plan.placement.folds, "microbatch_size": plan.microbatch_size,
                     "num_microbatches": plan.num_microbatches, "global_batch": plan.global_batch},
            "seed": seed, "data": dict(data), "layers": [layer.name for layer in spec.layers],
            "optimizer": optimizer}
    if preempted is not None:
        info["preempted"] = preempted
    return info


def describe_resume(found: Found, plan: Any, seed: int, skipped: Sequence[str]) -> str:
    """One line: which step resumes, what was skipped, and what differs from the saved plan."""
    saved = found.manifest.get("plan", {})
    line = f"resume: step {found.step} from {found.path}"
    if found.manifest.get("preempted"):
        line += f" (written when {found.manifest['preempted']} stopped the run)"
    if (saved.get("pp"), saved.get("dp"), saved.get("placement")) != (plan.pp, plan.dp, plan.placement.kind):
        line += (f"; resharding pp{saved.get('pp')} x dp{saved.get('dp')} {saved.get('placement')} -> "
                 f"pp{plan.pp} x dp{plan.dp} {plan.placement.kind}")
    if saved.get("global_batch") != plan.global_batch:
        line += (f"; global batch {saved.get('global_batch')} -> {plan.global_batch}: the sample stream "
                 "continues at step x new batch, not where it stopped")
    if found.manifest.get("seed") != seed:
        line += f"; seed {found.manifest.get('seed')} -> {seed}"
    if skipped:
        line += f"; ignored incomplete {', '.join(skipped)}"
    return line


def checkpoint_root(config: RunConfig, out_dir: Path) -> Path:
    return Path(config.checkpoint_dir) if config.checkpoint_dir else out_dir / "checkpoints"


LATEST = "latest"


def resume_target(value: str, default_root: Path) -> tuple[Path, int | None]:
    """Where ``--resume VALUE`` looks, and the step it names (None: the newest complete one).

    ``--resume`` / ``latest``: the run's checkpoint folder, newest; ``N``: step N there;
    ``DIR``: DIR's newest; ``DIR/step-N``: that step (diffusers' ``--resume_from_checkpoint`` takes
    ``latest`` or a checkpoint folder the same way)."""
    if value in ("", LATEST):
        return default_root, None
    if value.isdigit():
        return default_root, int(value)
    path = Path(value)
    named = re.match(r"^step-(\d+)$", path.name)
    if named and path.is_dir():
        return path.parent, int(named.group(1))
    return path, None


def find_step(root: Path, step: int) -> Found:
    """Step ``step`` under ``root``, complete; one line naming what is wrong otherwise."""
    path = step_dir(root, step)
    if not path.is_dir():
        have = ", ".join(str(k) for k, _ in step_dirs(root)) or "none"
        raise PulseError(f"--resume {step}: no checkpoint step-{step} in {root} (steps there: {have})")
    try:
        return Found(step, path, check_step(path, step))
    except CheckpointError as exc:
        raise PulseError(f"--resume {step}: {path} is not a complete checkpoint ({exc})") from None


def newest_of_run(root: Path, identity: Mapping[str, Any]) -> tuple[Found | None, list[str]]:
    """The newest complete step under ``root`` whose manifest records ``identity`` (this run's), and a
    note per newer step passed over (incomplete, or another run's)."""
    skipped = []
    for step, path in reversed(step_dirs(root)):
        try:
            found = Found(step, path, check_step(path, step))
        except CheckpointError as exc:
            skipped.append(f"{path.name}: {exc}")
            continue
        if not identity_mismatch(found, identity):
            return found, skipped
        skipped.append(f"{path.name}: another run's")
    return None, skipped


def find_resume(config: RunConfig, out_dir: Path, plan, identity: dict, lead: bool,
                restart: int = 0) -> tuple[Found | None, str]:
    """The checkpoint to resume from (None: start from step 0) and the line that says so.

    ``restart`` > 0: the launcher restarted the worker group after a failure (torchrun's
    ``TORCHELASTIC_RESTART_COUNT``): the newest complete checkpoint of this run (its identity; never
    another run's) resumes, ``--resume`` or not; with none yet, what the first start resumed."""
    if restart:
        root = checkpoint_root(config, out_dir)
        if lead:
            remove_temp_files(root)
        found, skipped = newest_of_run(root, identity)
        if found is not None:
            check_optimizer(found, config.optimizer)
            check_steps_left(found, config.steps)
            return found, f"{describe_resume(found, plan, config.seed, skipped)}; restart {restart}: resumed by itself"
    if config.resume is None:
        return None, f"resume: restart {restart}: no checkpoint of this run yet; starting from step 0" if restart else ""
    root, step = resume_target(config.resume, checkpoint_root(config, out_dir))
    if lead:  # a crash's temporary files; nobody writes here before this run does
        remove_temp_files(root)
    found, skipped = find_latest(root) if step is None else (find_step(root, step), [])
    if found is None:
        why = f" (ignored incomplete {', '.join(skipped)})" if skipped else ""
        if config.resume not in ("", LATEST) or skipped:  # named on purpose, or every one broken: not a fresh start
            raise PulseError(f"--resume {root}: no complete checkpoint there{why}; remove the broken step "
                             "folders to start from step 0")
        return None, f"resume: no checkpoint in {root}; starting from step 0"
    mismatch = identity_mismatch(found, identity)
    if mismatch and not config.resume_any:
        raise PulseError(f"--resume: {found.path} is another run's checkpoint ({'; '.join(mismatch)}); resume "
                         "this run's own checkpoints, or give --resume-any to continue from it anyway")
    check_optimizer(found, config.optimizer)
    check_steps_left(found, config.steps)
    line = describe_resume(found, plan, config.seed, skipped)
    return found, line + (f"; another run's, taken on --resume-any: {'; '.join(mismatch)}" if mismatch else "")


def check_optimizer(found: Found, optimizer: str) -> None:
    """Refuse to continue ``found`` with another optimizer than the one whose state it holds (a manifest
    from before ``--optimizer`` holds AdamW's)."""
    saved = found.manifest.get("optimizer", "adamw")
    if saved != optimizer:
        raise PulseError(f"--resume: {found.path} holds --optimizer {saved}'s state, but this run asks for "
                         f"--optimizer {optimizer}: resume with --optimizer {saved}, or start a new run")


def check_steps_left(found: Found, steps: int) -> None:
    if found.step >= steps:
        raise PulseError(f"--resume: the checkpoint in {found.path} is at step {found.step} but --steps is "
                         f"{steps}: nothing left to train (raise --steps)")
