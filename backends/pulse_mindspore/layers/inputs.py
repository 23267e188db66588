"""Data inputs for MindSpore layers: the framework-free numpy draws (``pulse.data.draws``)."""
from pulse.data.draws import NUM_TRAIN_TIMESTEPS, latent_shape, make_inputs

__all__ = ["NUM_TRAIN_TIMESTEPS", "latent_shape", "make_inputs"]
