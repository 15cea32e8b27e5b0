"""Ray trainer groups: N rank workers per role, joined by torch.distributed.

A run's groups come from one trainer-config list (`configs`): under DMD2 the critic and the actor
(the student's group), colocated on one placement group (`cluster`), rank i of each in one Ray actor
(`group.RankProcess`). A rank worker (`rank`) keeps
its models resident, runs the generic trainer with its group's hooks (`hooks`), sleeps off the
accelerator between uses (`offload`) and checkpoints into the store (`checkpoint`). `stages` are
the six steps of a rollout as calls on groups, refs in and refs out; payloads between ranks travel
through the store (`payloads`), never through the driver.
"""

from dmd2.lazy import lazy_exports

# Lazy (PEP 562): the rank's own modules (models, memory_plan, offload, parallel) import without Ray, so that the
# single-process device check (bench/gpu.py) runs where Ray, Prefect and MLflow are not installed.
__getattr__, __dir__ = lazy_exports(__name__, {
    "cluster": ["RankResources", "ensure_ray", "rank_memory"],
    "group": ["EvalResult", "RankLostError", "RecoverableError", "TrainResult", "TrainerGroup"],
    "prepare": ["load_prepared", "prepare_inputs"],
    "stages": ["Groups", "StartedRanks", "build_groups", "load_groups", "run_rollout_on_groups", "save_groups",
               "start_ranks"],
})
