import pytest

from dmd2.config import (ConfigError, DistillConfig, DMD2Config, EvalConfig, ModelConfig, OptimConfig, StudentConfig,
                         TrainConfig, config_from_dict, load_recipe)


def valid(**sections):
    base = dict(model=ModelConfig(teacher="t"), dmd2=DMD2Config(), train=TrainConfig(rollout_batch_size=40))
    return DistillConfig(**(base | sections))


def test_a_valid_config_passes_and_derives_b_and_critic_lr():
    config = valid(train=TrainConfig(rollout_batch_size=40, world_size=2), optim=OptimConfig(lr=1e-4))
    assert config.critic_batch_size == 40 // 2 // 5
    assert config.critic_lr == 1e-4
    assert valid(optim=OptimConfig(lr=1e-4, critic_lr=3e-4)).critic_lr == 3e-4
    # Sequence parallelism: the 2 ranks of a sequence group share their samples, so B is of 4 / 2 data ranks.
    split = valid(train=TrainConfig(rollout_batch_size=40, world_size=4, sequence_parallel=2))
    assert (split.train.data_ranks, split.critic_batch_size) == (2, 40 // 2 // 5)


@pytest.mark.parametrize("sections, option", [
    (dict(model=ModelConfig(teacher="")), r"\[model\] teacher is required"),
    (dict(dmd2=DMD2Config(teacher_guidance_scale=0.5)), r"\[dmd2\] teacher_guidance_scale must be >= 1"),
    (dict(dmd2=DMD2Config(score_sigma_range=(0.5, 0.5))), r"\[dmd2\] score_sigma_range"),
    (dict(dmd2=DMD2Config(stop_weights=(1.0, 2.0))), r"\[dmd2\] stop_weights must be empty \(uniform\) or 4"),
    (dict(dmd2=DMD2Config(stop_weights=(1.0, -1.0, 1.0, 1.0))), r"\[dmd2\] stop_weights"),
    (dict(dmd2=DMD2Config(stop_weights=(0.0, 0.0, 0.0, 0.0))), r"\[dmd2\] stop_weights"),
    (dict(dmd2=DMD2Config(score_sigma_range=(0.6, 0.2))), r"\[dmd2\] score_sigma_range"),
    (dict(dmd2=DMD2Config(score_sigma_range=(-0.1, 0.5))), r"\[dmd2\] score_sigma_range"),
    (dict(dmd2=DMD2Config(score_sigma_range=(0.1, 1.5))), r"\[dmd2\] score_sigma_range"),
    (dict(student=StudentConfig(guidance_scale=2.0)), r"\[student\] guidance_scale must be 1"),
    (dict(dmd2=DMD2Config(actor_steps_per_rollout=2)), r"\[dmd2\] actor_steps_per_rollout must be 1"),
    (dict(dmd2=DMD2Config(critic_steps_per_rollout=3)), r"critic_steps_per_rollout \(3\) must divide each rank's shard of 40"),
    (dict(train=TrainConfig(rollout_batch_size=40, world_size=3)), r"rollout_batch_size \(40\) must split evenly"),
    (dict(dmd2=DMD2Config(critic_loss_space="eps")), r"\[dmd2\] critic_loss_space must be one of"),
    (dict(dmd2=DMD2Config(critic_scoring="late")), r"\[dmd2\] critic_scoring must be one of"),
    (dict(optim=OptimConfig(lr=0.0)), r"\[optim\] lr must be > 0"),
    (dict(train=TrainConfig(loss_type="ppo")), r"\[train\] loss_type must be one of"),
    (dict(student=StudentConfig(num_steps=0)), r"\[student\] num_steps must be >= 1"),
    (dict(student=StudentConfig(ema_decay=1.0)), r"\[student\] ema_decay must be in \[0, 1\)"),
    (dict(student=StudentConfig(ema_decay=-0.1)), r"\[student\] ema_decay must be in \[0, 1\)"),
    (dict(train=TrainConfig(rollout_batch_size=40, keep_rollouts=-1)), r"\[train\] keep_rollouts must be >= 0"),
    (dict(train=TrainConfig(rollout_batch_size=40, shard_group_size=0)), r"\[train\] shard_group_size must be >= 1"),
    (dict(train=TrainConfig(rollout_batch_size=40, world_size=4, parallel="hsdp", shard_group_size=3)),
     r"\[train\] world_size \(4\) must be a multiple of shard_group_size \(3\)"),
    (dict(train=TrainConfig(rollout_batch_size=40, sequence_parallel=0)), r"\[train\] sequence_parallel must be >= 1"),
    (dict(train=TrainConfig(rollout_batch_size=40, world_size=6, sequence_parallel=4)),
     r"\[train\] sequence_parallel \(4\) must divide world_size \(6\)"),
    (dict(train=TrainConfig(rollout_batch_size=30, world_size=8, sequence_parallel=2)),
     r"rollout_batch_size \(30\) must split evenly over the 4 data-parallel ranks"),
    (dict(train=TrainConfig(rollout_batch_size=40, world_size=2, sequence_parallel=2),
          dmd2=DMD2Config(critic_gan_weight=1e-2)), r"critic_gan_weight do not work with \[train\] sequence_parallel"),
    (dict(eval=EvalConfig(samples_per_prompt=1)), r"\[eval\] samples_per_prompt must be >= 2"),
    (dict(eval=EvalConfig(feature_model="builtin:dino")), r"\[eval\] feature_model = 'builtin:dino' is no built-in"),
])
def test_each_invalid_config_is_rejected_naming_the_option(sections, option):
    with pytest.raises(ConfigError, match=option):
        valid(**sections)


@pytest.mark.parametrize("sections, option", [
    (dict(optim=OptimConfig(critic_lr=1e-4)), r"\[optim\] critic_lr is read only under DMD2"),
    (dict(model=ModelConfig(teacher="t", critic_load="c")), r"\[model\] critic_load is read only under DMD2"),
    (dict(dmd2=DMD2Config()), r"\[dmd2\] options are read only with .*remove the \[dmd2\] section"),
])
def test_critic_options_without_dmd2_are_rejected(sections, option):
    base = dict(model=ModelConfig(teacher="t"), dmd2=None, train=TrainConfig(loss_type="flow_matching"))
    with pytest.raises(ConfigError, match=option):
        DistillConfig(**(base | sections))


def test_toml_unknown_keys_and_sections_are_named(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nteacher = "t"\n[dmd2]\ncritic_stepz = 5\n')
    with pytest.raises(ConfigError, match=r"\[dmd2\] critic_stepz.*takes critic_steps_per_rollout"):
        load_recipe(recipe)
    with pytest.raises(ConfigError, match="unknown section"):
        config_from_dict({"modle": {}})
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(tmp_path / "missing.toml")


def test_toml_lists_become_tuples_and_overrides_win(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[model]\nteacher = "t"\n[dmd2]\nscore_sigma_range = [0.1, 0.9]\n[train]\nrollouts = 3\n')
    config = load_recipe(recipe, overrides={"train": {"rollouts": 7}})
    assert config.dmd2.score_sigma_range == (0.1, 0.9) and config.train.rollouts == 7


def test_a_recipes_relative_file_paths_are_read_beside_it_and_overrides_beside_the_working_directory(
        tmp_path, monkeypatch):
    folder = tmp_path / "recipes"
    folder.mkdir()
    recipe = folder / "r.toml"
    recipe.write_text('[model]\nteacher = "org/hub-id"\n[data]\nprompts = "p.txt"\nimages = "s3://bucket/real"\n')
    monkeypatch.chdir(tmp_path)
    config = load_recipe("recipes/r.toml")
    assert config.data.prompts == str(folder.resolve() / "p.txt")
    assert config.data.images == "s3://bucket/real" and config.model.teacher == "org/hub-id"  # not files beside it
    assert load_recipe(recipe, overrides={"data": {"prompts": "mine.txt"}}).data.prompts == "mine.txt"
    recipe.write_text(f'[model]\nteacher = "t"\n[data]\nprompts = "{tmp_path / "abs.txt"}"\n')
    assert load_recipe(recipe).data.prompts == str(tmp_path / "abs.txt")


def test_every_option_is_documented():
    import dataclasses
    from dmd2.config import SECTION_TYPES
    for cls in SECTION_TYPES.values():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
