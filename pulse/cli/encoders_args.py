"""The --encoders flag of `pulse simulate` and `pulse tune`: where the frozen encoders run."""
from __future__ import annotations

import argparse

from pulse.encoders import MODES, EncoderSet, check_feeds
from pulse.errors import PulseError
from pulse.spec import ModelSpec


def add_encoders_argument(parser: argparse.ArgumentParser, many: bool) -> None:
    what = "comma-separated modes to compare" if many else "one mode"
    parser.add_argument("--encoders", default="cached",
                        help=f"where the frozen encoders (text, VAE) run, {what}: cached (data encoded offline, "
                             "the default), before (on the first device before the pipeline), bubbles (in the "
                             "pipeline's idle gaps)")


def encoder_modes(text: str) -> tuple[str, ...]:
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown:
        raise PulseError(f"--encoders: expected {', '.join(MODES)} (comma-separated for pulse tune), got '{text}'")
    return tuple(dict.fromkeys(modes))


def model_encoders(spec: ModelSpec, modes: tuple[str, ...]) -> EncoderSet | None:
    """The zoo's encoders for ``spec`` when a mode other than cached is asked for; None otherwise."""
    if modes == ("cached",):
        return None
    from pulse.zoo.encoders import zoo_encoders

    encoders = zoo_encoders(spec)
    if encoders is None:
        raise PulseError(f"--encoders {','.join(modes)}: the zoo has no frozen encoders for model '{spec.name}' "
                         "(known: sd2-unet, sdxl-unet, hunyuan-dit); use --encoders cached")
    check_feeds(spec, encoders)
    return encoders


def pipeline_encoder_set(pipeline: str | None, images: str | None, mode: str, spec: ModelSpec,
                         precision: str = "fp32") -> EncoderSet | None:
    """`pulse train --encoders before|bubbles`: the pipeline folder's own encoders (``--pipeline``), run
    in the plan on images encoded on the fly (``--images``), their weights priced in the dtype the ranks
    hold them in under ``precision`` (``pulse.data.frozen_precision``); None for cached."""
    if mode == "cached":
        return None
    if pipeline is None or images is None:
        raise PulseError(f"--encoders {mode} runs the pipeline's frozen encoders in the plan: it needs --pipeline DIR "
                         "and --images DIR (with --data the images are encoded already: --encoders cached)")
    from pulse.data.frozen_precision import frozen_bytes
    from pulse.data.pipeline_folder import read_pipeline
    from pulse.data.pipeline_text import pipeline_encoders

    folder = read_pipeline(pipeline, need_encoders=True)
    encoders = EncoderSet(pipeline_encoders(folder), mode).held_at(frozen_bytes(folder, precision))
    check_feeds(spec, encoders)
    return encoders
