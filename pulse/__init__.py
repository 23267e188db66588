"""PULSE: skip-local pipeline parallelism for diffusion backbones (backend-neutral core)."""

__version__ = "0.1.0"
