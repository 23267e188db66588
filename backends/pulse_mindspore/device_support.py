"""Whether this node's Ascend can train in bf16, asked of MindSpore (`pulse train --backend mindspore
--precision bf16` runs ``python -m pulse_mindspore.device_support`` before msrun; every worker's
``MindSporeBackend`` asks again).

The first-generation Ascend 910 (910A, Atlas training series) has no bfloat16 compute; MindSpore
names its SoC ``ascend910`` (910B parts are ``ascend910b``, A3 ``ascend910_93``). That name is
MindSpore's own test for it (``mindspore/train/model.py``: ``get_ascend_soc_version() ==
'ascend910'``; ``mindspore.amp`` tells 910A by a feature of the same SoC table).
"""
from __future__ import annotations

import json

FIRST_GENERATION_SOC = "ascend910"


def soc_version() -> str:
    from mindspore._c_expression import MSContext

    return str(MSContext.get_instance().get_ascend_soc_version())


def bf16_refusal(device_target: str) -> str | None:
    """Why bf16 cannot train on this node's ``device_target`` (None: it can, or it is not Ascend,
    which the launcher refuses for bf16 by itself)."""
    if device_target != "Ascend" or soc_version() != FIRST_GENERATION_SOC:
        return None
    return ("--precision bf16: this node's Ascend 910A (SoC ascend910) has no bfloat16 compute; "
            "use --precision fp16 (loss-scaled) or fp32")


def _main() -> None:
    import mindspore as ms

    ms.set_device("Ascend", 0)  # the SoC name comes from the runtime of an opened device
    print(json.dumps({"device": "Ascend", "name": soc_version(), "bf16_refusal": bf16_refusal("Ascend")}))


if __name__ == "__main__":
    _main()
