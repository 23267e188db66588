"""What a rank's training data holds in host memory, priced before launch (``pulse train``'s memory check).

::

    no --data       the synthetic set (pulse.data.sources.SyntheticLatents): every latent, the class
                    prototypes and conditions, one block's temporaries while it is made
    --data F.npz    every array of the file (np.load reads them whole)
    --data F.npy    memory-mapped: rows read per microbatch, pages the kernel can drop: 0
    --data DIR      a `pulse cache-latents` folder: memory-mapped shards: 0
    --images DIR    encoded on the fly, a microbatch at a time: 0

Every rank holds its own copy (each builds its source: ``pulse_torch.train``,
``pulse_mindspore.train``), so ranks that share a host pay it once each.
"""
from __future__ import annotations

import zipfile
from math import prod
from pathlib import Path

import numpy as np

from pulse.data.draws import latent_shape, make_inputs
from pulse.data.sources import SYNTHETIC_BLOCK, SYNTHETIC_CLASSES, SYNTHETIC_SAMPLES, data_input_names
from pulse.spec import ModelSpec

FLOAT32 = 4
FIELD_TEMPORARIES = 4  # smooth_fields' arrays alive at once, each a block of latents (upsampling, scaling)


def data_bytes(data: str | Path | None, spec: ModelSpec, images: str | Path | None = None) -> int:
    """Bytes of host memory one rank's data source holds (see the table above)."""
    if images is not None:
        return 0
    if data is None:
        return synthetic_bytes(spec)
    path = Path(data)
    if path.suffix == ".npz" and path.is_file():
        return npz_bytes(path)
    return 0


def synthetic_bytes(spec: ModelSpec) -> int:
    latent = prod(latent_shape(spec)) * FLOAT32
    names = data_input_names(spec)
    condition = sum(a.nbytes for n, a in make_inputs(spec, 1, np.random.default_rng(0))[1].items() if n in names)
    held = SYNTHETIC_SAMPLES * (latent + np.dtype(np.int64).itemsize) + SYNTHETIC_CLASSES * (latent + condition)
    return held + FIELD_TEMPORARIES * SYNTHETIC_BLOCK * latent


def npz_bytes(path: Path) -> int:
    """The arrays' uncompressed sizes (headers included); 0 for a file that is no zip (the rank that
    reads it says so in one line)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return sum(info.file_size for info in archive.infolist())
    except (OSError, zipfile.BadZipFile):
        return 0
