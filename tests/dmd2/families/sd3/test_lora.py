"""LoRA on the SD3 family (dmd2/lora.py, dmd2/families/sd3/export.py): a DMD2 rollout trains only the
MMDiT's adapters, and the exported adapter, loaded into the teacher pipeline with diffusers'
`load_lora_weights`, computes what the merged export does."""

import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline
from safetensors.torch import load_file

from dmd2.config import config_from_dict
from dmd2.families.sd3.export import LORA_DIR, export_pipeline
from dmd2.families.sd3.family import PromptIndices, SD3Family
from dmd2.families.sd3.pipeline import load_transformer, shift_of
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.loop import run_rollout
from dmd2.lora import add_adapters, with_role_adapters
from dmd2.plan import rollout_plan
from dmd2.trainer import train_state

PROMPTS = ["a photo of a cat", "a red dog on the sign"]
NUM_STEPS = 2
RANK, ALPHA = 4, 8  # alpha != rank: the exported metadata must carry the scale


def lora_config(sd3_dir):
    return config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)},
        "student": {"num_steps": NUM_STEPS, "shift": 3.0, "lora_rank": RANK, "lora_alpha": ALPHA, "critic_lora": True},
        "optim": {"lr": 1e-2}, "dmd2": {"critic_steps_per_rollout": 2, "teacher_guidance_scale": 3.0, "sigma_shift": 3.0},
        "train": {"rollout_batch_size": 4, "seed": 5},
    })


def test_a_rollout_trains_only_the_adapters_of_student_and_critic(sd3_dir, sd3_pipe):
    config = lora_config(sd3_dir)
    family = SD3Family().bind({"prompts": encode_prompt_table(sd3_pipe, PROMPTS, "")})
    teacher = family.load_model(str(sd3_dir)).eval().requires_grad_(False)
    base = {name: value.clone() for name, value in teacher.state_dict().items()}
    models = {role: with_role_adapters(family.load_model(str(sd3_dir)), config, role, SD3Family.lora_targets)
              for role in ("actor", "critic")}
    states = {role: train_state(model, 1e-2, config, family.velocity) for role, model in models.items()}
    adapters = {role: {n: p.detach().clone() for n, p in m.named_parameters() if p.requires_grad}
                for role, m in models.items()}
    assert all(name.split(".")[-3] in ("lora_A", "lora_B") for names in adapters.values() for name in names)
    run_rollout(rollout_plan(config, 0, (4, 8, 8)), config, states["actor"], states["critic"],
                family.velocity(teacher), PromptIndices(len(PROMPTS)))
    for role, model in models.items():
        optimized = {id(p) for group in states[role].optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for n, p in model.named_parameters() if n in adapters[role]}, role  # only them
        for name, value in model.state_dict().items():
            if name in adapters[role]:
                continue
            assert torch.equal(value, base[name.replace(".base_layer.", ".")]), (role, name)  # bitwise the teacher's
        changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, adapters[role][n])]
        assert any("lora_B" in n for n in changed), role


def adapted_student(sd3_dir):
    student = add_adapters(load_transformer(sd3_dir), RANK, ALPHA, SD3Family.lora_targets, seed=1)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=generator))
    return student


def transformer_inputs():
    generator = torch.Generator().manual_seed(0)
    return {"hidden_states": torch.randn(2, 4, 8, 8, generator=generator), "timestep": torch.tensor([900.0, 300.0]),
            "encoder_hidden_states": torch.randn(2, 40, 32, generator=generator),
            "pooled_projections": torch.randn(2, 32, generator=generator), "return_dict": False}


def test_the_exported_adapter_loads_into_the_teacher_pipeline_as_the_merged_export(sd3_dir, sd3_pipe, tmp_path):
    student = adapted_student(sd3_dir)
    out = export_pipeline(sd3_dir, student, NUM_STEPS, shift_of(sd3_dir), tmp_path / "student", {})
    saved = load_file(str(out / LORA_DIR / "pytorch_lora_weights.safetensors"))
    adapted_layers = [n for n, m in student.named_modules() if hasattr(m, "lora_A")]
    assert len(saved) == 2 * len(adapted_layers) and all(k.startswith("transformer.") for k in saved)
    assert "LoRA adapter" in (out / "README.md").read_text()

    merged = StableDiffusion3Pipeline.from_pretrained(out, low_cpu_mem_usage=False)
    assert not any("lora" in name for name in merged.transformer.state_dict())  # a plain, merged transformer
    with_adapter = StableDiffusion3Pipeline.from_pretrained(sd3_dir, low_cpu_mem_usage=False)
    with_adapter.load_lora_weights(out / LORA_DIR)
    with_adapter.scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(out, subfolder="scheduler")
    with torch.no_grad():
        expected = merged.transformer(**transformer_inputs())[0]
        assert (with_adapter.transformer(**transformer_inputs())[0] - expected).abs().max() < 1e-5
        assert (student(**transformer_inputs())[0] - expected).abs().max() < 1e-5
        assert (sd3_pipe.transformer(**transformer_inputs())[0] - expected).abs().max() > 1e-2  # the adapter matters

    def sample(pipe):
        pipe.set_progress_bar_config(disable=True)
        torch.manual_seed(7)  # the scheduler's re-noising draws from the global generator
        return pipe(PROMPTS, num_inference_steps=NUM_STEPS, guidance_scale=1.0, height=16, width=16,
                    generator=torch.Generator().manual_seed(0), output_type="latent").images

    difference = (sample(with_adapter) - sample(merged)).abs().max().item()
    assert difference < 1e-4, difference

    # The export left the training model as it was: adapters unmerged, base weights the teacher's.
    teacher = sd3_pipe.transformer.state_dict()
    assert all(torch.equal(value, teacher[name.replace(".base_layer.", ".")])
               for name, value in student.state_dict().items() if "lora_" not in name)
