"""The schedule synthesizer: ILP models (``ilp.py``, ``modulo.py``), pattern tiling, memory caps.

It sits above ``pulse.schedule`` (the IR, generators, validation it builds on) and
``pulse.sim`` (the simulator that judges every candidate): neither imports it.
"""
from pulse.synth.synthesize import ILP_NAME, SynthResult, synthesize

__all__ = ["ILP_NAME", "SynthResult", "synthesize"]
