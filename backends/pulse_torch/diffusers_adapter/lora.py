"""LoRA on a diffusers backbone (``--lora-rank``): peft adapters on its attention projections, base frozen.

::

    adapter (from_diffusers: layers over the model's own modules, checked against the spec)
      │ add_lora: model.requires_grad_(False); model.add_adapter(LoraConfig(r, alpha, gaussian, targets))
      ▼   (as diffusers' train_text_to_image_lora.py; peft swaps to_q/... for lora.Linear in place,
          so every adapter sits inside the layer that held its projection)
    DiffusersBackend.parameters(chunk) ─▶ the trainable ones only: the chunk's lora_A/lora_B
      (AdamW, gradient norm, data-parallel all-reduce, EMA and checkpoints all go by that table)

    export_lora: the checkpoint's adapters ─▶ PipelineClass.save_lora_weights(OUT)
                 (pytorch_lora_weights.safetensors; ``pipe.load_lora_weights(OUT)`` loads it)
                 --fuse: ─▶ fuse_lora + unload_lora ─▶ OUT a whole pipeline (``from_pretrained(OUT)``)
    lora_model:  the same adapters on the pipeline's backbone (``--sample-every`` draws with them)

Each layer's adapters are drawn (peft's own ``reset_lora_parameters``, gaussian)
on the CPU under ``layer_seed(seed, layer)``, then placed beside their base: a
rank that holds only its stage (``stage_loading``) builds exactly the adapters
a single-device reference builds for those layers, whatever pp splits them;
the adapters of layers left on the meta device stay there.
"""
from __future__ import annotations

import inspect
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch
from torch import Tensor, nn

from pulse.errors import PulseError, SpecError
from pulse.train.run_config import RunConfig
from pulse.zoo.lora import DEFAULT_TARGETS, adapter_params, target_names

if TYPE_CHECKING:
    from pulse.data.pipeline_folder import PipelineFolder
    from pulse_torch.diffusers_adapter.adapter import DiffusersAdapter

WEIGHT_NAME = "pytorch_lora_weights.safetensors"


@dataclass(frozen=True)
class LoraSettings:
    """``--lora-rank R --lora-alpha A --lora-targets a,b``: alpha defaults to the rank (scale 1)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = DEFAULT_TARGETS
    file_format: str = "diffusers"  # --lora-format: diffusers (peft keys) or kohya (lora_unet_* keys)

    @classmethod
    def of(cls, rank: int, alpha: float | None = None, targets: str | None = None,
           file_format: str = "diffusers") -> "LoraSettings":
        return cls(rank, float(rank if alpha is None else alpha), target_names(targets), file_format)

    def peft_config(self) -> Any:
        """peft's ``LoraConfig`` (imported here: peft is needed only by LoRA runs)."""
        from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha, init_lora_weights="gaussian",
                          target_modules=list(self.targets))


def lora_of(config: RunConfig) -> LoraSettings | None:
    """A ``RunConfig``'s LoRA settings, or None for a full fine-tune."""
    if config.lora_rank is None:
        return None
    return LoraSettings.of(config.lora_rank, config.lora_alpha, config.lora_targets, config.lora_format)


def add_lora_to_model(model: nn.Module, lora: LoraSettings, seed: int) -> None:
    """Freeze ``model`` and give it peft LoRA adapters (drawn from ``seed``, whatever the global RNG holds)."""
    if not hasattr(model, "add_adapter"):
        raise SpecError(f"--lora-rank: diffusers {type(model).__name__} takes no peft adapters here "
                        "(LoRA is supported for UNet2DConditionModel)")
    try:
        import peft  # noqa: F401
    except ImportError:
        raise PulseError("--lora-rank needs peft: pip install 'peft>=0.10' (or the diffusers extra)") from None
    model.requires_grad_(False)
    with torch.random.fork_rng(devices=[]):  # gaussian init draws on the CPU generator, then moves
        torch.manual_seed(seed)
        try:
            model.add_adapter(lora.peft_config())
        except ValueError as exc:  # peft: "Target modules {...} not found in the base model"
            raise SpecError(f"--lora-targets {','.join(lora.targets)}: {' '.join(str(exc).split())[:200]}") from None
    # the adapters train in fp32 over a base held in bf16/fp16 (diffusers' cast_training_params)
    for p in model.parameters():
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16):
            p.data = p.data.to(torch.float32)


def add_lora(adapter: DiffusersAdapter, lora: LoraSettings, seed: int) -> None:
    """``add_lora_to_model`` on an adapter's model; every adapter parameter must sit in exactly one layer."""
    add_lora_to_model(adapter.model, lora, seed)
    for layer in adapter.layers.values():  # a layer holding a part of a block peft swapped (split_resnets)
        if hasattr(layer, "rebind"):
            layer.rebind()
    reseed_adapters(adapter, seed)
    trainable = {id(p): n for n, p in adapter.model.named_parameters() if p.requires_grad}
    seen: set[int] = set()
    for layer in adapter.layers.values():
        seen.update(id(p) for p in layer.parameters() if p.requires_grad)
    outside = [n for i, n in trainable.items() if i not in seen]
    if outside:  # an adapter no chunk holds would never train
        raise SpecError(f"--lora-targets: adapter '{outside[0]}' belongs to no PULSE layer")
    check_priced(adapter, lora)


def reseed_adapters(adapter: DiffusersAdapter, seed: int) -> None:
    """Every real layer's adapters drawn again under its own seed, on the CPU, then moved to its device."""
    from pulse.layers.chunk_layout import layer_seed

    for name, layer in adapter.layers.items():
        modules = [m for m in layer.modules() if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A")]
        if not modules or modules[0].get_base_layer().weight.device.type == "meta":
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(seed, name))
            for m in modules:
                device = m.get_base_layer().weight.device
                for part in (m.lora_A, m.lora_B):
                    part.to_empty(device="cpu")
                m.reset_lora_parameters("default", "gaussian")
                for part in (m.lora_A, m.lora_B):
                    part.to(device)


def check_priced(adapter: DiffusersAdapter, lora: LoraSettings) -> None:
    """Each layer's adapters count what the planner priced (``pulse.zoo.lora.adapter_params``)."""
    priced = adapter_params(adapter.spec, lora.rank, lora.targets)
    for layer, want in zip(adapter.spec.layers, priced):
        got = sum(p.numel() for p in adapter.layers[layer.name].parameters() if p.requires_grad)
        if got != want:  # the plan's memory and all-reduce figures would be wrong
            raise SpecError(f"--lora-targets {','.join(lora.targets)}: layer '{layer.name}' holds {got:,} adapter "
                            f"parameters but the plan priced {want:,}")


def lora_weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's adapters in diffusers' LoRA format (``unet_lora_layers`` of ``save_lora_weights``)."""
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict

    return convert_state_dict_to_diffusers(get_peft_model_state_dict(model))


def save_lora_folder(pipeline_class: type, model: nn.Module, out: Path) -> None:
    """``out``/pytorch_lora_weights.safetensors, written beside it and renamed: never half a folder."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    # the adapter's config (alpha above all) travels in the file's metadata: without it a loader
    # would take alpha = rank and scale the update by 1 instead of alpha / rank (diffusers >= 0.35)
    takes = inspect.signature(pipeline_class.save_lora_weights).parameters
    meta = ({"unet_lora_adapter_metadata": model.peft_config["default"].to_dict()}
            if "unet_lora_adapter_metadata" in takes else {})
    pipeline_class.save_lora_weights(str(tmp), unet_lora_layers=lora_weights(model), safe_serialization=True, **meta)
    os.replace(tmp, out)


def kohya_weights(model: nn.Module, lora: LoraSettings) -> dict[str, Tensor]:
    """The model's adapters under kohya's names (sd-scripts' networks/lora.py, what A1111 and ComfyUI load):

    ``down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q`` (peft's lora_A, lora_B) ─▶
    ``lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q.{lora_down,lora_up}.weight``
    and its ``.alpha`` (the scale numerator: updates scaled by alpha / rank, as peft's).
    """
    from peft.utils import get_peft_model_state_dict

    out: dict[str, Tensor] = {}
    for name, tensor in get_peft_model_state_dict(model).items():
        module, _, part = name.rpartition(".lora_")  # "...to_q", "A.weight"
        base = "lora_unet_" + module.replace(".", "_")
        side = {"A.weight": "lora_down.weight", "B.weight": "lora_up.weight"}.get(part)
        if side is None:
            raise PulseError(f"--lora-format kohya: adapter tensor '{name}' has no kohya counterpart")
        out[f"{base}.{side}"] = tensor.detach().to(torch.float32).contiguous()
        out[f"{base}.alpha"] = torch.tensor(float(lora.alpha))
    return out


def save_kohya_folder(model: nn.Module, lora: LoraSettings, out: Path) -> None:
    """``out``/pytorch_lora_weights.safetensors in kohya's format, written beside it and renamed."""
    from safetensors.torch import save_file

    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    meta = {"ss_network_module": "networks.lora", "ss_network_dim": str(lora.rank),
            "ss_network_alpha": f"{lora.alpha:g}"}
    save_file(kohya_weights(model, lora), str(tmp / WEIGHT_NAME), metadata=meta)
    os.replace(tmp, out)


def lora_model(folder: PipelineFolder, weights: Mapping[str, Tensor], lora: LoraSettings, source: str,
               shapes_only: bool = False) -> nn.Module:
    """The pipeline's backbone with peft adapters holding ``weights`` (a checkpoint's, by the model's names).

    ``shapes_only``: the base stays on the meta device (``stage_loading.skeleton``), only the adapters are
    real: enough to write them (``lora_weights``), and the exporting process never holds the base."""
    if shapes_only:
        from pulse_torch.diffusers_adapter.stage_loading import skeleton

        model = skeleton(str(folder.backbone))
    else:
        from pulse_torch.pipeline.encode import load_component

        model = load_component(folder, folder.backbone_name, folder.backbone)
    add_lora_to_model(model, lora, seed=0)  # shapes only: every value is replaced below
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    odd = sorted(set(params) ^ set(weights)) or [n for n, p in params.items() if p.shape != weights[n].shape]
    if odd:
        raise PulseError(f"{source}: its adapters do not match --lora-rank {lora.rank} --lora-targets "
                         f"{','.join(lora.targets)} on {folder.backbone} (e.g. '{odd[0]}')")
    with torch.no_grad():
        for name, p in params.items():
            if p.device.type == "meta":  # a new parameter in its place: meta tensors hold nothing to copy into
                owner, _, attr = name.rpartition(".")
                model.get_submodule(owner)._parameters[attr] = nn.Parameter(
                    weights[name].detach().to(torch.float32).clone())
            else:
                p.copy_(weights[name])
    return model


def fuse(model: nn.Module) -> nn.Module:
    """``model`` with its adapters merged into the base weights and removed: W + (alpha / R) B A, a plain model."""
    model.fuse_lora()  # diffusers' PeftAdapterMixin: peft's merge on every LoRA layer
    model.unload_lora()  # each lora.Linear back to its (now merged) base layer
    return model


def export_lora(pipeline_dir: str, weights: Mapping[str, Tensor], lora: LoraSettings, out: Path,
                source: str, fused: bool = False) -> str:
    """Write the checkpoint's adapters (``weights``: by the model's parameter names) as diffusers LoRA weights,
    or (``fused``, ``--fuse``) a whole pipeline folder whose backbone holds them merged; the line that says so."""
    import diffusers

    from pulse.data.pipeline_folder import read_pipeline
    from pulse_torch.pipeline.encode import quiet

    quiet()
    folder = read_pipeline(pipeline_dir)
    model = lora_model(folder, weights, lora, source, shapes_only=not fused)
    count = sum(w.numel() for w in weights.values())
    if fused:
        from pulse_torch.export import write_pipeline

        write_pipeline(folder, fuse(model), out)
        return (f"wrote {out}: {folder.backbone_name}/ with LoRA rank {lora.rank} ({count:,} adapter parameters) "
                f"from {source} fused in, the other parts from {folder.root}")
    if lora.file_format == "kohya":
        save_kohya_folder(model, lora, out)
        return (f"wrote {out / WEIGHT_NAME}: LoRA rank {lora.rank} ({count:,} adapter parameters) from {source}, "
                "kohya's lora_unet_* keys (A1111, ComfyUI; diffusers' load_lora_weights converts them)")
    cls_name = str(folder.index.get("_class_name", "DiffusionPipeline"))
    save_lora_folder(getattr(diffusers, cls_name, diffusers.StableDiffusionPipeline), model, out)
    return f"wrote {out / WEIGHT_NAME}: LoRA rank {lora.rank} ({count:,} adapter parameters) from {source}"
