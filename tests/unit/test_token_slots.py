"""PlacedObjects: the paged slots of a load's or a store's objects, in one vectorized pass,
against a per-token reference written from the contract (block b holds tokens
[b*B, (b+1)*B) of the cache; tokens outside [skip, take) of an object are -1)."""

import random

import pytest
import torch

from vllm_kvplugin.chunk.format import ChunkError
from vllm_kvplugin.transfer.placement import PlacedObjects


def reference(block_rows, block_size, tokens, skips, takes):
    out = []
    for blocks, skip, take in zip(block_rows, skips, takes):
        out.append([blocks[t // block_size] * block_size + t % block_size if skip <= t < take else -1
                    for t in range(tokens)])
    return out


@pytest.mark.parametrize("seed", range(20))
def test_matches_the_per_token_reference(seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 16, 32, 128])
    per = rng.choice([1, 2, 4, 16])
    tokens = block_size * per
    rows = rng.randint(1, 12)
    block_rows = [[rng.randrange(0, 4096) for _ in range(per)] for _ in range(rows)]
    skips = [rng.randint(0, tokens) for _ in range(rows)]
    takes = [rng.randint(s, tokens) for s in skips]
    if seed % 3 == 0:  # whole objects (no token masked), but for one row's at most
        skips, takes = [0] * rows, [tokens] * rows
        if seed % 2:
            takes[-1] = rng.randrange(tokens)
    got = PlacedObjects.of(block_rows, block_size, tokens, skips, takes).slots()
    want = reference(block_rows, block_size, tokens, skips, takes)
    assert got.shape == (rows, tokens) and got.dtype == torch.int64 and got.is_contiguous()
    assert got.tolist() == want
    assert PlacedObjects.of(block_rows, block_size, tokens, skips, takes).count() == \
        sum(s >= 0 for row in want for s in row)


def test_a_row_with_the_wrong_number_of_blocks_is_a_plan_error():
    with pytest.raises(ChunkError, match="3 blocks of 16 for an object of 32 tokens"):
        PlacedObjects.of([[1, 2], [3, 4, 5]], 16, 32, [0, 0], [32, 32])


@pytest.mark.parametrize("seed", range(10))
def test_placed_objects_rows_and_counts(seed):
    """PlacedObjects: spans clipped to the object, taken by slice like a slots
    tensor's rows, and its count the slots written."""
    rng = random.Random(100 + seed)
    block_size, per = rng.choice([1, 16]), rng.choice([1, 4])
    tokens = block_size * per
    rows = rng.randint(1, 8)
    block_rows = [[rng.randrange(0, 512) for _ in range(per)] for _ in range(rows)]
    skips = [rng.randint(-3, tokens + 3) for _ in range(rows)]
    takes = [rng.randint(-3, tokens + 3) for _ in range(rows)]
    placed = PlacedObjects.of(block_rows, block_size, tokens, skips, takes)
    want = reference(block_rows, block_size, tokens, skips, takes)
    assert placed.slots().tolist() == want
    assert placed.count() == sum(s >= 0 for row in want for s in row)
    assert all(0 <= lo <= hi <= tokens for lo, hi in placed.spans.tolist())
    a, b = sorted(rng.sample(range(rows + 1), 2))
    assert placed[a:b].slots().tolist() == want[a:b]
    blocks, spans = placed.tensors()
    assert blocks.dtype == spans.dtype == torch.int64 and blocks.is_contiguous() and spans.is_contiguous()
    assert blocks.tolist() == block_rows and tuple(spans.shape) == (rows, 2)
    with pytest.raises(TypeError, match="by a slice"):
        placed[0]
