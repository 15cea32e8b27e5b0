"""dmd2/families/sd3/conditioning.py: prompt indices expanded to SD3 embeddings, against explicit rows."""

import copy

import pytest
import torch

from dmd2.families.sd3.conditioning import NEGATIVE, PromptTable, TableVelocity, negative_indices, prompt_indices
from dmd2.families.sd3.prompts import encode_prompt_table
from dmd2.model import DiffusersVelocity, guided
from dmd2.precision import Autocast
from dmd2.schedule import cfg

P, L, D, DP = 4, 5, 3, 6


@pytest.fixture
def table():
    g = torch.Generator().manual_seed(0)
    return PromptTable(torch.randn(P, L, D, generator=g), torch.randn(P, DP, generator=g),
                       torch.randn(1, L, D, generator=g), torch.randn(1, DP, generator=g))


def text_velocity(x_s, sigma, cond):
    """A velocity that depends on both embeddings, per sample."""
    hidden = cond["encoder_hidden_states"].mean((1, 2))[:, None, None, None]
    pooled = cond["pooled_projections"].sum(1)[:, None, None, None]
    return x_s * hidden + sigma[:, None, None, None] * pooled


def test_cond_gathers_the_rows_and_the_negative(table):
    index = torch.tensor([2, 0, NEGATIVE, 2, 3])
    cond = table.cond(index)
    assert set(cond) == {"encoder_hidden_states", "pooled_projections"}
    for row, i in enumerate(index.tolist()):
        embeds = table.negative_prompt_embeds[0] if i == NEGATIVE else table.prompt_embeds[i]
        pooled = table.negative_pooled_prompt_embeds[0] if i == NEGATIVE else table.pooled_prompt_embeds[i]
        assert torch.equal(cond["encoder_hidden_states"][row], embeds)
        assert torch.equal(cond["pooled_projections"][row], pooled)


def test_cond_leaves_the_table_unchanged(table):
    before = {k: v.clone() for k, v in table.tensors().items()}
    table.cond(torch.tensor([NEGATIVE, 1]))["encoder_hidden_states"].add_(1)
    assert all(torch.equal(before[k], v) for k, v in table.tensors().items())


def test_neg_cond_repeats_the_negative_row(table):
    cond = table.neg_cond(3)
    assert cond["encoder_hidden_states"].shape == (3, L, D) and cond["pooled_projections"].shape == (3, DP)
    for row in range(3):
        assert torch.equal(cond["encoder_hidden_states"][row], table.negative_prompt_embeds[0])
        assert torch.equal(cond["pooled_projections"][row], table.negative_pooled_prompt_embeds[0])
    explicit = table.cond(negative_indices(3)["prompt_index"])
    assert all(torch.equal(cond[k], explicit[k]) for k in cond)


def test_cond_refuses_indices_outside_the_table(table):
    for bad in (P, -2):
        with pytest.raises(IndexError, match=f"prompt index {bad} is outside the table of {P} prompts"):
            table.cond(torch.tensor([0, bad]))


def test_table_refuses_mismatched_shapes(table):
    with pytest.raises(ValueError, match="negative_prompt_embeds has shape"):
        PromptTable(table.prompt_embeds, table.pooled_prompt_embeds, torch.zeros(1, L + 1, D),
                    table.negative_pooled_prompt_embeds)


def test_table_round_trips_through_its_tensors(table):
    again = PromptTable.from_tensors(table.tensors())
    assert len(again) == P and all(torch.equal(again.tensors()[k], v) for k, v in table.tensors().items())
    assert table.to(dtype=torch.float64).prompt_embeds.dtype == torch.float64


def test_table_velocity_expands_indices(table):
    x_s, sigma = torch.randn(3, 2, 4, 4), torch.rand(3)
    index = torch.tensor([1, NEGATIVE, 3])
    explicit = {"encoder_hidden_states": torch.stack([table.prompt_embeds[1], table.negative_prompt_embeds[0],
                                                      table.prompt_embeds[3]]),
                "pooled_projections": torch.stack([table.pooled_prompt_embeds[1],
                                                   table.negative_pooled_prompt_embeds[0],
                                                   table.pooled_prompt_embeds[3]])}
    v = TableVelocity(text_velocity, table)(x_s, sigma, prompt_indices(index))
    assert torch.equal(v, text_velocity(x_s, sigma, explicit))


def test_guided_table_velocity_is_the_cfg_of_the_embeddings(table):
    x_s, sigma, scale = torch.randn(3, 2, 4, 4), torch.rand(3), 4.5
    index = torch.tensor([0, 2, 3])
    v = guided(TableVelocity(text_velocity, table), scale, negative_indices(3))(x_s, sigma, prompt_indices(index))
    positive = {"encoder_hidden_states": table.prompt_embeds[index],
                "pooled_projections": table.pooled_prompt_embeds[index]}
    v_pos = text_velocity(x_s, sigma, positive)
    v_neg = text_velocity(x_s, sigma, table.neg_cond(3))
    torch.testing.assert_close(v, cfg(v_pos, v_neg, scale), atol=1e-6, rtol=0)
    torch.testing.assert_close(v, v_neg + scale * (v_pos - v_neg), atol=1e-6, rtol=0)


def test_table_velocity_refuses_embedding_conds(table):
    with pytest.raises(ValueError, match="TableVelocity takes the conditioning"):
        TableVelocity(text_velocity, table)(torch.zeros(1, 2, 4, 4), torch.zeros(1), table.neg_cond(1))


def test_table_cond_feeds_the_sd3_transformer(sd3_pipe):
    """The keys are SD3Transformer2DModel.forward's: DiffusersVelocity over table.cond is the transformer call."""
    table = PromptTable.from_tensors(encode_prompt_table(sd3_pipe, ["a cat", "a red dog"], "", max_sequence_length=8))
    transformer, index = sd3_pipe.transformer, torch.tensor([1, NEGATIVE, 0])
    x_s, sigma = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.9, 0.5, 0.1])
    with torch.no_grad():
        v = TableVelocity(DiffusersVelocity(transformer), table)(x_s, sigma, prompt_indices(index))
        rows = [table.cond(index[i:i + 1]) for i in range(3)]
        explicit = torch.cat([transformer(hidden_states=x_s[i:i + 1], timestep=1000 * sigma[i:i + 1],
                                          encoder_hidden_states=rows[i]["encoder_hidden_states"],
                                          pooled_projections=rows[i]["pooled_projections"]).sample
                              for i in range(3)])
    torch.testing.assert_close(v, explicit, atol=1e-5, rtol=0)


def test_a_device_holds_only_its_batchs_rows_of_a_table_of_10000_prompts(sd3_dir):
    """The meta device stands in for a GPU: the family bound to it keeps the 10,000 prompts' embeddings in host
    memory, and the transformer on it is handed only the rows of the call's 4 samples."""
    from dmd2.families.sd3.family import SD3Family

    family = SD3Family()
    transformer = family.model_on_meta(str(sd3_dir))
    width, pooled = transformer.config.joint_attention_dim, transformer.config.pooled_projection_dim
    table = PromptTable(torch.zeros(10_000, L, width), torch.zeros(10_000, pooled), torch.zeros(1, L, width),
                        torch.zeros(1, pooled))
    family = family.bind({"prompts": table.tensors()}, "meta")
    assert family.conditioning_tensors() == []
    assert {tensor.device.type for tensor in family.table.tensors().values()} == {"cpu"}
    handed = {}
    transformer.register_forward_pre_hook(lambda module, args, kwargs: handed.update(kwargs), with_kwargs=True)
    x_s = torch.empty(4, transformer.config.in_channels, 8, 8, device="meta")
    v = family.velocity(transformer)(x_s, torch.full((4,), 0.5, device="meta"),
                                     prompt_indices(torch.tensor([0, 9_999, 5_000, NEGATIVE])))
    assert v.shape == x_s.shape
    assert handed["encoder_hidden_states"].shape == (4, L, width) and handed["pooled_projections"].shape == (4, pooled)
    assert {handed[key].device.type for key in ("encoder_hidden_states", "pooled_projections")} == {"meta"}


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16], ids=["fp32 master weights", "bf16 teacher"])
def test_a_bf16_table_makes_the_very_same_model_calls_under_bf16_mixed_precision(sd3_pipe, weights):
    """The model's first layers compute in bf16 (autocast, or bf16 weights), so they round an fp32 table's rows to
    exactly a bf16 table's: the calls are equal bit for bit, for half the table's bytes."""
    table = encode_prompt_table(sd3_pipe, ["a cat", "a red dog"], "", max_sequence_length=8)
    halved = {name: embeds.to(torch.bfloat16) for name, embeds in table.items()}
    assert not torch.equal(halved["prompt_embeds"].float(), table["prompt_embeds"])  # bf16 did round something
    transformer = copy.deepcopy(sd3_pipe.transformer).to(weights)
    x_s, sigma = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([0.9, 0.5, 0.1])
    index = prompt_indices(torch.tensor([1, NEGATIVE, 0]))
    with torch.no_grad():
        v = [Autocast(TableVelocity(DiffusersVelocity(transformer), PromptTable.from_tensors(t)), "cpu")(
             x_s, sigma, index) for t in (table, halved)]
    assert torch.equal(v[0], v[1])


def test_prepare_stores_the_table_in_bf16_under_bf16_mixed_precision(sd3_dir, tmp_path):
    from dmd2.config import config_from_dict
    from dmd2.families.sd3.family import SD3Family

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na red dog\n")
    family = SD3Family()
    configs = {precision: family.resolve(config_from_dict({
        "model": {"family": "sd3", "teacher": str(sd3_dir)}, "data": {"prompts": str(prompts)},
        "train": {"mixed_precision": precision}}), tmp_path) for precision in ("no", "bf16")}
    tables = {precision: family.prepare(config)["prompts"] for precision, config in configs.items()}
    for name, embeds in tables["no"].items():
        assert embeds.dtype == torch.float32 and tables["bf16"][name].dtype == torch.bfloat16
        assert torch.equal(tables["bf16"][name], embeds.to(torch.bfloat16))
    assert family.prepared_key(configs["no"]) != family.prepared_key(configs["bf16"])
