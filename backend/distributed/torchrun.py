"""``python -m backend.distributed.torchrun ...``: torchrun, with restarts that work.

torchrun shares its rendezvous TCP store with the workers' ``init_process_group`` by default, and
a restarted group (``--max-restarts`` > 0 after a rank died) then reads the previous attempt's
addresses from it: here a SIGKILLed rank's group failed to restart with gloo's "connectFullMesh
... Connection refused" (pytorch/pytorch#135712: NCCL ids of the previous restart). With
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` every rendezvous round gets a store of its own and the
restarted group resumed from the last checkpoint. Every launcher here goes through this module;
users calling ``torchrun`` themselves set the variable (``backend.distributed.setup`` warns when a
run allows restarts without it).
"""

from __future__ import annotations

import os

#: torchrun's environment for groups that can restart (see the module docstring).
RESTARTABLE_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def main() -> None:
    for key, value in RESTARTABLE_ENV.items():
        os.environ.setdefault(key, value)
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
