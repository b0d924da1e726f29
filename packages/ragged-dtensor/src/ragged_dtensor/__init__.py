"""RaggedShard: a DTensor placement of whole, unevenly distributed units.

Importing this package changes nothing in torch. The DTensor extension points that make the
placement first-class (redistribution, sharding propagation, checkpoint hooks, torch's own
``distribute_tensor``) and a ``sys.excepthook`` that logs an uncaught error for the peers'
failure diagnosis (:mod:`ragged_dtensor.peer_failure`) are the rows of
:data:`ragged_dtensor.torch_patches.PATCHES`, installed once per process by the first
``RaggedShard(...)`` or by :func:`install`.
"""

from ragged_dtensor.api import (
    distribute_tensor,
    from_local_run,
    from_local_run_like,
    local_shaped,
)
from ragged_dtensor.consensus import raise_on_any_rank, raise_on_any_rank_along
from ragged_dtensor.peer_failure import (
    PeerFailureError,
    collective_guard,
    record_failure,
    set_roll_call_timeout,
)
from ragged_dtensor.placement import RaggedShard, is_ragged
from ragged_dtensor.redistribute import redistribute_many
from ragged_dtensor.torch_patches import TorchPatchError, install

__all__ = [
    "PeerFailureError",
    "RaggedShard",
    "TorchPatchError",
    "collective_guard",
    "distribute_tensor",
    "from_local_run",
    "from_local_run_like",
    "install",
    "is_ragged",
    "local_shaped",
    "raise_on_any_rank",
    "raise_on_any_rank_along",
    "record_failure",
    "redistribute_many",
    "set_roll_call_timeout",
]
