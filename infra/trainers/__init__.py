"""Ray trainer groups: N rank workers per role, joined by torch.distributed.

A run's groups come from one trainer-config list (`configs`): under DMD2 the critic and the actor
(the student's group), colocated on one placement group (`cluster`), rank i of each in one Ray actor
(`group.RankProcess`). A rank worker (`rank`) keeps
its models resident, runs the generic trainer with its group's hooks (`hooks`), sleeps off the
accelerator between uses (`offload`) and checkpoints into the store (`checkpoint`). `stages` are
the six steps of a rollout as calls on groups, refs in and refs out; payloads between ranks travel
through the store (`payloads`), never through the driver.
"""

from infra.trainers.cluster import RankResources, ensure_ray
from infra.trainers.group import EvalResult, RankLostError, RecoverableError, TrainerGroup, TrainResult
from infra.trainers.prepare import load_prepared, prepare_inputs
from infra.trainers.stages import Groups, build_groups, load_groups, run_rollout_on_groups, save_groups

__all__ = [
    "EvalResult",
    "Groups",
    "RankLostError",
    "RankResources",
    "RecoverableError",
    "TrainResult",
    "TrainerGroup",
    "build_groups",
    "ensure_ray",
    "load_groups",
    "load_prepared",
    "prepare_inputs",
    "run_rollout_on_groups",
    "save_groups",
]
