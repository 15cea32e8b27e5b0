"""A prompt table's parts (dmd2/prompt_index.py): what each of several encoding workers takes, and the merge."""

import pytest
import torch

from dmd2.prompt_index import ENCODE_BATCH, merge_tables, table_part


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 20, 33, 64])
@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_the_parts_are_whole_encoder_batches_in_order_covering_every_row_once(rows, count):
    prompts = [f"prompt {i}" for i in range(rows)]
    batches = [prompts[i:i + ENCODE_BATCH] for i in range(0, rows, ENCODE_BATCH)]  # one encoding's batches
    parts = [table_part(prompts, (index, count)) for index in range(count)]
    assert sum(parts, []) == prompts
    per_part = []
    for part in parts:  # each part is a run of whole batches of that one encoding
        held = [batch for batch in batches if batch[0] in part]
        assert sum(held, []) == part
        per_part.append(len(held))
    assert max(per_part) - min(per_part) <= 1  # as even as whole batches allow (0 when there are fewer batches)
    assert per_part == sorted(per_part, reverse=True)  # part 0 always has rows: the empty ones are last


def test_a_part_out_of_range_is_refused():
    with pytest.raises(ValueError, match="part 2 of 2"):
        table_part(["a"], (2, 2))


def test_merging_concatenates_the_rows_and_keeps_one_negative_row():
    first = {"prompt_embeds": torch.arange(6.).view(2, 3), "negative_prompt_embeds": torch.zeros(1, 3)}
    second = {"prompt_embeds": torch.arange(6., 9.).view(1, 3), "negative_prompt_embeds": torch.zeros(1, 3)}
    merged = merge_tables([first, {}, second])
    assert torch.equal(merged["prompt_embeds"], torch.arange(9.).view(3, 3))
    assert torch.equal(merged["negative_prompt_embeds"], torch.zeros(1, 3))
    with pytest.raises(ValueError, match="no part"):
        merge_tables([{}, {}])
