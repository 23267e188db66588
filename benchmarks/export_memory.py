"""What `pulse export` holds in memory: its peak above its own baseline, on a UNet of a chosen size.

    .venv/bin/python benchmarks/export_memory.py [--scale 1.0] [--stored-dtype F32] [--max-shard-gb 10]
                                                 [--compare-merge] [--workdir DIR]

::

    benchmarks/sd2_unet_config.json (stabilityai/stable-diffusion-2's UNet, 865,910,724 parameters),
    its block_out_channels times --scale (norm groups kept dividing them)
      ─ a config-only pipeline folder: model_index.json + unet/config.json + unet/ weights (random, in
        --stored-dtype, written tensor by tensor: the folder's dtype is what export casts to)
      ─ step-1/ as the trainer writes it for pp 2: rank-0.pt, rank-1.pt (params, AdamW exp_avg / exp_avg_sq /
        step, RNG, data position; the parameters split in order at the middle) + manifest.json (sizes, sha256)
      ─ child process: imports torch, diffusers, transformers, pulse_torch.export (its baseline), resets its
        peak (/proc/self/clear_refs), samples /proc/self/status every 2 ms, runs `pulse export`'s main
      ─ every exported tensor checked against the rank files, one at a time

Two peaks, both above the child's baseline:
- resident (VmHWM - VmRSS at the start): everything resident, including the pages of the mapped rank
  files export has read (clean file pages: the kernel can drop them at any moment, and they are the page
  cache's, not the process's own). The exporter drops a mapping every 256 MiB handed out, so this stays
  near that window plus one tensor.
- anonymous (RssAnon, sampled): the process's own memory, what it cannot give back. The target,
  an SD v2-size export below 1.5 GiB above its baseline, applies to this one; the resident peak is
  reported next to it, and meets it too.
``--compare-merge`` adds a row for what the old export's first step alone held: ``merge_weights`` (every
tensor of every rank file cloned into one dict). Writes benchmarks/results/export_memory.json (one entry
per command line, the latest run of each).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SD2_CONFIG = Path(__file__).with_name("sd2_unet_config.json")
RESULTS = ROOT / "benchmarks" / "results" / "export_memory.json"
TARGET_BYTES = int(1.5 * 2**30)
STATUS_KEYS = ("VmRSS", "VmHWM", "RssAnon", "RssFile")


# -- the child: one measured export -------------------------------------------------------------------
def status() -> dict[str, int]:
    """/proc/self/status' memory lines, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in STATUS_KEYS:
                out[key] = int(value.split()[0]) * 1024
    return out


class AnonPeak(threading.Thread):
    """RssAnon every ``every`` seconds (the kernel keeps no peak of it, only of the whole resident set)."""

    def __init__(self, every: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.every, self.peak, self.done = every, 0, threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, status()["RssAnon"])
            time.sleep(self.every)

    def stop(self) -> int:
        self.done.set()
        self.join()
        return max(self.peak, status()["RssAnon"])


def child(mode: str, argv: list[str]) -> None:
    """Measure one export (``mode`` "export": what `pulse export` runs, ``argv`` = step folder, pipeline,
    out, shard bytes; "merge": the old merge_weights, ``argv`` = step folder, step)."""
    import diffusers  # noqa: F401 - what an export imports, before the baseline
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from pulse.data.pipeline_folder import read_pipeline
    from pulse_torch.checkpoint import merge_weights
    from pulse_torch.export import check_model, export_step, find_step
    from pulse_torch.pipeline.encode import quiet

    quiet()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS now: the peak from here on
        f.write("5")
    base = status()
    sampler = AnonPeak()
    sampler.start()
    began = time.perf_counter()
    held = None
    if mode == "export":  # pulse_torch.export.export, with the shard size the entry has no flag for
        folder = read_pipeline(argv[1])
        step, where, manifest = find_step(Path(argv[0]))
        check_model(manifest, where, folder)
        print(export_step(folder, step, where, Path(argv[2]), False, manifest, int(argv[3])), file=sys.stderr)
    else:
        held = merge_weights(Path(argv[0]), int(argv[1]))
    seconds = time.perf_counter() - began
    anon_peak = sampler.stop()
    end = status()
    del held
    print(json.dumps({"seconds": seconds, "baseline_rss": base["VmRSS"], "baseline_anon": base["RssAnon"],
                      "resident_peak_above_baseline": end["VmHWM"] - base["VmRSS"],
                      "anon_peak_above_baseline": anon_peak - base["RssAnon"]}))


# -- the parent: the folders, the checkpoint, the child, the table --------------------------------------
def unet_config(scale: float) -> dict:
    config = json.loads(SD2_CONFIG.read_text())
    if scale != 1.0:
        channels = [int(round(c * scale / 16)) * 16 for c in config["block_out_channels"]]
        config["block_out_channels"] = channels
        config["norm_num_groups"] = math.gcd(config["norm_num_groups"], *channels)
    return config


def meta_model(config: dict):
    import diffusers
    import torch

    with torch.device("meta"):
        return diffusers.UNet2DConditionModel.from_config(config)


def write_pipeline(folder: Path, config: dict, stored: str, seed: int) -> None:
    """model_index.json + unet/config.json + unet's random weights in ``stored``, tensor by tensor."""
    import torch

    from pulse.backbone_shards import TensorInfo, write_backbone_weights
    from pulse_torch.backbone_files import TORCH_DTYPES, stored_bytes

    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline",
                                                         "unet": ["diffusers", "UNet2DConditionModel"]}))
    (folder / "unet" / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    infos = [TensorInfo(n, stored, tuple(p.shape)) for n, p in meta_model(config).named_parameters()]
    gen = torch.Generator().manual_seed(seed)
    write_backbone_weights(folder / "unet", infos, lambda i: stored_bytes(
        torch.randn(i.shape, generator=gen, dtype=torch.float32).to(TORCH_DTYPES[stored]), i))


def sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            sha.update(block)
    return sha.hexdigest()


def write_checkpoint(run: Path, unet: Path, config: dict, seed: int, pp: int = 2) -> Path:
    """step-1/ as ``pulse_torch.checkpoint.save`` writes it for ``pp`` stages (one replica)."""
    import torch

    from pulse.train.checkpoints import FORMAT, MANIFEST
    from pulse_torch.checkpoint import rng_state

    where = run / "checkpoints" / "step-1"
    where.mkdir(parents=True)
    names = [(n, tuple(p.shape)) for n, p in meta_model(config).named_parameters()]
    cut = [round(len(names) * r / pp) for r in range(pp + 1)]
    gen = torch.Generator().manual_seed(seed + 1)
    files = []
    for rank in range(pp):
        mine = names[cut[rank]:cut[rank + 1]]
        layers = sorted({".".join(n.split(".")[:2]) for n, _ in mine})
        params = {n: torch.randn(s, generator=gen) for n, s in mine}
        # the moments' values do not matter to export; empty memory is never touched, so it costs nothing here
        optimizer = {n: {"step": torch.tensor(1.0), "exp_avg": torch.empty(s), "exp_avg_sq": torch.empty(s)}
                     for n, s in mine}
        payload = {"pulse_checkpoint": FORMAT, "step": 1, "rank": rank, "layers": layers, "params": params,
                   "ema": {}, "ema_steps": 0, "optimizer": optimizer, "rng": rng_state(),
                   "data": {"epoch": 0, "offset": 2}}
        path = where / f"rank-{rank}.pt"
        torch.save(payload, path)
        del payload, params, optimizer
        files.append({"name": path.name, "rank": rank, "bytes": path.stat().st_size, "sha256": sha256(path),
                      "layers": layers})
    manifest = {"pulse_checkpoint": FORMAT, "step": 1, "identity": {"model": f"diffusers:{unet}"},
                "model": f"diffusers:{unet}", "files": files}
    (where / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return where


def measure(mode: str, argv: list[str]) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "backends"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--", *argv], env=env, capture_output=True,
                          text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"export_memory: the {mode} child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def check_exported(out: Path, step: Path, stored: str) -> int:
    """Every exported tensor equals the rank files' (cast to ``stored``), read one at a time; the count."""
    import torch
    from safetensors import safe_open

    from pulse.data.backbone_weights import backbone_weights
    from pulse_torch.backbone_files import TORCH_DTYPES
    from pulse_torch.step_weights import step_weights

    weights = step_weights(step, 1)
    entries = backbone_weights(out / "unet")
    assert entries is not None and entries.keys() == set(weights), "exported names differ from the checkpoint's"
    for name, entry in entries.items():
        assert entry.dtype == stored, f"{name} stored as {entry.dtype}, not {stored}"
        with safe_open(str(entry.file), framework="pt") as f:
            assert torch.equal(f.get_tensor(name), weights[name].to(TORCH_DTYPES[stored])), name
    return len(entries)


def gib(n: int) -> str:
    return f"{n / 2**30:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="block_out_channels times this (1.0: SD v2)")
    parser.add_argument("--stored-dtype", default="F32", choices=("F32", "F16", "BF16"),
                        help="the dtype the pipeline folder stores the UNet in (export casts to it)")
    parser.add_argument("--max-shard-gb", type=float, default=10.0, help="export's shard size (diffusers': 10 GB)")
    parser.add_argument("--compare-merge", action="store_true", help="also measure the old merge_weights")
    parser.add_argument("--workdir", help="where the folders go (default: a temporary folder, removed after)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.rest)

    config = unet_config(args.scale)
    params = sum(p.numel() for p in meta_model(config).parameters())
    work = Path(args.workdir or tempfile.mkdtemp(prefix="export-memory-"))
    try:
        began = time.perf_counter()
        pipeline, run, out = work / "pipeline", work / "run", work / "exported"
        write_pipeline(pipeline, config, args.stored_dtype, seed=0)
        step = write_checkpoint(run, pipeline / "unet", config, seed=0)
        setup = time.perf_counter() - began
        argv = [str(step), str(pipeline), str(out), str(int(args.max_shard_gb * 1e9))]
        rows = [{"mode": "pulse export (streamed)", **measure("export", argv)}]
        shards = len(list((out / "unet").glob("*.safetensors")))
        checked = check_exported(out, step, args.stored_dtype)
        if args.compare_merge:
            rows.append({"mode": "merge_weights (the old export's first step)", **measure("merge", [str(step), "1"])})
        rank_bytes = sum(p.stat().st_size for p in step.glob("rank-*.pt"))
        result = {"unet": {"scale": args.scale, "block_out_channels": config["block_out_channels"],
                           "parameters": params, "stored_dtype": args.stored_dtype,
                           "model_bytes_stored": sum(p.stat().st_size for p in (out / "unet").glob("*.safetensors"))},
                  "checkpoint": {"pp": 2, "rank_file_bytes": rank_bytes}, "shards": shards,
                  "tensors_checked": checked, "setup_seconds": setup, "target_bytes": TARGET_BYTES,
                  "target_applies_to": "anon_peak_above_baseline", "rows": rows,
                  "command": " ".join([".venv/bin/python", "benchmarks/export_memory.py", *sys.argv[1:]])}
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"UNet: {params:,} parameters (block_out_channels {config['block_out_channels']}), stored "
          f"{args.stored_dtype}: {gib(result['unet']['model_bytes_stored'])} GiB in {shards} file(s); "
          f"pp 2 rank files {gib(rank_bytes)} GiB; every exported tensor checked ({checked})")
    print(f"{'mode':<46} {'seconds':>8} {'resident peak GiB':>18} {'anon peak GiB':>14}  (above the baseline)")
    for r in rows:
        print(f"{r['mode']:<46} {r['seconds']:>8.1f} {gib(r['resident_peak_above_baseline']):>18} "
              f"{gib(r['anon_peak_above_baseline']):>14}")
    print(f"target (anonymous peak, SD v2 size): below {gib(TARGET_BYTES)} GiB")
    save(result)
    print(f"wrote {RESULTS.relative_to(ROOT)}")


def save(result: dict) -> None:
    """Into the results file's runs, replacing an earlier run of the same command."""
    try:
        runs = json.loads(RESULTS.read_text())["runs"]
    except (OSError, ValueError, KeyError):
        runs = []
    runs = [r for r in runs if r.get("command") != result["command"]] + [result]
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
