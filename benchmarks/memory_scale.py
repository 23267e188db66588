"""Real-size memory: each rank's measured peak beside the plan's prediction for its device.

::

    python benchmarks/memory_scale.py [--workdir DIR] [--cases sd2-config sd2-saved sdxl-lora sd2-mindspore]
                                      [--steps 2]
                                      [--optimizer adamw|adafactor|adamw8bit|lion|prodigy]

Cases (random weights, real configs, 256 px: latents 32 x 32):
    sd2-config   the SD v2 UNet (865,910,724 parameters) from its config.json alone, full fine-tune, pp 2
    sd2-saved    the same from a folder of saved fp32 weights (sharded safetensors, read by key), pp 2
    sdxl-lora    the SDXL UNet (2,567,463,684 parameters) from saved fp16 weights in a pipeline folder whose
                 text encoders and VAE are the tests' tiny ones (tests/sdxl_helpers.py; synthetic latents and
                 text, so their widths never meet the UNet), LoRA rank 16 in bf16 (the frozen base held in
                 bf16), pp 2, then the LoRA weights exported
    sd2-mindspore  sd2-config on the MindSpore backend (msrun, mccl and gloo on this machine's CPUs); its
                 measured peak is each worker's resident peak above its baseline (MindSpore's CPU pool keeps
                 what it once held: no allocator counts the live bytes)

Each case is ``pulse train --diffusers-config DIR ... --pp 2 --microbatch-size 1 --num-microbatches 2``
as a user runs it (torchrun, gloo, this machine's CPUs, glibc's heap as the launcher leaves it); ``log.json``'s
``summary.memory`` holds, per rank, the most its allocations held above what it held before building its stage
(malloc's bytes in use, sampled after every action: ``pulse.train.resident``), its resident peak above the same
baseline, and the simulator's peak for its device. ``--optimizer`` trains every case with it (``pulse train --optimizer``;
the simulator prices its state, ``pulse.optimizers``); a case's row is keyed ``CASE`` for AdamW and
``CASE+OPTIMIZER`` otherwise, so runs of several optimizers sit side by side in the results (prodigy is
refused at pp 2, its step size being the whole model's: its rows say so). Weights folders are written layer by layer from a stage-only
skeleton (``stage_loading``), so preparing them never holds the whole model either.

Prints a table; writes ``benchmarks/results/memory_scale.{json,md}``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pulse.optimizers import NAMES as OPTIMIZERS  # noqa: E402
RESULTS = ROOT / "benchmarks" / "results"
GiB = 2**30

# stabilityai/stable-diffusion-2 unet/config.json, as benchmarks/export_memory.py reads it
SD2 = json.loads((ROOT / "benchmarks" / "sd2_unet_config.json").read_text())
# stabilityai/stable-diffusion-xl-base-1.0 unet/config.json
SDXL = {
    "_class_name": "UNet2DConditionModel", "act_fn": "silu", "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64, "addition_time_embed_dim": 256, "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280], "center_input_sample": False, "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1, "dual_cross_attention": False, "flip_sin_to_cos": True, "freq_shift": 0,
    "in_channels": 4, "layers_per_block": 2, "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32,
    "num_class_embeds": None, "only_cross_attention": False, "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816, "sample_size": 128,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "upcast_attention": None, "use_linear_projection": True,
}
CASES = {
    "sd2-config": {"config": SD2, "weights": None, "flags": []},
    "sd2-saved": {"config": SD2, "weights": "float32", "flags": []},
    "sdxl-lora": {"config": SDXL, "weights": "float16", "pipeline": True,
                  "flags": ["--lora-rank", "16", "--precision", "bf16"]},
    "sd2-mindspore": {"config": SD2, "weights": None, "flags": ["--backend", "mindspore"]},
}
COMMON = ["--model-option", "resolution=256", "--pp", "2", "--microbatch-size", "1", "--num-microbatches", "2"]


def write_folder(folder: Path, config: dict, dtype: str | None) -> None:
    """config.json, and with ``dtype`` the weights as diffusers' sharded safetensors, one layer at a time."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    if dtype is None or (folder / "diffusion_pytorch_model.safetensors.index.json").is_file():
        return
    import torch
    from safetensors.torch import save_file

    sys.path.insert(0, str(ROOT / "backends"))
    from pulse_torch.diffusers_adapter.stage_loading import materialize, skeleton_adapter

    adapter = skeleton_adapter(folder, resolution=256)
    names = list(adapter.layers)
    weight_map, total = {}, 0
    for i, layer in enumerate(names):
        materialize(adapter, [layer], seed=0)
        ids = adapter.parameter_names()
        tensors = {ids[id(p)]: p.detach().to(getattr(torch, dtype)).contiguous()
                   for p in adapter.layers[layer].parameters()}
        shard = f"diffusion_pytorch_model-{i + 1:05d}-of-{len(names):05d}.safetensors"
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, shard))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        for p in adapter.layers[layer].parameters():  # back to nothing: one layer held at a time
            p.data = torch.empty(0)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def pipeline_folder(folder: Path, config: dict, dtype: str) -> Path:
    """The tests' tiny SDXL pipeline with its UNet replaced by ``config``'s, saved layer by layer."""
    import shutil

    if not (folder / "model_index.json").is_file():
        sys.path.insert(0, str(ROOT / "tests"))
        from sdxl_helpers import tiny_sdxl_pipeline

        tiny_sdxl_pipeline(folder)
        shutil.rmtree(folder / "unet")
    write_folder(folder / "unet", config, dtype)
    return folder


def run_case(name: str, workdir: Path, steps: int, optimizer: str = "adamw") -> dict:
    case = CASES[name]
    folder = workdir / f"{name}-model"
    out = workdir / f"{name}-run" if optimizer == "adamw" else workdir / f"{name}-{optimizer}-run"
    if case.get("pipeline"):
        source = ["--pipeline", str(pipeline_folder(folder, case["config"], case["weights"])),
                  "--export", str(workdir / f"{name}-export-{int(time.time())}")]
    else:
        write_folder(folder, case["config"], case["weights"])
        source = ["--diffusers-config", str(folder)]
    cmd = [str(ROOT / ".venv" / "bin" / "pulse"), "train", *source, *COMMON,
           "--steps", str(steps), "--out-dir", str(out), *case["flags"], "--optimizer", optimizer]
    key = name if optimizer == "adamw" else f"{name}+{optimizer}"
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    start = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    seconds = time.time() - start
    if done.returncode != 0:
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n", file=sys.stderr)
        return {"case": key, "optimizer": optimizer, "command": " ".join(cmd),
                "error": done.stderr.strip().splitlines()[-1:]}
    log = json.loads((out / "log.json").read_text())
    rows = log["summary"]["memory"] or []
    for row in rows:
        row["ratio"] = row["peak_bytes"] / row["predicted_peak_bytes"] if row.get("predicted_peak_bytes") else None
    return {"case": key, "optimizer": optimizer, "command": " ".join(cmd), "seconds": seconds, "memory": rows,
            "median_step_seconds": log["summary"]["median_step_seconds"],
            "predicted_step_seconds": log["run"].get("predicted", {}).get("step_seconds")}


def table(results: list[dict]) -> str:
    lines = ["| case | optimizer | rank | device | measured peak (GiB) | predicted (GiB) | measured / predicted "
             "| resident peak (GiB) |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        optimizer = r.get("optimizer", "adamw")  # rows from before --optimizer trained AdamW
        if "error" in r:
            lines.append(f"| {r['case']} | {optimizer} | - | - | failed: {' '.join(r['error'])} | | | |")
            continue
        for row in r["memory"]:
            pred = row.get("predicted_peak_bytes")
            ratio = f"{row['ratio']:.3f}" if row.get("ratio") else "-"
            # rows measured before the held figure: their peak was the resident one, under a 64 KiB mmap threshold
            resident = f"{row['resident_peak_bytes'] / GiB:.2f}" if "resident_peak_bytes" in row else "-"
            if row.get("peak_is_resident"):  # MindSpore's CPU pool: no held figure, the peak is the resident one
                resident = "= measured"
            lines.append(f"| {r['case']} | {optimizer} | {row['rank']} | {row['device']} | {row['peak_bytes'] / GiB:.2f} | "
                         f"{pred / GiB if pred else float('nan'):.2f} | {ratio} | {resident} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="/tmp/pulse-memory-scale")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="pulse train --optimizer")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    results = [run_case(name, workdir, args.steps, args.optimizer) for name in args.cases]
    text = table(results)
    print(text)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / "memory_scale"
    old = json.loads(stem.with_suffix(".json").read_text()) if stem.with_suffix(".json").is_file() else {}
    merged = {**old, **{r["case"]: r for r in results}}
    stem.with_suffix(".json").write_text(json.dumps(merged, indent=1))
    stem.with_suffix(".md").write_text("# Memory at real size (`python benchmarks/memory_scale.py`)\n\n"
                                       + table(list(merged.values())) + "\n")
    return 0 if all("error" not in r for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
