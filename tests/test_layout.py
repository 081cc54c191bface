"""The FPDT layout: permutation, inverse, shards, label shift and padding."""

from __future__ import annotations

import pytest
import torch

from lightning_fpdt.parallel.layout import (
    chunk_lengths,
    fpdt_permutation,
    inverse_permutation,
    local_token_indices,
    padded_length,
    shard_indices,
    shard_sequence,
    shift_labels,
    unshard_sequence,
)


def test_permutation_puts_sub_chunk_r_of_every_chunk_on_rank_r() -> None:
    # S=16, P=2, C=8: chunk 0 = 0..7 -> rank 0 gets 0..3, rank 1 gets 4..7; chunk 1 likewise
    assert shard_indices(16, 2, 0, 8).tolist() == [0, 1, 2, 3, 8, 9, 10, 11]
    assert shard_indices(16, 2, 1, 8).tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    # no chunking: the contiguous split of plain Ulysses
    assert shard_indices(8, 2, 1, None).tolist() == [4, 5, 6, 7]
    # a short last chunk: S=20, C=8 -> chunks 8, 8, 4
    assert chunk_lengths(20, 8) == [8, 8, 4]
    assert shard_indices(20, 2, 1, 8).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 18, 19]


@pytest.mark.parametrize(("seq", "sp", "chunk", "ring"), [(32, 4, 8, 1), (24, 2, None, 1), (20, 2, 8, 1),
                                                         (48, 4, 16, 2)])
def test_local_token_indices_are_the_shards_range(seq: int, sp: int, chunk: int | None, ring: int) -> None:
    """Every range of a rank's local tokens, from the chunks it meets alone, is that range of its shard."""
    for rank in range(sp):
        whole = shard_indices(seq, sp, rank, chunk, ring)
        for first in range(len(whole)):
            for count in range(1, len(whole) - first + 1):
                got = local_token_indices(seq, sp, rank, chunk, first, count, ring)
                assert torch.equal(got, whole[first:first + count]), (seq, sp, chunk, ring, rank, first, count)


@pytest.mark.parametrize(("seq", "sp", "chunk"), [(32, 4, 8), (24, 2, None), (30, 2, 8), (36, 4, 12)])
def test_shard_unshard_roundtrip(seq: int, sp: int, chunk: int | None) -> None:
    x = torch.randn(3, seq, 5)
    perm = fpdt_permutation(seq, sp, chunk)
    assert sorted(perm.tolist()) == list(range(seq))
    assert torch.equal(x[:, perm][:, inverse_permutation(perm)], x)
    shards = [shard_sequence(x, sp, r, chunk) for r in range(sp)]
    assert torch.equal(unshard_sequence(shards, chunk), x)


def test_local_chunk_i_gathers_to_global_chunk_i() -> None:
    seq, sp, chunk = 24, 4, 8
    x = torch.arange(seq).view(1, seq)
    shards = [shard_sequence(x, sp, r, chunk) for r in range(sp)]
    local = chunk // sp
    for i in range(seq // chunk):  # concatenating local chunk i over ranks is global chunk i
        gathered = torch.cat([s[:, i * local:(i + 1) * local] for s in shards], dim=1)
        assert gathered.tolist() == [list(range(i * chunk, (i + 1) * chunk))]


def test_shift_and_padding() -> None:
    labels = torch.tensor([[5, 6, 7, -100]])
    assert shift_labels(labels).tolist() == [[6, 7, -100, -100]]
    assert padded_length(30, 4) == 32
    assert padded_length(29, 2, 8) == 30


def test_layout_errors_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"chunk_size=6 is not divisible by sequence_parallel_size=4"):
        fpdt_permutation(24, 4, 6)
    with pytest.raises(
        ValueError, match=r"sequence length 30 is not divisible by sequence_parallel_size=4.*pad it to 32"
    ):
        fpdt_permutation(30, 4, None)
