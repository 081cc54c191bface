"""The contract a decoder fulfils to be trained by :class:`~lightning_fpdt.models.causal_lm.CausalLM`.

:class:`DecoderModel` is what ``CausalLM`` needs of its ``model`` (the bundled Llama and GPT, or a user's own
model, docs/own-model.md); :func:`check_decoder_model` checks it when the model is assigned to
``CausalLM.model``, so a model that does not fit is refused at construction, not in the first step.
:class:`CountsFlops` is optional: a model that counts its FLOPs gets FLOP/s and MFU logged.
"""

from __future__ import annotations

import inspect
from typing import Protocol, runtime_checkable

from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.parallel.packed_documents import PackedDocuments

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
class DefersFinalNorm(Protocol):
    """Optional for a :class:`DecoderModel`: its final norm can be left to the tiled loss, which applies it tile by
    tile, so no normed ``[batch, s_local, hidden]`` tensor nor its gradient exists (docs/how-fpdt-works.md, "Every
    layer streams"). ``hidden_states(..., normed=False)`` returns the states before ``final_norm``."""

    final_norm: nn.Module

    def hidden_states(self, input_ids: Tensor, position_ids: Tensor, documents: PackedDocuments | None = None,
                      normed: bool = True) -> Tensor:
        ...


def output_norm(model: nn.Module) -> nn.Module | None:
    """``model``'s final norm when the loss may apply it (:class:`DefersFinalNorm`: a ``final_norm`` module and a
    ``normed`` parameter of ``hidden_states``), else ``None``."""
    norm = getattr(model, "final_norm", None)
    method = getattr(model, "hidden_states", None)
    if not isinstance(norm, nn.Module) or not callable(method):
        return None
    return norm if "normed" in inspect.signature(method).parameters else None


@runtime_checkable
class CountsFlops(Protocol):
    """Optional for a :class:`DecoderModel`: training FLOPs per token, read by Lightning's throughput
    monitors for FLOP/s and MFU."""

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token at global sequence length ``seq_len``."""
        ...


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
        raise WrongType(
            f"{owner}: the model {name} has no hidden_states(input_ids, position_ids, documents=None) method"
            f" returning the final hidden states [batch, s_local, hidden]; add one ({OWN_MODEL_DOC})."
        )
    signature = inspect.signature(method)
    try:
        signature.bind(None, None)
    except TypeError:
        raise WrongType(
            f"{owner}: {name}.hidden_states{signature} cannot be called as hidden_states(input_ids,"
            f" position_ids); give it that signature, with an optional third parameter documents"
            f" ({OWN_MODEL_DOC})."
        ) from None
    head = getattr(model, "lm_head", None)
    if not isinstance(head, nn.Linear):
        found = "no lm_head" if head is None else f"lm_head of type {type(head).__name__}"
        raise WrongType(
            f"{owner}: the model {name} has {found}; CausalLM needs model.lm_head, the output projection as an"
            f" nn.Linear(hidden, vocab) (tied to the token embedding or not) ({OWN_MODEL_DOC})."
        )
    if head.bias is not None and loss_tiles != 1:
        raise FPDTError(
            f"{owner}: {name}.lm_head has a bias, which the tiled loss (loss_tiles={loss_tiles}) does not add;"
            " build lm_head with bias=False, or set loss_tiles=1 (full logits)."
        )
    return "documents" in signature.parameters
