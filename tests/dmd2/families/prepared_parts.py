"""What every text family's preparation in parts must give (`ModelFamily.prepare` with a part, `merge_prepared`)."""

import torch


def assert_parts_merge_to_the_whole(family, config, count: int) -> list[dict]:
    """``count`` workers' parts of ``config``'s prepared inputs, merged, are the inputs one worker makes, bit for bit
    (every table, every tensor); returns the parts."""
    whole = family.prepare(config)
    parts = [family.prepare(config, (index, count)) for index in range(count)]
    merged = family.merge_prepared(parts)
    assert merged.keys() == whole.keys()
    for table in whole:
        assert merged[table].keys() == whole[table].keys(), table
        for name, tensor in whole[table].items():
            assert merged[table][name].dtype == tensor.dtype and torch.equal(merged[table][name], tensor), (table, name)
    return parts
