"""Structure-aware layout planning for flat FSDP buffers (pure Python, standard library only).

Given the tensors of one FSDP group, each with an atomic unit (a quantization block, a row
block, a whole matrix), :func:`plan` chooses a per-rank shard size and an offset for every
tensor in one flat buffer so that no rank boundary cuts a unit, with as little padding as the
structure allows. :func:`plan_buckets` may split a group into a few buffers to pad less, and
:func:`assign_owners` balances per-matrix optimizer work over ranks. :func:`predict_step`
predicts a catalog model's per-step communication on a :class:`Cluster` from its plans.
"""

from layout_planner.buckets import plan_buckets
from layout_planner.comm_model import Cluster, Link
from layout_planner.owners import assign_owners
from layout_planner.plan import Plan, PlanEntry
from layout_planner.planner import plan
from layout_planner.simulate import predict_step
from layout_planner.spec import TensorSpec

__all__ = [
    "Cluster", "Link", "Plan", "PlanEntry", "TensorSpec", "assign_owners", "plan", "plan_buckets", "predict_step",
]
__version__ = "0.2.0"
