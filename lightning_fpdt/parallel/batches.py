"""Each batch from the data loader to this rank's shard: checked where it enters, sharded, and refused
together on every rank, never half-way.

:func:`shard_batch` turns a dict batch of whole sequences into this rank's part (labels shifted, targets
dropped at document ends and padding, padded, in the FPDT layout of :mod:`lightning_fpdt.parallel.layout`) by pure
local code; the first collective it meets is an all-to-all inside attention. If the ranks of one
sequence-parallel group hold different batches (different lengths: a hang until the process-group timeout;
the same length and different tokens: silently wrong training), or one rank refuses its batch while the
others go on, some ranks wait forever. :class:`BatchGate` prevents both with one small collective per
batch, before anything else communicates:

1. locally, never raising: a summary of the batch (rank of ``input_ids``, its shape, a fingerprint
   of the token ids), then the checks of :func:`check_tokens` and the sharding, errors kept;
2. one ``all_gather`` of a ``[world, 6]`` int64 table (summary + "refused" flag);
3. every rank reads the same table: a sequence-parallel group whose ranks disagree raises on all of
   its ranks, naming the ranks and the shapes; a refused batch raises its own error on its ranks and
   "another group's batch was refused" everywhere else.

Cost: the fingerprint is one multiply-add pass over the token ids (``batch x seq`` int64) and the
all_gather moves 48 bytes per rank; benchmarks/batch_gate.py measures it against a training step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import PREFIX, FPDTError, WrongType, said_by_every_rank
from lightning_fpdt.parallel.layout import (
    IGNORE_INDEX,
    default_position_ids,
    pad_sequence,
    padded_length,
    shard_sequence,
    shift_labels,
)
from lightning_fpdt.parallel.packed_documents import PackedDocuments, find_documents

DEFAULT_SEQUENCE_KEYS = (
    "input_ids", "labels", "shift_labels", "position_ids", "attention_mask", "loss_mask", "answer_mask",
)
# padding value per sequence key; other keys are padded with 0
_PAD_VALUES = {"shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}

_NOT_A_TENSOR = -1  # summary entry when 'input_ids' is missing or not a tensor
_MIX = 0x9E3779B1  # odd multiplier: the fingerprint weighs each position differently


def input_vocab_size(module: nn.Module) -> int | None:
    """Tokens the module embeds: its ``get_input_embeddings()`` (Hugging Face models) or its first
    ``nn.Embedding`` in module order (the token embedding of the bundled models); ``None`` if none."""
    get = getattr(module, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    return None if embedding is None else embedding.num_embeddings


def target_tokens(batch: Any) -> Tensor | None:
    """Target tokens in this rank's shard of a batch (``shift_labels`` other than -100), a 0-dim tensor on the labels'
    device (counted there: the host does not wait for it); ``None`` when the batch does not say (not a sharded dict
    batch)."""
    labels = batch.get("shift_labels") if isinstance(batch, Mapping) else None
    if not isinstance(labels, Tensor):
        return None
    return (labels != IGNORE_INDEX).sum()


def summary(batch: Any) -> list[int]:
    """``[ndim, batch, seq, fingerprint, n_elements]`` of ``batch["input_ids"]``; never raises."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, Tensor):
        return [_NOT_A_TENSOR, 0, 0, 0, 0]
    shape = list(ids.shape[:2]) + [0] * (2 - min(ids.dim(), 2))
    flat = ids.detach().reshape(-1)
    if flat.numel() == 0 or ids.is_floating_point() or ids.is_complex():
        fingerprint = 0  # refused by check_tokens; the shape still tells the ranks apart
    else:
        weights = torch.arange(1, flat.numel() + 1, device=flat.device, dtype=torch.int64) * _MIX
        fingerprint = int((flat.to(torch.int64) * weights).sum())  # wraps around in int64: fine for a hash
    return [ids.dim(), *shape, fingerprint, flat.numel()]


def check_tokens(batch: Any, vocab_size: int | None) -> None:
    """Refuse ``input_ids``/``labels`` that are empty, not integers, or outside the vocabulary.

    Raises:
        ValueError: an empty batch, or ids/labels out of range (the key, the values and the fix).
        TypeError: ids/labels of a floating-point or bool dtype.
    """
    if not isinstance(batch, Mapping):
        return  # shard_batch says what it needs
    for key in ("input_ids", "labels", "shift_labels"):
        x = batch.get(key)
        if not isinstance(x, Tensor):
            continue
        if x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
            raise WrongType(
                f"{PREFIX}batch[{key!r}] has dtype {x.dtype}; token ids must be integers. Return"
                f" torch.long tensors from your dataset (e.g. torch.tensor(ids, dtype=torch.long))."
            )
        if x.numel() == 0:
            raise FPDTError(
                f"{PREFIX}batch[{key!r}] is empty (shape {tuple(x.shape)}). Drop empty samples in your dataset or"
                " collate function; a batch needs at least one token per sequence-parallel rank."
            )
        if vocab_size is None:
            continue
        valid = x if key == "input_ids" else x[x != IGNORE_INDEX]
        if valid.numel() == 0:
            continue
        low, high = int(valid.min()), int(valid.max())
        if low < 0 or high >= vocab_size:
            allowed = f"[0, {vocab_size})" + ("" if key == "input_ids" else f" or {IGNORE_INDEX} (ignored)")
            raise FPDTError(
                f"{PREFIX}batch[{key!r}] holds values from {low} to {high}, but the model's vocabulary has"
                f" {vocab_size} tokens: allowed are {allowed}. Check the tokenizer against the model's vocab_size."
            )


# ---- this rank's shard ------------------------------------------------------------------------------


def mask_targets(
    shift_labels: Tensor, documents: PackedDocuments | None, loss_mask: Tensor | None, attention_mask: Tensor | None
) -> Tensor:
    """Pre-shifted targets with ``IGNORE_INDEX`` wherever the target token (``t + 1``) is not trained on:
    it starts another document (the last token of a document never predicts the next one), it is
    padding (``attention_mask`` 0), or ``loss_mask`` is 0 there (``loss_mask`` marks target tokens, like
    Hugging Face's ``labels``)."""
    drop = torch.zeros_like(shift_labels, dtype=torch.bool)
    if documents is not None:
        drop |= documents.document_starts(shift_labels.device)
    for mask in (loss_mask, attention_mask):
        if mask is not None:
            drop |= mask.reshape(drop.shape) == 0
    if not bool(drop.any()):
        return shift_labels
    dropped_target = torch.zeros_like(drop)
    dropped_target[:, :-1] = drop[:, 1:]
    return shift_labels.masked_fill(dropped_target, IGNORE_INDEX)


def _check_sequence_keys(batch: Mapping[str, Any], sequence_keys: Sequence[str], b: int, s: int, owner: str) -> None:
    """Refuse a per-token key whose leading dims are not ``[b, s]`` like ``input_ids``', and a ``loss_mask``
    (one entry per target token) that is not exactly ``[b, s]``. ``attention_mask``: see :func:`find_documents`."""
    for key in dict.fromkeys((*sequence_keys, "loss_mask")):
        x = batch.get(key)
        exact = key == "loss_mask"
        if x is None or key == "attention_mask" or isinstance(x, Tensor) and x.shape[:2 + exact] == (b, s):
            continue
        shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        expected = f"[{b}, {s}]" if exact else f"[{b}, {s}, ...]"
        fix = ("it marks each target token to train on (1) or ignore (0): give it the length and padding of"
               " 'input_ids'" if exact else "remove it from `sequence_keys` if it is not per token")
        raise FPDTError(f"{owner}: sequence key {key!r} has shape {shape}, expected {expected} like 'input_ids';"
                        f" {fix}.")


def shard_batch(
    batch: Mapping[str, Any] | Any,
    sp_size: int,
    sp_rank: int,
    chunk_size: int | None = None,
    sequence_keys: Sequence[str] = DEFAULT_SEQUENCE_KEYS,
    pad_token_id: int = 0,
    owner: str = "shard_batch",
    ring_size: int = 1,
) -> dict[str, Any]:
    """This rank's part of a dict batch of whole sequences.

    Steps, in this order: derive ``labels`` from ``input_ids`` if absent; shift them into
    ``shift_labels`` on the *whole* sequence (the next token may live on another rank); add global
    ``position_ids``; find the documents (:func:`find_documents`) and drop the targets that cross a
    document boundary, are padding or are masked by ``loss_mask`` (:func:`mask_targets`); pad every
    sequence key to a multiple of ``sp_size`` (labels with ``IGNORE_INDEX``, ``input_ids`` with
    ``pad_token_id``, others with 0; with a ring of ``ring_size``, to
    :func:`~lightning_fpdt.parallel.layout.layout_multiple`); apply the FPDT layout and keep rank ``sp_rank``'s shard.
    Keys not in ``sequence_keys`` pass through untouched. ``documents`` is added: the batch's
    :class:`PackedDocuments` over the padded length, or ``None`` for plain sequences.

    A batch that is not a mapping is returned as it is when ``sp_size == 1``.

    Raises:
        TypeError: a batch that is not a mapping, with ``sp_size > 1`` (nothing says what to shard).
        ValueError: no ``input_ids``, ``input_ids`` not ``[batch, seq]``, a sequence shorter than
            ``sp_size``, a sequence key whose leading dims differ from ``input_ids``', or a ``loss_mask``
            that is not ``[batch, seq]``.
    """
    if not isinstance(batch, Mapping):
        if sp_size == 1:
            return batch  # nothing to shard: the module gets it as it is
        raise WrongType(
            f"{owner}: sequence_parallel_size={sp_size} needs dict batches with 'input_ids' [batch, seq]"
            f" to shard; got a {type(batch).__name__}."
        )
    if "input_ids" not in batch:
        raise FPDTError(
            f"{owner}: the batch has no 'input_ids'; its keys are {sorted(batch)}. Return a dict with"
            " 'input_ids' [batch, seq] (and optionally 'labels', 'position_ids') from your dataset."
        )
    out = dict(batch)
    ids = out["input_ids"]
    if not isinstance(ids, Tensor) or ids.dim() != 2:
        shape = tuple(ids.shape) if isinstance(ids, Tensor) else type(ids).__name__
        raise FPDTError(f"{owner}: 'input_ids' must be a [batch, seq] tensor, got {shape}.")
    b, s = ids.shape
    if s < sp_size:
        smaller = f" (at most {s})" if s > 0 else ""
        raise FPDTError(
            f"{owner}: the sequence length {s} is shorter than sequence_parallel_size={sp_size}: every rank of"
            f" the sequence-parallel group needs at least one token of each sample. Use samples of at least"
            f" {sp_size} tokens (pad or drop shorter ones), or a smaller sequence_parallel_size{smaller}."
        )
    _check_sequence_keys(out, sequence_keys, b, s, owner)  # before any key is read: no raw reshape errors
    if "shift_labels" not in out:
        labels = out.pop("labels", None)
        out["shift_labels"] = shift_labels(ids if labels is None else labels, IGNORE_INDEX)
    if "position_ids" not in out:
        out["position_ids"] = default_position_ids(b, s, device=ids.device)
    documents = find_documents(out["position_ids"], out.get("attention_mask"), owner)
    out["shift_labels"] = mask_targets(out["shift_labels"], documents, out.get("loss_mask"), out.get("attention_mask"))
    length = padded_length(s, sp_size, chunk_size, ring_size)
    out["documents"] = None if documents is None else documents.padded(length)
    for key in sequence_keys:
        x = out.get(key)
        if x is None:
            continue
        pad = pad_token_id if key == "input_ids" else _PAD_VALUES.get(key, 0)
        x = pad_sequence(x, length, pad)
        out[key] = shard_sequence(x, sp_size, sp_rank, chunk_size, ring_size=ring_size) if sp_size > 1 else x
    return out


# ---- every rank together ----------------------------------------------------------------------------


class BatchGate:
    """Checks and shards every batch, refusing it on every rank together (see the module docstring).

    Args:
        world_size: processes in the run.
        sequence_parallel_size: ranks per sequence-parallel group (consecutive global ranks).
        rank: this process's global rank.
        device: where the collective's tensor lives (the root device).
        vocab_size: the model's vocabulary (:func:`input_vocab_size`), ``None`` to skip the range check.
    """

    def __init__(self, world_size: int, sequence_parallel_size: int, rank: int, device: torch.device,
                 vocab_size: int | None) -> None:
        self.world_size, self.sp, self.rank = world_size, sequence_parallel_size, rank
        self.device, self.vocab_size = device, vocab_size

    def __call__(self, batch: Any, shard: Callable[[Any], Any]) -> Any:
        """``shard(batch)`` once every rank agrees; raises on every rank otherwise."""
        row = summary(batch)
        error: Exception | None = None
        try:
            check_tokens(batch, self.vocab_size)
            batch = shard(batch)
        except Exception as err:
            error = err
        if self.world_size == 1:
            if error is not None:
                raise error
            return batch
        mine = torch.tensor([*row, int(error is not None)], dtype=torch.int64, device=self.device)
        rows = [torch.empty_like(mine) for _ in range(self.world_size)]
        torch.distributed.all_gather(rows, mine)
        table = torch.stack(rows).tolist()
        first = self.rank // self.sp * self.sp
        self._check_group(table, first)
        if error is not None:
            # the same batch on every rank, refused by every rank: the same reason everywhere (a chunk size no budget
            # fits, an id beyond the vocabulary), which a console script prints once
            if all(r == table[0] for r in table):
                said_by_every_rank(error)
            raise error
        if any(r[-1] for r in table):
            raise FPDTError(
                f"{PREFIX}another data-parallel group's batch was refused (its ranks raised the reason); stopping"
                " every rank."
            )
        if any(self._disagrees(table, start) for start in range(0, self.world_size, self.sp)):
            raise FPDTError(
                f"{PREFIX}the ranks of another sequence-parallel group hold different batches (its ranks raised the"
                " reason); stopping every rank."
            )
        return batch

    def _disagrees(self, table: list[list[int]], first: int) -> bool:
        group = [r[:5] for r in table[first:first + self.sp]]
        return any(r != group[0] for r in group)

    def _check_group(self, table: list[list[int]], first: int) -> None:
        if not self._disagrees(table, first):
            return
        ranks = range(first, first + self.sp)
        shapes = ", ".join(f"rank {r}: {table[r][1:3] if table[r][0] >= 0 else 'no input_ids tensor'}" for r in ranks)
        same_shape = len({tuple(table[r][:3]) for r in ranks}) == 1
        what = "different token ids (same shape)" if same_shape else "different input_ids shapes"
        raise FPDTError(
            f"{PREFIX}the ranks {list(ranks)} of one sequence-parallel group hold {what} ({shapes}). Every rank"
            " of a group must get the same batch: shard the data by data_parallel_rank only (Lightning's"
            " DistributedSampler does this with this strategy; a custom sampler or an IterableDataset must use"
            " trainer.strategy.distributed_sampler_kwargs), with the same seed and order on every rank."
        )
