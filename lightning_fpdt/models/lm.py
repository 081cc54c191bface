"""The LightningModule that trains a decoder on dict batches, and the contract that decoder fulfils.

:class:`CausalLM` trains any module that provides :class:`DecoderModel` (the bundled Llama and GPT, or a
user's own model, docs/own-model.md); the contract is checked when the model is assigned to
``CausalLM.model``, so a model that does not fit is refused at construction, not in the first step.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any, Protocol, TypeVar, runtime_checkable

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_fpdt.accumulation import TokenWindow, scale_window_gradients
from lightning_fpdt.layout import PackedDocuments, default_position_ids, shard_batch
from lightning_fpdt.loss import cross_entropy_sum, tiled_cross_entropy_sum, token_weighted_loss

OWN_MODEL_DOC = "docs/own-model.md"


class DecoderModel(Protocol):
    """What :class:`CausalLM` needs from its ``model``.

    Attributes:
        lm_head: the output projection, an ``nn.Linear`` from the hidden size to the vocabulary (weight
            ``[vocab, hidden]``); tied to the token embedding or not. A bias is allowed only with
            ``CausalLM(loss_tiles=1)`` (the tiled loss multiplies by the weight alone).
    """

    lm_head: nn.Linear

    def hidden_states(
        self, input_ids: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None
    ) -> Tensor:
        """Final (normed) hidden states ``[batch, s_local, hidden]`` of this rank's tokens.

        Args:
            input_ids: ``[batch, s_local]`` token ids (this rank's shard under sequence parallelism).
            position_ids: ``[batch, s_local]`` global positions (restarting at 0 at each packed document).
            documents: the batch's packed documents (``None``: one document per sample), to pass on to
                every sequence-parallel attention layer (``FPDTBlock(x, position_ids, documents)``). The
                parameter may be left out, and then batches of packed documents are refused.
        """
        ...


@runtime_checkable
class CountsFlops(Protocol):
    """Optional for a :class:`DecoderModel`: training FLOPs per token, read by Lightning's throughput
    monitors for FLOP/s and MFU."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at global sequence length ``seq_len``."""
        ...


class PendingWeights(Protocol):
    """The weights a :class:`CausalLM`'s model, built on the meta device, still has to read (a checkpoint on
    disk: ``HFCausalLM(path)``, ``LlamaLM(hf_checkpoint=...)``, ``GPTLM(hf_checkpoint=...)``). ``CausalLM``
    reads them where they are needed (:meth:`CausalLM.configure_model`, :meth:`CausalLM.load_sharded_weights`,
    :meth:`CausalLM.load_state_dict`, the first forward)."""

    def tensor_names(self) -> list[str]:
        """The names (in the model) of the tensors it fills: every parameter (a tied one once) and persistent
        buffer."""
        ...

    def materialize(self, device: torch.device | str) -> None:
        """Give the model uninitialised tensors on ``device`` (tied weights tied again) and its computed buffers
        (RoPE's inverse frequencies), without reading anything."""
        ...

    def load_whole(self, device: torch.device | str) -> None:
        """Materialise the model on ``device`` and read every tensor into it: one copy, in the model's dtypes."""
        ...

    def load_shards(self, root: nn.Module, device: torch.device | str) -> None:
        """After FSDP2's ``fully_shard`` (``root``: the module the root ``fully_shard`` was applied to, holding the
        model): materialise ``root`` on ``device`` and read into each parameter's local shard only the rows of
        dim 0 this rank owns."""
        ...


Config = TypeVar("Config")


def with_overrides(config: Config, overrides: dict[str, Any] | None, owner: str) -> Config:
    """A copy of the dataclass ``config`` with the fields of ``overrides`` replaced (validated again).

    Raises:
        ValueError: a key that is not a field of the config, named with the fields there are.
    """
    if not overrides:
        return config
    names = [f.name for f in dataclasses.fields(config)]
    unknown = [key for key in overrides if key not in names]
    if unknown:
        raise ValueError(f"{owner}: config_overrides {unknown} are not fields of {type(config).__name__}; its fields"
                         f" are {names}.")
    return dataclasses.replace(config, **overrides)


def check_decoder_model(model: nn.Module, owner: str, loss_tiles: int | None) -> bool:
    """Check that ``model`` provides :class:`DecoderModel`; returns whether its ``hidden_states`` takes
    ``documents``.

    Raises:
        TypeError: a missing or unfit member, named with the fix.
        ValueError: an ``lm_head`` with a bias under a tiled loss (``loss_tiles`` other than 1).
    """
    name = type(model).__name__
    method = getattr(model, "hidden_states", None)
    if not callable(method):
        raise TypeError(
            f"{owner}: the model {name} has no hidden_states(input_ids, position_ids, documents=None) method"
            f" returning the final hidden states [batch, s_local, hidden]; add one ({OWN_MODEL_DOC})."
        )
    signature = inspect.signature(method)
    try:
        signature.bind(None, None)
    except TypeError:
        raise TypeError(
            f"{owner}: {name}.hidden_states{signature} cannot be called as hidden_states(input_ids,"
            f" position_ids); give it that signature, with an optional third parameter documents"
            f" ({OWN_MODEL_DOC})."
        ) from None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        found = "no lm_head" if head is None else f"lm_head of type {type(head).__name__}"
        raise TypeError(
            f"{owner}: the model {name} has {found}; CausalLM needs model.lm_head, the output projection as an"
            f" nn.Linear(hidden, vocab) (tied to the token embedding or not) ({OWN_MODEL_DOC})."
        )
    if head.bias is not None and loss_tiles != 1:
        raise ValueError(
            f"{owner}: {name}.lm_head has a bias, which the tiled loss (loss_tiles={loss_tiles}) does not add;"
            " build lm_head with bias=False, or set loss_tiles=1 (full logits)."
        )
    return "documents" in signature.parameters


def config_and_options(config: dict[str, Any], options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config, options)`` with a ``loss_tiles`` key of a model's config dict moved to the LightningModule's
    options: the loss's tiles are :class:`CausalLM`'s, and older checkpoints and YAMLs kept them in the config.

    Raises:
        ValueError: ``loss_tiles`` in both, with different values.
    """
    if "loss_tiles" not in config:
        return config, options
    config = dict(config)
    tiles = config.pop("loss_tiles")
    if "loss_tiles" in options and options["loss_tiles"] != tiles:
        raise ValueError(
            f"CausalLM: loss_tiles={options['loss_tiles']!r} and config.loss_tiles={tiles!r} disagree; loss_tiles"
            " is the LightningModule's option: give it once, outside the model config."
        )
    return config, {**options, "loss_tiles": tiles}


class AnswerAccuracy(Metric):
    """Fraction of answer tokens predicted exactly (greedy), summed over every rank that holds some."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("correct", default=torch.tensor(0), dist_reduce_fx="sum")
        self.add_state("total", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, predictions: Tensor, targets: Tensor) -> None:
        self.correct += (predictions == targets).sum()
        self.total += targets.numel()

    def compute(self) -> Tensor:
        return self.correct.float() / self.total.clamp_min(1)


class CausalLM(pl.LightningModule):
    """Next-token training for a decoder ``model`` that provides :class:`DecoderModel`.

    Set ``self.model`` in a subclass's ``__init__`` after ``super().__init__(...)``; the model is checked
    when it is assigned (:func:`check_decoder_model`). Batches are dicts with ``input_ids`` ``[batch, seq]``
    and optionally ``labels`` (Hugging Face convention: unshifted, -100 ignored), ``shift_labels``
    (already shifted, as ``FPDTStrategy`` produces them) and ``position_ids``. The loss is token-weighted
    across every rank, so sequence and data parallel training give the single-process gradient, and across
    the micro-batches of an accumulation window (``accumulate_grad_batches``; :attr:`token_window`, a
    :class:`~lightning_fpdt.accumulation.TokenWindow`), so the optimizer gets the window's gradient as one batch.

    Args:
        loss_tiles: token tiles of the output projection + cross-entropy, each recomputed in backward, so
            no full ``[tokens, vocab]`` logits tensor exists (``None``: tiles of 1024 tokens; ``1``: off,
            full logits kept for backward). Read by the memory model for ``chunk_size="auto"``.
        learning_rate: peak AdamW learning rate.
        weight_decay: AdamW weight decay for matrices (not for norms, biases and embeddings).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps.
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
    """

    def __init__(
        self,
        loss_tiles: int | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
    ) -> None:
        super().__init__()
        if loss_tiles is not None and (isinstance(loss_tiles, bool) or not isinstance(loss_tiles, int)
                                       or loss_tiles < 1):
            raise ValueError(
                f"{type(self).__name__}: loss_tiles must be a positive int or None (automatic), got {loss_tiles!r}."
            )
        self.loss_tiles = loss_tiles
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.betas = tuple(betas)
        self.warmup_steps = warmup_steps
        self.min_lr_ratio = min_lr_ratio
        self.model: DecoderModel
        self.model_takes_documents = True
        # a subclass whose model is built on the meta device sets what it still has to read (weights_pending)
        self._pending_weights: PendingWeights | None = None
        self.val_answer_accuracy = AnswerAccuracy()
        self.token_window = TokenWindow()  # training losses: one token mean per accumulation window

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "model" and isinstance(value, nn.Module):  # the contract, checked where a model arrives
            self.model_takes_documents = self.check_model(value)
        super().__setattr__(name, value)

    def check_model(self, model: nn.Module) -> bool:
        """Check ``model`` against :class:`DecoderModel` (see :func:`check_decoder_model`); returns whether
        it takes ``documents``. A subclass with its own contract (``HFCausalLM``) overrides this."""
        return check_decoder_model(model, type(self).__name__, self.loss_tiles)

    # ---- weights of a model built on the meta device, read where they are needed ----------------------------

    @property
    def weights_pending(self) -> bool:
        """Whether the model is still on the meta device, its checkpoint's weights not yet read (see
        :meth:`load_weights`, :meth:`configure_model`, :meth:`load_sharded_weights`)."""
        return self._pending_weights is not None

    def load_weights(self, device: torch.device | str = "cpu") -> None:
        """Read the checkpoint's weights into the meta-device model: one copy on ``device``, in the dtypes the
        model has now (nothing happens when no weights are pending). The first forward does this on the input's
        device when nothing did before."""
        pending = self._pending_weights
        if pending is None:
            return
        pending.load_whole(device)
        self._pending_weights = None
        self._weights_loaded()

    def load_sharded_weights(self, device: torch.device | str) -> None:
        """Read into each FSDP2 shard the rows of its checkpoint tensor this rank owns, after ``fully_shard`` was
        applied to the meta-device model (``FPDTStrategy(shard_parameters=True)`` calls this in ``setup`` on every
        rank together), so that no rank ever holds the whole model."""
        pending = self._pending_weights
        if pending is None:
            return
        pending.load_shards(self, device)
        self._pending_weights = None
        self._weights_loaded()

    def _weights_loaded(self) -> None:
        """Called once the pending weights are in (whole or sharded): what a subclass checks on real tensors."""

    def configure_model(self) -> None:
        """Read pending weights (Lightning calls this on every rank before the strategy's setup): on the
        strategy's device, converted to a ``*-true`` precision's dtype first (so a ``bf16-true`` run reads bf16
        straight); left to the strategy when it shards the parameters (``shard_parameters``:
        :meth:`load_sharded_weights`). A subclass that overrides this calls it."""
        if self._pending_weights is None or getattr(self.trainer.strategy, "shard_parameters", False):
            return
        self.trainer.precision_plugin.convert_module(self.model)  # on the meta device: no copy
        self.load_weights(self.trainer.strategy.root_device)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """As ``nn.Module.load_state_dict``. Pending weights are not read when ``state_dict`` holds every tensor
        (or ``strict`` makes sure it does): the model is only materialised on the CPU; otherwise they are read
        first (Lightning's fork/spawn launcher loads the workers' full weights into the parent non-strictly)."""
        pending = self._pending_weights
        if pending is not None:
            names = [f"model.{name}" for name in pending.tensor_names()]
            if strict or all(name in state_dict for name in names):
                pending.materialize("cpu")
                self._pending_weights = None
        self.load_weights()
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``to``/``cpu``/``cuda``/``double``... as usual; while the weights are pending, a tensor on the meta
        device that ``fn`` cannot move (a device move) stays there, to be read later (dtype changes apply), so
        Lightning's teardown of a launching process that never read them, or a user's ``.to(device)`` before
        the first forward, does not fail on the meta device."""
        if self._pending_weights is None:
            return super()._apply(fn, recurse)

        def on_meta(tensor: Tensor) -> Tensor:
            if not tensor.is_meta:
                return fn(tensor)
            try:
                return fn(tensor)
            except NotImplementedError:  # "Cannot copy out of meta tensor": a device move, no data to move
                try:  # the dtype it would have, read from an empty tensor
                    return tensor.to(fn(torch.empty(0, dtype=tensor.dtype)).dtype)
                except (NotImplementedError, RuntimeError, AssertionError):  # a device this build has not
                    return tensor

        return super()._apply(on_meta, recurse)

    # ---- forward and loss ------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Logits ``[batch, seq, vocab]`` of whole sequences in one process (one document per sample)."""
        self.load_weights(input_ids.device)  # used without a Trainer: the weights at the first forward
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, device=input_ids.device)
        return self.model.lm_head(self.model.hidden_states(input_ids, position_ids))

    def prepared(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as ``FPDTStrategy`` hands it over: pre-shifted targets, position ids, documents.

        A batch that did not come through the strategy (one process, another strategy) gets the same
        preparation here (:func:`lightning_fpdt.layout.shard_batch` with one rank), so packed documents,
        ``attention_mask`` and ``loss_mask`` mean the same with and without sequence parallelism.
        """
        if not isinstance(batch, dict) or "input_ids" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise ValueError(
                f"{type(self).__name__} expects dict batches with 'input_ids' [batch, seq]; got {keys}."
            )
        if "shift_labels" in batch and "documents" in batch:
            return batch
        return shard_batch(batch, 1, 0, owner=type(self).__name__)

    def targets(self, batch: dict[str, Tensor]) -> Tensor:
        """Pre-shifted targets of a batch (``shift_labels``; see :meth:`prepared`)."""
        return self.prepared(batch)["shift_labels"]

    def hidden_states(self, batch: dict[str, Any]) -> Tensor:
        """Final hidden states ``[batch, s_local, hidden]`` of this rank's part of a dict batch.

        Raises:
            ValueError: on every rank, when a batch of any rank holds packed documents (or right padding,
                one more document) and the model's ``hidden_states`` takes no ``documents``: its attention
                would cross the documents' boundaries.
        """
        batch = self.prepared(batch)
        ids, positions, documents = batch["input_ids"], batch["position_ids"], batch["documents"]
        self.load_weights(ids.device)  # used without a Trainer: the weights at the first forward
        if self.model_takes_documents:
            return self.model.hidden_states(ids, positions, documents=documents)
        self._refuse_documents(documents is not None)
        return self.model.hidden_states(ids, positions)

    def _refuse_documents(self, packed: bool) -> None:
        trainer = self._trainer
        anywhere = packed
        if trainer is not None and trainer.world_size > 1:  # every rank raises together, before attention
            anywhere = trainer.strategy.reduce_boolean_decision(packed, all=False)
        if not anywhere:
            return
        where = "this batch holds" if packed else "another rank's batch holds"
        raise ValueError(
            f"{type(self).__name__}: {where} packed documents (position_ids restarting at 0 inside a sample, or"
            f" right padding), but {type(self.model).__name__}.hidden_states takes no 'documents', so its attention"
            f" would cross document boundaries. Add a parameter hidden_states(input_ids, position_ids,"
            f" documents=None) and pass documents to every attention layer (FPDTBlock(x, position_ids, documents);"
            f" {OWN_MODEL_DOC}), or train on unpacked, unpadded samples."
        )

    def loss_terms(self, batch: dict[str, Any], hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)`` of this rank's part of the batch."""
        batch = self.prepared(batch)  # once: hidden_states and targets then find it prepared
        hidden = self.hidden_states(batch) if hidden is None else hidden
        if self.loss_tiles == 1:  # no tiling: full logits, kept for backward by autograd
            return cross_entropy_sum(self.model.lm_head(hidden), self.targets(batch))
        return tiled_cross_entropy_sum(hidden, self.model.lm_head.weight, self.targets(batch), self.loss_tiles)

    def answer_predictions(self, batch: dict[str, Any], hidden: Tensor) -> tuple[Tensor, Tensor]:
        """Greedy predictions and targets where ``answer_mask`` is set (the next token is an answer)."""
        mask = batch["answer_mask"].bool()
        logits = self.model.lm_head(hidden[mask])  # only the answer positions: [n_answer, vocab]
        return logits.argmax(-1), self.targets(batch)[mask]

    def sequence_parallel_size(self) -> int:
        mesh = self.device_mesh
        return 1 if mesh is None else mesh["sequence_parallel"].size()

    def flops_per_token(self, seq_len: int) -> float | None:
        """Training FLOPs per token at global sequence length ``seq_len``: the model's (:class:`CountsFlops`),
        or ``None`` (no FLOP/s or MFU logged). A subclass whose model cannot count overrides this."""
        return self.model.flops_per_token(seq_len) if isinstance(self.model, CountsFlops) else None

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        ids = batch["input_ids"]
        flops = self.flops_per_token(ids.shape[1] * self.sequence_parallel_size())  # of the global sequence
        if flops is not None:  # read by ThroughputMonitor for FLOP/s and MFU
            self.flops_per_batch = flops * ids.numel()
        loss_sum, num_tokens = self.loss_terms(batch)
        trainer = self._trainer
        if trainer is not None and self.automatic_optimization:  # one token mean per accumulation window
            loss, mean = self.token_window.add(loss_sum, num_tokens, trainer.global_step,
                                               trainer.accumulate_grad_batches)
        else:
            loss, mean = token_weighted_loss(loss_sum, num_tokens)
        # the window's mean so far: at the window's last micro-batch, the mean of all its target tokens
        self.log("train/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Finish the accumulation window's gradient (before clipping), unless ``FPDTStrategy`` already did
        (before the step guard): the path for every other strategy. An override must call this."""
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        scale_window_gradients(self, grads)

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        batch = self.prepared(batch)
        hidden = self.hidden_states(batch)
        _, mean = token_weighted_loss(*self.loss_terms(batch, hidden))
        # identical on every rank already; sync_dist only averages equal values
        self.log("val/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        if "answer_mask" in batch:
            self.val_answer_accuracy.update(*self.answer_predictions(batch, hidden))
            self.log("val/answer_accuracy", self.val_answer_accuracy, on_epoch=True, prog_bar=True)
        return mean

    def configure_optimizers(self) -> Any:
        decay, no_decay = [], []
        for name, p in self.named_parameters():
            if not p.requires_grad:
                continue
            (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.learning_rate,
            betas=self.betas,
        )
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1000
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def schedule(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = min(1.0, (step - warmup) / max(1, total - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
