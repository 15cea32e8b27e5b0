"""What a pipeline family accepts beyond its teacher, decided from files alone (standard library: the CLI asks
before anything heavy loads): the student and critic directories, the prompt file, and the options nothing of a
pipeline family without a GAN head or videos reads. SD3 has checks of its own (its GAN's real images)."""

from collections.abc import Callable, Collection

from dmd2.config import ConfigError, DistillConfig
from dmd2.flow_pipeline.files import is_pipeline
from dmd2.model_specs import model_dir
from dmd2.prompt_file import read_prompts


def check_recipe(config: DistillConfig, family: str, classes: tuple[str, ...], check_teacher: Callable[[str], None],
                 check_split: Callable[[str], None] | None = None, published: Collection[str] = ()) -> None:
    """Refuse, as a ConfigError naming the option, what `family` cannot run; `check_teacher(directory)` checks a
    local (or cached) teacher (a hub id's files are checked when the run fetches them), and `check_split(teacher)`
    its `[train] sequence_parallel`, also for a hub id of ``published`` (teachers whose configs the family keeps)."""
    try:
        local = model_dir("[model] teacher", config.model.teacher)
        if local is not None:
            check_teacher(str(local))
        teacher = str(local) if local is not None else config.model.teacher
        if check_split is not None and (local is not None or teacher in published):
            check_split(teacher)
        for option, spec in (("student", config.model.student), ("critic_load", config.model.critic_load)):
            path = spec and model_dir(f"[model] {option}", spec)
            if path and not is_pipeline(path, classes):
                raise ValueError(f"[model] {option} = {spec!r} is not a {' or '.join(classes)} directory; give one "
                                 "(e.g. an exported student)")
        if not config.data.prompts:
            raise ValueError(f"[data] prompts is required by the {family} family: a text file (one prompt a line) "
                             "or a .jsonl file with a \"prompt\" field")
        read_prompts(config.data.prompts)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    unread = [f"[data] {name}" for name in ("frames", "height", "width") if getattr(config.data, name)]
    if config.data.images or (config.dmd2 is not None and config.dmd2.critic_gan_weight > 0):
        unread.append("[data] images / [dmd2] critic_gan_weight (the GAN on real images: the sd3 family's)")
    if config.eval.num_samples != 1000:
        unread.append("[eval] num_samples (this family samples [eval] prompts)")
    if unread:
        raise ConfigError(f"{'; '.join(unread)}: not read by the {family} family (square pictures of [data] "
                          "resolution, no GAN head): remove them")
