"""What the wan family accepts, decided from the pipeline's JSON files and the prompt file alone.

Standard library only: the CLI asks `claims` and `check` (through the registry, dmd2/family.py) before anything
heavy loads, so a refused recipe costs no torch import. A hub id cannot be checked offline; when the local hub
cache holds it, its snapshot is checked like a directory.
"""

from dmd2.config import ConfigError, DistillConfig
from dmd2.prompt_file import read_prompts
from dmd2.families.wan.pipeline import (EXPERTS, check_sequence_split, experts, flow_shift_of, is_wan_pipeline,
                                       latent_shape, video_size)
from dmd2.families.wan.published import TRANSFORMERS
from dmd2.model_specs import model_dir


def claims(teacher: str) -> bool:
    """Whether `[model] teacher` is a local WanPipeline directory."""
    return is_wan_pipeline(teacher)


def check(config: DistillConfig) -> None:
    """Refuse teachers, students, critics, prompt files and options the family cannot run with."""
    try:
        _check_teacher(config)
        model = config.model
        for option, spec in (("student", model.student), ("critic_load", model.critic_load)):
            path = spec and model_dir(f"[model] {option}", spec)
            if path and not is_wan_pipeline(path):
                raise ValueError(f"[model] {option} = {spec!r} is not a WanPipeline directory; give one (e.g. an "
                                 "exported student)")
        if not config.data.prompts:
            raise ValueError("[data] prompts is required by the wan family: a text file (one prompt a line) or a "
                             ".jsonl file with a \"prompt\" field")
        read_prompts(config.data.prompts)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    _refuse_unread(config)


def _check_teacher(config: DistillConfig) -> None:
    """A local (or cached) teacher must be a flow-prediction WanPipeline whose latents fit the video size."""
    teacher = model_dir("[model] teacher", config.model.teacher)
    if teacher is None:  # a hub id, fetched when the run resolves it: its files are checked then
        if config.model.teacher in TRANSFORMERS:  # a published one's configs are here (Wan 2.1: one transformer)
            check_sequence_split(config.model.teacher, *video_size(config.data), config.train.sequence_parallel)
            check_student_expert(config, one_transformer=True)
        else:
            check_student_expert(config, one_transformer=False)
        return
    check_student_expert(config, one_transformer=experts(teacher)[1] is None)
    flow_shift_of(teacher)
    latent_shape(teacher, *video_size(config.data))
    check_sequence_split(teacher, *video_size(config.data), config.train.sequence_parallel)


def check_student_expert(config: DistillConfig, one_transformer: bool) -> None:
    """`[student] expert` names one of a two-expert teacher's transformers (Wan 2.2 A14B), for a fully fine-tuned
    student."""
    expert = config.student.expert
    if not expert:
        return
    if expert not in EXPERTS:
        raise ValueError(f"[student] expert = {expert!r} is not one of Wan 2.2's experts: use \"transformer\" (high "
                         "noise) or \"transformer_2\" (low noise), or leave it empty for both")
    if one_transformer:
        raise ValueError(f"[student] expert = {expert!r}: the teacher {config.model.teacher} has one transformer (Wan "
                         "2.1), nothing to choose; leave [student] expert empty")
    if config.student.lora_rank:
        raise ValueError("[student] expert with lora_rank > 0: a LoRA student of one expert is not supported yet; set "
                         "lora_rank = 0 or leave [student] expert empty")


def _refuse_unread(config: DistillConfig) -> None:
    """Options of the picture families that nothing reads here yet: set, they would be silently ignored."""
    unread = []
    if config.data.images or (config.dmd2 is not None and config.dmd2.critic_gan_weight > 0):
        unread.append("[data] images / [dmd2] critic_gan_weight (the GAN on real videos)")
    if config.eval.clip_model:
        unread.append("[eval] clip_model")
    if config.eval.feature_model:
        unread.append("[eval] feature_model")
    if config.eval.num_samples != 1000:
        unread.append("[eval] num_samples (the wan family samples [eval] prompts)")
    if unread:
        raise ConfigError(f"{'; '.join(unread)}: not read by the wan family (its evaluation judges videos by the "
                          "model-free pixel KID, diversity and motion): remove them")
