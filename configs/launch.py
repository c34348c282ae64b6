"""Start a Hydra entry point (train.py, serve.py) the same way on one process or under torchrun."""

from __future__ import annotations

import sys
from collections.abc import Callable

from configs.schema import register_configs, register_resolvers
from parallel import distributed


def launch(main: Callable[[], None]) -> None:
    """Join the torchrun group first, so that every rank agrees on one run directory and only rank 0
    writes Hydra's logs and config copies; then run the Hydra `main`, and leave the group after."""
    distributed.init_distributed()
    register_configs()
    register_resolvers()
    sys.argv += distributed.hydra_overrides_for_rank()
    try:
        main()
    except BaseException:
        distributed.shutdown()  # no meeting: the peers may never get there
        raise
    distributed.leave()
