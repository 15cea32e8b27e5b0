"""dmd2/families/sd3/prompts.py: prompt files, digests, and the encoded prompt table."""

import json
import math
import shutil

import pytest
import torch

from dmd2.families.sd3.prompts import (
    encode_prompt_table,
    encoder_fingerprint,
    load_text_pipeline,
    prompts_digest,
    read_prompts,
)
from tests.dmd2.families.prepared_parts import assert_parts_merge_to_the_whole
from tests.dmd2.families.sd3.tiny_pipeline import CLIP_MAX_LENGTH, JOINT_ATTENTION_DIM

PROMPTS = ["a photo of a cat", "a red dog", "the blue sign", "a cat on the sign", "dog"]
SEQUENCE_LENGTH = 12  # T5 tokens; the table's L = CLIP's 32 + 12


def test_read_prompts_from_text_skips_blank_lines(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a photo of a cat\n\n   \n  a red dog  \nthe blue sign")
    assert read_prompts(path) == ["a photo of a cat", "a red dog", "the blue sign"]


def test_read_prompts_from_jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "a photo of a cat", "id": 7}\n\n{"prompt": "a red dog"}\n')
    assert read_prompts(path) == ["a photo of a cat", "a red dog"]


def test_read_prompts_refuses_a_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"\[data\] prompts .*missing\.txt: does not exist"):
        read_prompts(tmp_path / "missing.txt")


def test_read_prompts_refuses_an_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"\[data\] prompts .*empty\.txt: holds no prompt"):
        read_prompts(path)


def test_read_prompts_refuses_a_file_that_is_not_text(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ValueError, match=r"\[data\] prompts .*binary\.txt: cannot be read as UTF-8"):
        read_prompts(path)


@pytest.mark.parametrize("bad_line, problem", [
    ('{"text": "a cat"}', 'has no string "prompt" field'),
    ('{"prompt": 3}', 'has no string "prompt" field'),
    ('["a cat"]', 'has no string "prompt" field'),
    ("a cat", "is not JSON"),
])
def test_read_prompts_names_the_bad_jsonl_line(tmp_path, bad_line, problem):
    path = tmp_path / "prompts.jsonl"
    path.write_text(f'{{"prompt": "a red dog"}}\n\n{bad_line}\n')
    with pytest.raises(ValueError) as error:
        read_prompts(path)
    message = str(error.value)
    assert "[data] prompts" in message and str(path) in message and f"line 3 {problem}" in message


def test_prompts_digest_covers_every_input():
    base = prompts_digest(PROMPTS, "", "encoders")
    assert base == prompts_digest(list(PROMPTS), "", "encoders") and len(base) == 64
    changed = [prompts_digest(PROMPTS[:-1], "", "encoders"), prompts_digest(PROMPTS[::-1], "", "encoders"),
               prompts_digest(PROMPTS, "blurry", "encoders"), prompts_digest(PROMPTS, "", "other encoders"),
               prompts_digest(PROMPTS, "", "encoders", max_sequence_length=77)]
    assert len({base, *changed}) == 1 + len(changed)


def test_encoder_fingerprint_follows_the_encoder_files(sd3_dir, tmp_path):
    copy = shutil.copytree(sd3_dir, tmp_path / "copy")
    fingerprint = encoder_fingerprint(copy)
    assert fingerprint == encoder_fingerprint(sd3_dir)
    (copy / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"not an encoder")
    assert encoder_fingerprint(copy) == fingerprint  # the transformer does not shape prompt embeddings
    weights = copy / "text_encoder_3" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight: same name, same size
    weights.write_bytes(bytes(data))
    assert encoder_fingerprint(copy) != fingerprint
    tokenizer = json.loads((copy / "tokenizer_3" / "tokenizer_config.json").read_text())
    (copy / "tokenizer_3" / "tokenizer_config.json").write_text(json.dumps({**tokenizer, "model_max_length": 7}))
    assert len({fingerprint, encoder_fingerprint(copy)}) == 2


def counting(monkeypatch, pipe):
    calls = []
    encode = pipe.encode_prompt

    def counted(**kwargs):
        calls.append(kwargs["prompt"])
        return encode(**kwargs)

    monkeypatch.setattr(pipe, "encode_prompt", counted)
    return calls


def test_encode_prompt_table_shapes_and_calls(sd3_pipe, monkeypatch):
    calls = counting(monkeypatch, sd3_pipe)
    table = encode_prompt_table(sd3_pipe, PROMPTS, "blurry", batch_size=2, max_sequence_length=SEQUENCE_LENGTH)
    length, pooled = CLIP_MAX_LENGTH + SEQUENCE_LENGTH, 32
    assert table["prompt_embeds"].shape == (len(PROMPTS), length, JOINT_ATTENTION_DIM)
    assert table["pooled_prompt_embeds"].shape == (len(PROMPTS), pooled)
    assert table["negative_prompt_embeds"].shape == (1, length, JOINT_ATTENTION_DIM)
    assert table["negative_pooled_prompt_embeds"].shape == (1, pooled)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 and not t.requires_grad for t in table.values())
    assert len(calls) == math.ceil(len(PROMPTS) / 2) + 1
    assert calls[-1] == ["blurry"]


def test_encode_prompt_table_rows_are_the_prompts_encoded_alone(sd3_pipe):
    table = encode_prompt_table(sd3_pipe, PROMPTS, "blurry", batch_size=3, max_sequence_length=SEQUENCE_LENGTH)
    alone = [PROMPTS[i] for i in range(len(PROMPTS))] + ["blurry"]
    rows = [sd3_pipe.encode_prompt(p, None, None, do_classifier_free_guidance=False,
                                   max_sequence_length=SEQUENCE_LENGTH) for p in alone]
    embeds = torch.cat([table["prompt_embeds"], table["negative_prompt_embeds"]])
    pooled = torch.cat([table["pooled_prompt_embeds"], table["negative_pooled_prompt_embeds"]])
    for i, (row_embeds, _, row_pooled, _) in enumerate(rows):
        torch.testing.assert_close(embeds[i:i + 1], row_embeds, atol=1e-6, rtol=0)
        torch.testing.assert_close(pooled[i:i + 1], row_pooled, atol=1e-6, rtol=0)
    assert not torch.allclose(embeds[0], embeds[1])  # the prompts do differ


def test_encode_prompt_table_negative_row_is_the_pipelines_negative(sd3_pipe):
    table = encode_prompt_table(sd3_pipe, PROMPTS[:1], "blurry", max_sequence_length=SEQUENCE_LENGTH)
    _, negative, _, negative_pooled = sd3_pipe.encode_prompt(
        PROMPTS[0], None, None, do_classifier_free_guidance=True, negative_prompt="blurry",
        max_sequence_length=SEQUENCE_LENGTH)
    torch.testing.assert_close(table["negative_prompt_embeds"], negative, atol=1e-6, rtol=0)
    torch.testing.assert_close(table["negative_pooled_prompt_embeds"], negative_pooled, atol=1e-6, rtol=0)


def test_encode_prompt_table_refuses_no_prompts(sd3_pipe):
    with pytest.raises(ValueError, match=r"\[data\] prompts: no prompt"):
        encode_prompt_table(sd3_pipe, [], "")


def test_load_text_pipeline_holds_only_the_text_encoders(sd3_dir, sd3_pipe):
    text = load_text_pipeline(sd3_dir)
    assert text.transformer is None and text.vae is None
    ours = encode_prompt_table(text, PROMPTS[:2], "", max_sequence_length=SEQUENCE_LENGTH)
    full = encode_prompt_table(sd3_pipe, PROMPTS[:2], "", max_sequence_length=SEQUENCE_LENGTH)
    for key in ours:
        torch.testing.assert_close(ours[key], full[key], atol=0, rtol=0)


def test_load_text_pipeline_loads_in_the_asked_dtype(sd3_dir):
    text = load_text_pipeline(sd3_dir, dtype=torch.bfloat16)
    table = encode_prompt_table(text, PROMPTS[:1], "", max_sequence_length=SEQUENCE_LENGTH)
    assert {t.dtype for t in table.values()} == {torch.bfloat16}


def test_load_text_pipeline_refuses_a_pipeline_without_t5(sd3_dir, tmp_path):
    copy = shutil.copytree(sd3_dir, tmp_path / "no_t5", ignore=shutil.ignore_patterns("*3"))
    index = json.loads((copy / "model_index.json").read_text())
    index["text_encoder_3"] = index["tokenizer_3"] = [None, None]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="no text_encoder_3"):
        load_text_pipeline(copy)


def test_load_text_pipeline_refuses_other_pipelines(sd_dir):
    with pytest.raises(ValueError, match="StableDiffusion3Pipeline"):
        load_text_pipeline(sd_dir)


def test_parts_encoded_by_several_workers_merge_into_the_table_one_worker_makes(sd3_dir, tmp_path):
    """21 prompts and the first 4 again as the eval set: 25 rows, 4 encoder batches, in 3 parts (2 + 1 + 1 batches)."""
    from dmd2.config import config_from_dict
    from dmd2.families.sd3.family import SD3Family

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(21)) + "\n")
    config = config_from_dict({"model": {"family": "sd3", "teacher": str(sd3_dir)},
                               "data": {"prompts": str(prompts), "max_sequence_length": SEQUENCE_LENGTH}})
    parts = assert_parts_merge_to_the_whole(SD3Family(), config, 3)
    assert [len(part["prompts"]["prompt_embeds"]) for part in parts] == [16, 8, 1]
