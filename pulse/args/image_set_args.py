"""What ``--images`` holds and how to read it: the flags `pulse train` (every rank entry) and
`pulse cache-latents` share (``pulse.data.image_sets``), named as diffusers' and sd-scripts' scripts name them."""
from __future__ import annotations

from typing import Any

from pulse.train.run_config import DATASET_FORMATS, RunConfig

_DEFAULT = RunConfig()


def image_set_flags(with_defaults: bool) -> list[tuple[str, dict[str, Any]]]:
    """(flag, argparse kwargs) of each; ``with_defaults``: the defaults set here (`pulse cache-latents`),
    else None (`pulse train`: run.yaml's or RunConfig's)."""
    d = _DEFAULT

    def default(value: str) -> dict[str, Any]:
        return {"default": value} if with_defaults else {}

    return [
        ("--dataset-format", dict(choices=DATASET_FORMATS, **default(d.dataset_format),
                                  help="what --images holds: imagefolder (metadata.jsonl or NAME.txt), hf (a datasets "
                                       "save_to_disk folder, parquet/csv/json(l) files, a hub-style folder; offline), "
                                       "kohya (sd-scripts' N_name subfolders, N repeats), webdataset (.tar shards, "
                                       "'shards/{000000..000009}.tar'); auto (default): read off --images")),
        ("--image-column", dict(metavar="NAME", **default(d.image_column),
                                help=f"--images of a datasets format: the images' column (default "
                                     f"'{d.image_column}'; PIL images, bytes or paths)")),
        ("--caption-column", dict(metavar="NAME", **default(d.caption_column),
                                  help=f"--images of a datasets format: the captions' column (default "
                                       f"'{d.caption_column}'); WebDataset: the .json caption key when no .txt")),
        ("--caption-extension", dict(metavar="EXT", **default(d.caption_extension),
                                     help=f"--images of kohya N_name folders: the caption files' extension "
                                          f"(default '{d.caption_extension}', as sd-scripts; e.g. .txt)")),
    ]
