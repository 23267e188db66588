"""`pulse train --images`: the folder screened once, before launch, so that every rank trains on the same samples.

::

    pulse train --images DIR [--bad-samples stop|skip]
        screen_images (pulse.data.captioned_images): every metadata line and every image, decoded
        stop  a bad sample refuses the run here, in one line naming the file (and the metadata line),
              before any rank starts
        skip  each bad sample named once (a warning line), its key written to run.yaml
              (RunConfig.skipped_samples): every rank leaves out exactly these and decodes nothing
              again; log.json's run block lists them, its summary counts them

Why before launch: a decode that fails on one rank mid-epoch would either stop the
job hours in or leave the ranks disagreeing on the batch. Screened once, the data
order is a function of the remaining samples alone, on every rank and on resume.
"""
from __future__ import annotations

import sys

from pulse.data.captioned_images import screen_images
from pulse.data.image_sets import image_set_of
from pulse.train.run_config import RunConfig


def screen_before_launch(config: RunConfig) -> RunConfig:
    """``config`` with the bad samples' keys of its ``--images`` folder (none: unchanged); ``stop``
    with a bad sample is the ``PulseError`` that names it."""
    if config.images is None:
        return config
    screened = screen_images(image_set_of(config), config.bad_samples)
    for bad in screened.skipped:
        print(f"warning: --bad-samples skip: leaving out {bad.describe()}", file=sys.stderr, flush=True)
    if screened.skipped:
        print(f"images: {len(screened.items)} samples train, {len(screened.skipped)} bad ones left out", flush=True)
    return config.replace(skipped_samples=[bad.key for bad in screened.skipped])
