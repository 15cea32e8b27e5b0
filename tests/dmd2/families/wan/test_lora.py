"""A LoRA Wan student's export: the merged transformer, and the adapter alone that `WanPipeline.load_lora_weights`
loads onto the teacher pipeline to compute the same velocity."""

import torch

from dmd2.families.wan.export import LORA_DIR, export_pipeline
from dmd2.families.wan.family import WanFamily
from dmd2.lora import add_adapters
from tests.dmd2.families.wan.tiny_pipeline import FLOW_SHIFT


def test_the_exported_adapter_loads_into_the_teacher_pipeline_as_the_merged_export(wan_dir, tmp_path):
    from diffusers import WanPipeline

    student = add_adapters(WanFamily().load_model(str(wan_dir)), 2, 2.0, WanFamily.lora_targets, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # trained adapters: B is no longer zero
        for name, p in student.named_parameters():
            if "lora_B" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=generator))
    out = export_pipeline(wan_dir, student, 4, FLOW_SHIFT, tmp_path / "student", {})
    merged = WanPipeline.from_pretrained(out)
    assert not any("lora" in name for name in merged.transformer.state_dict())  # a plain, merged transformer
    assert "load_lora_weights" in (out / "README.md").read_text()
    with_adapter = WanPipeline.from_pretrained(wan_dir)
    with_adapter.load_lora_weights(out / LORA_DIR / "transformer")
    inputs = {"hidden_states": torch.randn(2, 4, 2, 2, 2, generator=generator),
              "timestep": torch.tensor([900.0, 300.0]),
              "encoder_hidden_states": torch.randn(2, 8, 16, generator=generator), "return_dict": False}
    with torch.no_grad():
        expected = merged.transformer(**inputs)[0]
        assert (with_adapter.transformer(**inputs)[0] - expected).abs().max() < 1e-5
        assert (student(**inputs)[0] - expected).abs().max() < 1e-5
        teacher = WanPipeline.from_pretrained(wan_dir).transformer
        assert (teacher(**inputs)[0] - expected).abs().max() > 1e-3  # the adapter matters
