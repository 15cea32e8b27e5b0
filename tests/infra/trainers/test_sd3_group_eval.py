"""SD3 evaluation on a world-size-2 FSDP2 group (infra/trainers/rank.py `evaluate`): every rank samples its
share of the eval prompts with the model as it holds it, the teacher's with the critic's teacher of its process
(sharded like the critic), and rank 0's scores are those of the same student evaluated whole in one process."""

import dataclasses

import pytest
import ray

from dmd2.config import load_recipe
from dmd2.families.sd3.evaluation import SD3Evaluator
from dmd2.families.sd3.family import SD3Family
from dmd2.model import HostCalls
from flows.recipe import RECIPES
from infra.trainers.cluster import RankResources
from infra.trainers.prepare import load_prepared, prepare_inputs
from infra.trainers.stages import build_groups, run_rollout_on_groups
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline
from tests.infra.trainers.ray_fixtures import new_store

PROMPTS = ["a photo of a cat", "a red dog", "a blue sign", "the cat on the sign"]
EVAL_PROMPTS = ["a photo of a cat", "a red dog"]


def count_student_batches(process) -> None:
    """In a rank process: record the batch of every forward of its actor's (sharded) student."""
    process.batches = []
    process.workers["actor"].module.register_forward_pre_hook(
        lambda module, args, kwargs: process.batches.append(kwargs["hidden_states"].shape[0]), with_kwargs=True)


@pytest.mark.slow  # an SD3 group of two ranks
def test_a_world_size_2_group_splits_sd3_evaluation_between_its_ranks(shared_ray, tmp_path):
    teacher = build_tiny_sd3_pipeline(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = load_recipe(RECIPES / "sd35-medium-4step.toml", {
        "model": {"teacher": str(teacher)}, "data": {"prompts": str(prompts), "resolution": 16},
        "train": {"world_size": 2, "rollout_batch_size": 4, "mixed_precision": "no"},
        "dmd2": {"critic_steps_per_rollout": 2}, "eval": {"reference_steps": 4, "prompts": EVAL_PROMPTS}})
    family, store = SD3Family(), new_store(tmp_path)
    prepared, _ = prepare_inputs(family, config, store)
    spec = dataclasses.replace(family.run_spec(config, tmp_path / "cache"), prepared=prepared)
    groups = build_groups(spec, store, RankResources(num_cpus=1))
    try:
        run_rollout_on_groups(groups, "sd3", 0)  # the student leaves the teacher
        ray.get([process.__ray_call__.remote(count_student_batches) for process in groups.actor.processes])
        result = groups.actor.evaluate("sd3", 1)
        batches = ray.get([process.__ray_call__.remote(lambda process: process.batches)
                           for process in groups.actor.processes])
        # the reference samples used the critic's teacher, sharded like the critic (FSDP2: DTensor parameters),
        # lent in the same process and parked again after
        borrowed = ray.get([process.__ray_call__.remote(lambda process: (
            process.workers["actor"]._evaluator.lent_teacher is not None,
            {type(p).__name__ for p in process.workers["critic"].teacher.parameters()},
            process.workers["critic"]._teacher_host.parked)) for process in groups.actor.processes])
        [weights] = {ref.uri: ref for ref in groups.actor.export_weights("sd3/exports/student.safetensors")}.values()
    finally:
        groups.shutdown()
    # Each rank ran the student on its half of the eval set (each eval prompt from `samples_per_prompt` noises: 4
    # rows), at each of the student's 4 steps, in batches of a rank's samples of a rollout (2 rows); no rank sampled
    # the whole set.
    half = len(EVAL_PROMPTS) * config.eval.samples_per_prompt // 2
    assert (half, config.train.rollout_batch_size // 2) == (4, 2)
    assert batches == [[2] * 4 * 2, [2] * 4 * 2]
    bound = family.bind(load_prepared(store, prepared, tmp_path / "cache"))
    student = bound.load_model(str(teacher))
    student.load_state_dict(store.get_tensors(weights))
    whole = SD3Evaluator.build(bound, config).evaluate(HostCalls(bound.velocity(student.eval()), student.device))
    assert borrowed == [(True, {"DTensor"}, True), (True, {"DTensor"}, True)]
    assert result.scores.keys() == whole.scores.keys()  # `whole` loads its own teacher: the same reference samples
    for key, value in whole.scores.items():
        assert result.scores[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
