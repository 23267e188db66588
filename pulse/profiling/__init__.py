"""``pulse profile``'s measurements, backend-neutral: every figure the simulator needs, taken
through the runtime's own executor and communicator (``job``: the per-rank job; ``layers``,
``cold_start``, ``links``: the figures; ``gather``: what ranks share; ``timing``: actions' seconds)."""
