"""The qwen_image family's model call against QwenImagePipeline's own: the prompt table is the pipeline's
`encode_prompt` (padded, with masks), the velocity is the pipeline's transformer call on its own packed latents,
img_shapes, mask and timestep (sigma), and the guided teacher is the pipeline's true CFG with its norm rescaling."""

import torch

from dmd2.config import config_from_dict
from dmd2.families.qwen_image.family import QwenImageFamily
from dmd2.model import guided
from dmd2.prompt_index import negative_indices, prompt_indices
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole

PROMPTS = ["a cat", "a red dog on the sign", "the blue sign"]  # of different lengths: the table pads them
TOKENS = 64


def test_the_prompt_table_is_the_pipelines_own_encoding(qwen_image_dir, qwen_image_pipe, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config = config_from_dict({"model": {"family": "qwen_image", "teacher": str(qwen_image_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": TOKENS, "resolution": 16,
                                        "negative_prompt": "blurry"}})
    table = QwenImageFamily().prepare(config)["prompts"]
    with torch.no_grad():
        for row, prompt in enumerate(PROMPTS + PROMPTS + ["blurry"]):  # training, eval prompts, the negative
            embeds, _ = qwen_image_pipe.encode_prompt([prompt], max_sequence_length=TOKENS)
            name = "negative_prompt_embeds" if prompt == "blurry" else "prompt_embeds"
            got, mask = table[name][row % 6], table[name.replace("embeds", "embeds_mask")][row % 6]
            length = embeds.shape[1]
            assert int(mask.sum()) == length and bool(mask[:length].all())
            assert torch.allclose(got[:length], embeds[0], atol=1e-6) and not got[length:].any()


def test_the_velocity_and_the_true_cfg_are_the_pipelines(qwen_image_pipe):
    pipe = qwen_image_pipe
    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS[:2], max_sequence_length=TOKENS)  # padded by the pipeline
        negative, _ = pipe.encode_prompt([" "], max_sequence_length=TOKENS)  # shorter: the table pads it
    length = negative.shape[1]
    padded = torch.cat([negative, negative.new_zeros(1, embeds.shape[1] - length, negative.shape[2])], 1)
    family = QwenImageFamily().bind({"prompts": {
        "prompt_embeds": embeds, "prompt_embeds_mask": mask, "negative_prompt_embeds": padded,
        "negative_prompt_embeds_mask": (torch.arange(embeds.shape[1]) < length).long()[None]}})
    packed = pipe.prepare_latents(2, 4, 32, 16, embeds.dtype, "cpu", torch.Generator().manual_seed(0))
    latents = pipe._unpack_latents(packed, 32, 16, pipe.vae_scale_factor)[:, :, 0]  # [2, 4, 8, 4]: not square
    sigma, shapes = torch.tensor([0.8, 0.3]), [[(1, 4, 2)]] * 2

    def pipeline_call(text, text_mask):  # QwenImagePipeline.__call__'s
        out = pipe.transformer(hidden_states=packed, timestep=(sigma * 1000) / 1000, guidance=None,
                               encoder_hidden_states_mask=text_mask, encoder_hidden_states=text, img_shapes=shapes,
                               return_dict=False)[0]
        return out

    with torch.no_grad():
        velocity = family.velocity(pipe.transformer)
        cond = prompt_indices(torch.tensor([0, 1]))
        noise_pred = pipeline_call(embeds, mask)
        unpack = lambda tokens: pipe._unpack_latents(tokens, 32, 16, pipe.vae_scale_factor)[:, :, 0]  # noqa: E731
        assert torch.allclose(velocity(latents, sigma, cond), unpack(noise_pred), atol=1e-6)
        neg_noise_pred = pipeline_call(negative.expand(2, -1, -1), None)  # the pipeline's own, unpadded
        comb_pred = neg_noise_pred + 4.0 * (noise_pred - neg_noise_pred)
        expected = comb_pred * (torch.norm(noise_pred, dim=-1, keepdim=True) / torch.norm(comb_pred, dim=-1,
                                                                                          keepdim=True))
        teacher = guided(velocity, 4.0, negative_indices(2))(latents, sigma, cond)
        assert torch.allclose(teacher, unpack(expected), atol=1e-5)


def test_parts_encoded_by_several_workers_merge_into_the_table_one_worker_makes(qwen_image_dir, tmp_path):
    """16 rows (12 prompts, then the first 4 again as the eval set): two parts of one encoder batch each, and a third
    part with none. The long prompt is in the second part, so the first is cut shorter and padded again to merge."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(["a cat", "the dog"] * 4 + ["a very long red dog on the blue sign by the sea",
                                                              "a cat", "the sign", "a dog"]) + "\n")
    config = config_from_dict({"model": {"family": "qwen_image", "teacher": str(qwen_image_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": TOKENS, "resolution": 16}})
    whole = QwenImageFamily().prepare(config)["prompts"]
    parts = assert_parts_merge_to_the_whole(QwenImageFamily(), config, 3)
    assert parts[2] == {} and parts[0]["prompts"]["prompt_embeds"].shape[1] < whole["prompt_embeds"].shape[1]
