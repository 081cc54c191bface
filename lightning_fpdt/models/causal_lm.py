"""The LightningModule that trains a decoder on dict batches: next-token loss, token-weighted across ranks and
accumulation windows, optimizer and schedule.

:class:`CausalLM` trains any module that provides :class:`~lightning_fpdt.models.contract.DecoderModel` (the
bundled Llama and GPT, or a user's own model, docs/own-model.md); the contract is checked when the model is
assigned to ``CausalLM.model``, so a model that does not fit is refused at construction, not in the first step.
A model built on the meta device reads its weights where they are needed
(:class:`~lightning_fpdt.models.pending_weights.PendingWeightsModule`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, Unsupported, is_positive_int
from lightning_fpdt.layers.accumulation import TokenWindow, optimizer_gradients, scale_window_gradients
from lightning_fpdt.layers.loss import cross_entropy_sum, tiled_cross_entropy_sum, token_weighted_loss
from lightning_fpdt.layers.token_mixing import TokenMixer, refusal
from lightning_fpdt.models.class_paths import check_saved_class, class_path_of
from lightning_fpdt.models.contract import OWN_MODEL_DOC, CountsFlops, DecoderModel, check_decoder_model, output_norm
from lightning_fpdt.models.metrics import AnswerAccuracy
from lightning_fpdt.models.mixing import own_token_mixers
from lightning_fpdt.models.optimizers import SCHEDULER_BASES, checked_spec, make_optimizers
from lightning_fpdt.models.pending_weights import PendingWeightsModule
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext
from lightning_fpdt.parallel.layout import default_position_ids


class CausalLM(PendingWeightsModule):
    """Next-token training for a decoder ``model`` that provides :class:`~lightning_fpdt.models.contract.DecoderModel`.

    Set ``self.model`` in a subclass's ``__init__`` after ``super().__init__(...)``; the model is checked
    when it is assigned (:func:`check_decoder_model`). Batches are dicts with ``input_ids`` ``[batch, seq]``
    and optionally ``labels`` (Hugging Face convention: unshifted, -100 ignored), ``shift_labels``
    (already shifted, as ``FPDTStrategy`` produces them) and ``position_ids``. The loss is token-weighted
    across every rank, so sequence and data parallel training give the single-process gradient, and across
    the micro-batches of an accumulation window (``accumulate_grad_batches``; :attr:`token_window`, a
    :class:`~lightning_fpdt.layers.accumulation.TokenWindow`), so the optimizer gets the window's gradient as one batch.

    Args:
        loss_tiles: token tiles of the output projection + cross-entropy, each recomputed in backward, so
            no full ``[tokens, vocab]`` logits tensor exists (``None``: tiles of 1024 tokens; ``1``: off,
            full logits kept for backward). Read by the memory model for ``chunk_size="auto"``.
        learning_rate: peak AdamW learning rate (without ``optimizer``).
        weight_decay: AdamW weight decay for matrices (not for norms, biases and embeddings).
        betas: AdamW betas.
        warmup_steps: linear warm-up steps (without ``lr_scheduler``).
        min_lr_ratio: the cosine schedule decays to ``learning_rate * min_lr_ratio``.
        optimizer: any torch optimizer instead of AdamW, as a class path or ``{"class_path", "init_args"}`` (its
            own ``lr`` and ``weight_decay``; norms, biases and embeddings get weight decay 0); ``fpdt-train``'s
            top-level ``optimizer:`` key sets it (:mod:`lightning_fpdt.models.optimizers`).
        lr_scheduler: any torch scheduler instead of the warm-up and cosine, the same way, stepped every optimizer
            step (``ReduceLROnPlateau`` watches ``train/loss``); ``fpdt-train``'s ``lr_scheduler:`` key sets it.
        _class_path: the class a checkpoint's hyper-parameters name (:meth:`on_save_checkpoint`), which
            ``load_from_checkpoint`` hands back: checked to be this class, else refused naming it (private: no CLI
            option).
    """

    def __init__(
        self,
        loss_tiles: int | None = None,
        learning_rate: float = 3e-4,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        optimizer: dict | str | None = None,
        lr_scheduler: dict | str | None = None,
        _class_path: str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_saved_class(_class_path, type(self))
        self.optimizer_spec = checked_spec(optimizer, "optimizer", (torch.optim.Optimizer,), owner)
        self.lr_scheduler_spec = checked_spec(lr_scheduler, "lr_scheduler", SCHEDULER_BASES, owner)
        if loss_tiles is not None and not is_positive_int(loss_tiles):
            raise FPDTError(
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
        self._token_mixer_probe: tuple[tuple[int, ...], list[TokenMixer] | None] | None = None  # (structure, found)
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

    # ---- what mixes tokens outside the sequence-parallel attention --------------------------------------------

    def token_mixers(self) -> list[TokenMixer] | None:
        """The modules of the model that mix tokens outside its sequence-parallel attention (:meth:`_find_token_mixers`;
        names as in the model), probed when first asked for and again only when its modules were replaced; ``None``
        while its weights are pending or on the meta device (nothing to run)."""
        if self.weights_pending or next(self.model.parameters()).is_meta:
            return None
        structure = tuple(id(m) for m in self.model.modules())
        if self._token_mixer_probe is None or self._token_mixer_probe[0] != structure:
            self._call_with_whole_weights("_probe_token_mixers")  # a sharded module: through its FSDP hooks
        return self._token_mixer_probe[1]

    def _probe_token_mixers(self) -> None:
        self._token_mixer_probe = tuple(id(m) for m in self.model.modules()), self._find_token_mixers()

    def _find_token_mixers(self) -> list[TokenMixer] | None:
        """The probe of :meth:`token_mixers` (:func:`~lightning_fpdt.models.mixing.own_token_mixers`); a subclass
        with its own kind of model overrides it."""
        return own_token_mixers(self.model, self.model.lm_head.out_features)

    def refuse_token_mixers(self, sequence_parallel_size: int) -> None:
        """Refuse, on every rank alike (the probe is deterministic), a model with a module that mixes tokens
        outside its sequence-parallel attention when ``sequence_parallel_size > 1`` (``FPDTStrategy`` calls this
        in ``setup``, before any step): it would see only this rank's shard of the sequence.

        Raises:
            NotImplementedError: naming each such module and its layer.
        """
        mixers = self.token_mixers() if sequence_parallel_size > 1 else None
        if mixers:
            named = [dataclasses.replace(m, layer=f"model.{m.layer}" if m.layer else "", module=f"model.{m.module}")
                     for m in mixers]
            raise Unsupported(refusal(type(self).__name__, named, sequence_parallel_size))

    def check_binding(self, sequence_parallel_size: int, activation_checkpointing: bool) -> None:
        """The refusals the run's configuration alone decides about this model under ``FPDTStrategy`` (its token
        mixers beyond one rank): on every rank in ``setup``, and in ``fpdt-train`` before any process starts."""
        self.refuse_token_mixers(sequence_parallel_size)

    def _weights_loaded(self) -> None:
        """Probe the model read from a pretrained directory for token mixers once its weights are in (under a
        sequence-parallel group of more than one rank)."""
        self.refuse_token_mixers(self.sequence_parallel_size())

    # ---- forward and loss ------------------------------------------------------------------------------------

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None) -> Tensor:
        """Logits ``[batch, seq, vocab]`` of whole sequences in one process (one document per sample)."""
        self.load_weights(input_ids.device)  # used without a Trainer: the weights at the first forward
        if position_ids is None:
            position_ids = default_position_ids(*input_ids.shape, device=input_ids.device)
        return self.model.lm_head(self.model.hidden_states(input_ids, position_ids))

    def complete_batch(self, batch: Any) -> Any:
        """``batch`` with what it lacks filled in, before ``FPDTStrategy`` shards and pads it (here: as it is; a
        subclass adds what its loss needs). Called by the strategy rather than through Lightning's
        ``on_before_batch_transfer``, which a data module's own hook would replace."""
        return batch

    def prepared(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch as ``FPDTStrategy`` hands it over: pre-shifted targets, position ids, documents.

        A batch that did not come through the strategy (one process, another strategy) gets the same
        preparation here (:func:`lightning_fpdt.parallel.batches.shard_batch` with one rank), so packed documents,
        ``attention_mask`` and ``loss_mask`` mean the same with and without sequence parallelism.
        """
        if not isinstance(batch, dict) or "input_ids" not in batch:
            keys = sorted(batch) if isinstance(batch, dict) else type(batch).__name__
            raise FPDTError(
                f"{type(self).__name__} expects dict batches with 'input_ids' [batch, seq]; got {keys}."
            )
        if "shift_labels" in batch and "documents" in batch:
            return batch
        return shard_batch(batch, 1, 0, owner=type(self).__name__)

    def targets(self, batch: dict[str, Tensor]) -> Tensor:
        """Pre-shifted targets of a batch (``shift_labels``; see :meth:`prepared`)."""
        return self.prepared(batch)["shift_labels"]

    def hidden_states(self, batch: dict[str, Any], normed: bool = True) -> Tensor:
        """Final hidden states ``[batch, s_local, hidden]`` of this rank's part of a dict batch (``normed=False``:
        before the final norm, for a model with :func:`output_norm`).

        Raises:
            ValueError: on every rank, when a batch of any rank holds packed documents (or right padding,
                one more document) and the model's ``hidden_states`` takes no ``documents``: its attention
                would cross the documents' boundaries.
        """
        batch = self.prepared(batch)
        ids, positions, documents = batch["input_ids"], batch["position_ids"], batch["documents"]
        self.load_weights(ids.device)  # used without a Trainer: the weights at the first forward
        unnormed = {} if normed else {"normed": False}
        if self.model_takes_documents:
            return self.model.hidden_states(ids, positions, documents=documents, **unnormed)
        self._refuse_documents(documents is not None)
        return self.model.hidden_states(ids, positions, **unnormed)

    def _refuse_documents(self, packed: bool) -> None:
        trainer = self._trainer
        anywhere = packed
        if trainer is not None and trainer.world_size > 1:  # every rank raises together, before attention
            anywhere = trainer.strategy.reduce_boolean_decision(packed, all=False)
        if not anywhere:
            return
        where = "this batch holds" if packed else "another rank's batch holds"
        raise FPDTError(
            f"{type(self).__name__}: {where} packed documents (position_ids restarting at 0 inside a sample, or"
            f" right padding), but {type(self.model).__name__}.hidden_states takes no 'documents', so its attention"
            f" would cross document boundaries. Add a parameter hidden_states(input_ids, position_ids,"
            f" documents=None) and pass documents to every attention layer (FPDTBlock(x, position_ids, documents);"
            f" {OWN_MODEL_DOC}), or train on unpacked, unpadded samples."
        )

    def loss_terms(self, batch: dict[str, Any], hidden: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``(loss_sum, num_tokens)`` of this rank's part of the batch."""
        batch = self.prepared(batch)  # once: hidden_states and targets then find it prepared
        if self.loss_tiles == 1:  # no tiling: full logits, kept for backward by autograd
            hidden = self.hidden_states(batch) if hidden is None else hidden
            return cross_entropy_sum(self.model.lm_head(hidden), self.targets(batch))
        norm = None
        if hidden is None:  # a model that can leave its final norm to the loss's tiles does, when layers stream
            norm = output_norm(self.model) if self._streams() else None
            hidden = self.hidden_states(batch, normed=norm is None)
        return tiled_cross_entropy_sum(hidden, self.model.lm_head.weight, self.targets(batch), self.loss_tiles,
                                       norm=norm)

    def _streams(self) -> bool:
        """Whether the bound context lets layers stream (``SequenceParallelContext.streaming``; unbound: yes)."""
        contexts = (getattr(m, "context", None) for m in self.model.modules())
        return next((c.streaming for c in contexts if isinstance(c, SequenceParallelContext)), True)

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

    def setup(self, stage: str) -> None:
        """``fit`` trains every module: a model loaded by ``from_pretrained`` comes back in eval mode, where its
        dropouts would never apply (Lightning keeps the modes it is given)."""
        if stage == "fit":
            self.train()

    def _count_flops(self, ids: Tensor, share: float = 1.0) -> None:
        """``flops_per_batch``, which ``ThroughputMonitor`` reads for FLOP/s and MFU: ``share`` of a training step's
        FLOPs on this rank's ``ids`` (``flops_per_token`` of the global sequence); unset when the model cannot count."""
        flops = self.flops_per_token(ids.shape[1] * self.sequence_parallel_size())
        if flops is not None:
            self.flops_per_batch = flops * share * ids.numel()

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self._count_flops(batch["input_ids"])
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
        scale_window_gradients(self, optimizer_gradients(optimizer))

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        self._count_flops(batch["input_ids"], 1 / 3)  # the forward alone: a third of forward and backward
        batch = self.prepared(batch)
        hidden = self.hidden_states(batch)
        _, mean = token_weighted_loss(*self.loss_terms(batch, hidden))
        # identical on every rank already; sync_dist only averages equal values
        self.log("val/loss", mean, prog_bar=True, batch_size=batch["input_ids"].shape[0], sync_dist=True)
        if "answer_mask" in batch:
            self.val_answer_accuracy.update(*self.answer_predictions(batch, hidden))
            self.log("val/answer_accuracy", self.val_answer_accuracy, on_epoch=True, prog_bar=True)
        return mean

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The checkpoint names its class beside the hyper-parameters (``_class_path``, where LightningCLI looks for
        it), so ``fpdt-train fit --ckpt_path`` rebuilds this class, not the CLI's default model."""
        hparams = checkpoint.get(self.CHECKPOINT_HYPER_PARAMS_KEY)
        if isinstance(hparams, dict):
            hparams["_class_path"] = class_path_of(type(self), within=CausalLM)  # this class, whatever was loaded

    def configure_optimizers(self) -> Any:
        """:func:`~lightning_fpdt.models.optimizers.make_optimizers`: ``optimizer`` and ``lr_scheduler`` when given,
        else AdamW under a warm-up and a cosine decay, on the parameters the strategy set up."""
        total = max(1, int(self.trainer.estimated_stepping_batches)) if self._trainer is not None else 1000
        adamw = {"lr": self.learning_rate, "betas": self.betas, "weight_decay": self.weight_decay}
        return make_optimizers(self, self.optimizer_spec, self.lr_scheduler_spec, adamw, self.warmup_steps,
                               self.min_lr_ratio, total)
