"""The prepared tables: made by one worker or several at once (the same table), and reaching a node's ranks as one
copy (every process maps the same files, downloaded once)."""

import logging
import multiprocessing
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dmd2.config import config_from_dict
from dmd2.families.sd3.conditioning import PromptTable
from dmd2.families.sd3.family import SD3Family
from infra.store import ArtifactStore
from infra.trainers.prepare import store_prepared, load_prepared, prepare_inputs
from tests.dmd2.families.sd3.tiny_pipeline import build_tiny_sd3_pipeline

PROMPTS, LENGTH, WIDTH = 64, 77, 1024  # 20 MB of embeddings (4 bytes each)
BATCH = [3, 17, 40, -1]


def table() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"prompt_embeds": torch.randn(PROMPTS, LENGTH, WIDTH, generator=generator),
            "pooled_prompt_embeds": torch.randn(PROMPTS, 32, generator=generator),
            "negative_prompt_embeds": torch.randn(1, LENGTH, WIDTH, generator=generator),
            "negative_pooled_prompt_embeds": torch.randn(1, 32, generator=generator)}


def private_bytes() -> int:
    """This process's anonymous resident memory (its own, not file pages it shares with the page cache)."""
    return int(re.search(r"RssAnon:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


def a_rank(store_root: str, ref, cache: str, answers) -> None:
    """What a rank does with them: load, then expand a batch of prompt indices into its conditioning."""
    before = private_bytes()
    prompts = PromptTable.from_tensors(load_prepared(ArtifactStore(store_root), ref, cache)["prompts"])
    cond = prompts.cond(torch.tensor(BATCH))
    answers.put((private_bytes() - before, cond["encoder_hidden_states"].sum().item()))


def test_the_ranks_of_a_node_map_one_downloaded_copy_and_read_only_their_batches_rows(tmp_path):
    folder = tmp_path / "made"
    folder.mkdir()
    save_file(table(), str(folder / "prompts.safetensors"))
    store = ArtifactStore(str(tmp_path / "store"))
    ref = store.put_dir("_shared/prepared/key", folder)
    cache = tmp_path / "node-cache"

    context = multiprocessing.get_context("spawn")  # two ranks of one node, loading at the same moment
    answers = context.Queue()
    ranks = [context.Process(target=a_rank, args=(store.root_uri, ref, str(cache), answers)) for _ in range(2)]
    for rank in ranks:
        rank.start()
    results = [answers.get(timeout=120) for _ in ranks]
    for rank in ranks:
        rank.join(timeout=60)
        assert rank.exitcode == 0

    expected = table()
    rows = torch.cat([expected["prompt_embeds"][BATCH[:-1]], expected["negative_prompt_embeds"]])
    table_bytes = expected["prompt_embeds"].nbytes
    for grown, total in results:
        assert total == rows.sum().item()
        assert grown < table_bytes / 4, (grown, table_bytes)  # the batch's rows (1.2 MB) and the interpreter's own
    copies = list(cache.glob("prepared/*/prompts.safetensors"))
    assert len(copies) == 1 and not list(cache.glob("prepared/.*"))  # no second copy, no staging left

    shutil.rmtree(tmp_path / "store")  # a later run on the node reads the copy, not the store
    again = load_prepared(ArtifactStore(str(tmp_path / "store")), ref, cache)["prompts"]
    assert torch.equal(again["prompt_embeds"], expected["prompt_embeds"])


@pytest.mark.slow  # two Ray tasks encoding at once, and one merging
def test_two_workers_each_encoding_a_part_store_the_table_one_worker_stores(shared_ray, tmp_path, caplog):
    """`[data] prepare_workers = 2` on the tiny SD3 pipeline (20 prompts and 4 eval rows: 3 encoder batches, 2 + 1):
    the stored directory is the one a single worker stores, byte for byte (the same manifest digest)."""
    teacher = build_tiny_sd3_pipeline(tmp_path / "teacher")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(f"a photo of cat number {i}" for i in range(20)) + "\n")
    config = config_from_dict({"model": {"family": "sd3", "teacher": str(teacher)},
                               "data": {"prompts": str(prompts), "max_sequence_length": 8}})
    key = SD3Family().prepared_key(config)
    one = store_prepared(SD3Family(), config, ArtifactStore(str(tmp_path / "one")), key)  # one worker: this process
    with caplog.at_level(logging.INFO, logger="infra.trainers.prepare"):
        two, made = prepare_inputs(SD3Family(), config.replace("data", prepare_workers=2),
                                   ArtifactStore(str(tmp_path / "two")))
    assert made and "preparing the inputs on 2 workers" in caplog.text
    assert two.sha256 == one.sha256 and two.nbytes == one.nbytes
