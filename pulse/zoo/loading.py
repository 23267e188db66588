"""One way in for every model name a command or a rank is given: a zoo entry, a spec file, a diffusers model."""
from __future__ import annotations

from pulse.errors import PulseError
from pulse.spec import ModelSpec


def load_model(name: str, options: dict | None = None) -> ModelSpec:
    """A zoo entry, a spec file, or a diffusers model (``diffusers:PATH``, its folder or config.json)."""
    from pulse.zoo import get_spec
    from pulse.zoo.diffusers_config import is_diffusers_model, spec_from_path

    if is_diffusers_model(name):  # read with json here: the core never imports diffusers
        spec = spec_from_path(name, **(options or {}))
    else:
        spec = get_spec(name, **(options or {}))
    check_plausible(spec)
    return spec


# Per layer and sample: far above any real model (SD2's largest layer: ~1e11 FLOPs, ~1e7 output bytes),
# low enough that sums over a plan stay exact in a float and mean something.
LAYER_LIMITS = {"params": 10**12, "flops": 1e18, "out_bytes": 2**40, "saved_bytes": 2**42}


def check_plausible(spec: ModelSpec) -> None:
    """Refuse sizes no layer can have (a typo in a spec file): they would price every plan as nonsense."""
    for layer in spec.layers:
        for attr, limit in LAYER_LIMITS.items():
            value = getattr(layer, attr)
            if not value <= limit:  # "not <=" also catches NaN
                raise PulseError(f"model '{spec.name}': layer '{layer.name}' has {attr} {value:g}, more than "
                                 f"any layer could ({limit:g} per sample); fix the spec file")
