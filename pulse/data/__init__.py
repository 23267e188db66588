"""Training data, framework-free and the same for every backend: sources of clean latents and their
conditioning, which samples a step reads, the noise and the targets (numpy arrays; a backend only
places them on its device)::

    LatentSource (SyntheticLatents | FileLatents)      Sampler (pulse.train.sampler)
          │ x0, conditions                              (step, replica, mb) -> indices
          ▼
    DiffusionFeed.batch(step, replica, mb) -> {"h": x_t, "timesteps": t, conditions..., "target": eps or v}
"""
