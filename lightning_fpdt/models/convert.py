"""Weights from and to Hugging Face ``transformers`` (an optional dependency: extra ``hf``), for every bundled
family through its :class:`~lightning_fpdt.models.family.Family` record.

This module sits above the family files: it imports :mod:`~lightning_fpdt.models.llama` and
:mod:`~lightning_fpdt.models.gpt` (their ``FAMILY`` records), never the reverse, and is the one place that lists
the bundled families (:data:`FAMILIES`) and finds one: by our model (:func:`family_of`) or by a saved config dict
(:func:`family_holding`).

Public entry points: :func:`llama_from_hf`, :func:`gpt_from_hf` (both :func:`from_hf`) and :func:`to_hf`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.errors import FPDTError, WrongType
from lightning_fpdt.models import gpt, llama
from lightning_fpdt.models.family import Family, check_table
from lightning_fpdt.models.gpt import GPT
from lightning_fpdt.models.llama import Llama
from lightning_fpdt.optional import require

FAMILIES: tuple[Family, ...] = (llama.FAMILY, gpt.FAMILY)


def family_of(model: nn.Module) -> Family:
    """The family of our ``model``.

    Raises:
        TypeError: a model of no bundled family.
    """
    for family in FAMILIES:
        if isinstance(model, family.model_class):
            return family
    names = ", ".join(f.name for f in FAMILIES)
    raise WrongType(f"to_hf: expected a lightning_fpdt {names.replace(', ', ' or ')}, got {type(model).__name__}.")


def family_holding(config: Mapping[str, Any]) -> Family | None:
    """The family whose config class has every field of the config dict ``config`` (a checkpoint's saved
    hyper-parameters), or ``None``."""
    return next((f for f in FAMILIES if f.holds(config)), None)


def from_hf(model: Any, family: Family, **overrides: Any) -> nn.Module:
    """Our model of ``family`` with the weights of a ``transformers`` model of that family, in its dtype (the
    config: the family's ``config_from_hf``).

    Args:
        model: the ``transformers`` model, or the path of a local model directory (no downloads).
        **overrides: config fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        FileNotFoundError: no directory at the path.
        TypeError: another model class.
        NotImplementedError: what the family's config mapping does not support.
    """
    hf = _resolve(model, family.hf_class)
    ours = family.model_class(family.config_from_hf(hf.config, **overrides)).to(next(hf.parameters()).dtype)
    table = family.weights(ours)
    check_table(ours, table)
    src = dict(hf.named_parameters())
    for w in table:
        _copy(w.ours, w.theirs(src[w.name]), w.name)
    return ours


def llama_from_hf(model: Any, **overrides: Any) -> Llama:
    """A :class:`~lightning_fpdt.models.llama.Llama` with the weights of a ``transformers`` ``LlamaForCausalLM``,
    in its dtype (the config: :func:`~lightning_fpdt.models.llama.llama_config_from_hf`).

    RMSNorm computes in float32, and the RoPE schedule (``rope_theta``, the scaling in ``rope_parameters``:
    linear, Llama 3 or YaRN) and ``max_position_embeddings`` are carried into ``LlamaConfig``, whose
    frequencies equal transformers' bit for bit (:func:`lightning_fpdt.layers.rope.rope_frequencies`). To read a
    model directory where its weights are needed (each rank only its shards), use ``LlamaLM(hf_checkpoint=...)``
    instead: this loads the whole transformers model first.

    Args:
        model: a ``LlamaForCausalLM``, or the path of a local model directory (no downloads).
        **overrides: ``LlamaConfig`` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        FileNotFoundError: no directory at the path.
        TypeError: another model class.
        NotImplementedError: a ``head_dim`` other than ``hidden_size / heads``, or a RoPE type other than
            default, linear, llama3 and yarn (:meth:`~lightning_fpdt.layers.rope.RopeScaling.from_hf`).
    """
    return from_hf(model, llama.FAMILY, **overrides)


def gpt_from_hf(model: Any, **overrides: Any) -> GPT:
    """A :class:`~lightning_fpdt.models.gpt.GPT` with the weights of a ``transformers`` ``GPT2LMHeadModel``, in its
    dtype (the config: :func:`~lightning_fpdt.models.gpt.gpt_config_from_hf`). ``GPTLM(hf_checkpoint=...)`` reads a
    model directory where its weights are needed instead.

    Args:
        model: a ``GPT2LMHeadModel``, or the path of a local model directory (no downloads).
        **overrides: ``GPTConfig`` fields to set instead of the mapped ones (``mlp_tiles``, ...).

    Raises:
        FileNotFoundError: no directory at the path.
        TypeError: another model class.
        NotImplementedError: an activation other than tanh-GELU, or per-layer attention scaling.
    """
    return from_hf(model, gpt.FAMILY, **overrides)


def hf_config_of(model: nn.Module) -> Any:
    """The ``transformers`` config of our ``model`` (its family's ``config_to_hf``).

    Raises:
        TypeError: a model of no bundled family.
        NotImplementedError: a config ``transformers`` has no counterpart of (a GPT with rotary positions).
    """
    family = family_of(model)
    return require("transformers", "to_hf").AutoConfig.for_model(family.model_type,
                                                                  **family.config_to_hf(model.config))


def to_hf(model: Llama | GPT) -> Any:
    """A ``transformers`` model with the weights of ``model``: ``LlamaForCausalLM`` for a ``Llama``,
    ``GPT2LMHeadModel`` for a ``GPT`` (learned positions only).

    Raises:
        NotImplementedError: a ``GPT`` with rotary positions (GPT-2 has no counterpart).
        TypeError: another model class.
    """
    family = family_of(model)
    hf = require("transformers", "to_hf").AutoModelForCausalLM.from_config(hf_config_of(model))
    hf = hf.to(next(model.parameters()).dtype)
    dst = dict(hf.named_parameters())
    for w in family.weights(model):
        _copy(w.theirs(dst[w.name]), w.ours, w.name)
    return hf


def _resolve(model: Any, expected: str) -> Any:
    """A ``transformers`` model instance from an instance or a local model directory."""
    transformers = require("transformers", "Hugging Face import/export")
    if isinstance(model, (str, os.PathLike)):
        if not os.path.isdir(model):
            raise FileNotFoundError(f"No Hugging Face checkpoint directory at {os.fspath(model)!r}.")
        model = transformers.AutoModelForCausalLM.from_pretrained(os.fspath(model), local_files_only=True)
    if type(model).__name__ != expected:
        raise WrongType(f"Expected a transformers {expected}, got {type(model).__name__}.")
    return model


def _copy(dst: Tensor, src: Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise FPDTError(f"Hugging Face weight {name}: shape {tuple(src.shape)} does not fit {tuple(dst.shape)}.")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
