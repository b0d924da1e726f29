"""RaggedShard: a DTensor placement of whole, unevenly distributed units.

Importing this package installs the DTensor extension points that make the placement
first-class (redistribution, sharding propagation, checkpoint hooks) and chains a
``sys.excepthook`` that logs an uncaught error for the peers' failure diagnosis
(:mod:`ragged_dtensor.peer_failure`); installing is idempotent.
"""

from ragged_dtensor import (
    autograd_hooks,
    checkpoint,
    full_state_dict,
    peer_failure,
    propagation,
    redistribute,
)
from ragged_dtensor.api import distribute_tensor, from_local_run, local_shaped
from ragged_dtensor.consensus import raise_on_any_rank
from ragged_dtensor.peer_failure import (
    PeerFailureError,
    collective_guard,
    record_failure,
    set_roll_call_timeout,
)
from ragged_dtensor.placement import RaggedShard, is_ragged
from ragged_dtensor.redistribute import redistribute_many

redistribute.install()
autograd_hooks.install()
propagation.install()
checkpoint.install()
full_state_dict.install()
peer_failure.install()

__all__ = [
    "PeerFailureError",
    "RaggedShard",
    "collective_guard",
    "distribute_tensor",
    "from_local_run",
    "is_ragged",
    "local_shaped",
    "raise_on_any_rank",
    "record_failure",
    "redistribute_many",
    "set_roll_call_timeout",
]
