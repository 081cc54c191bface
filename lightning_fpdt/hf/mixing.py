"""Which modules of a transformers model mix tokens outside its attention layers
(:mod:`lightning_fpdt.layers.token_mixing`), with every attention layer stood in for by a position-wise one.

The stand-in is an attention implementation registered under its own name in which each query attends to its
own key only (its output is its value), so the attention layers' projections, norms and gates still run, and a
convolution of q, k or v before the attention call is still seen; transformers builds no mask for it. Used by
``HFCausalLM``, which refuses such a model when bound to more than one rank.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import Tensor, nn
from transformers import AttentionInterface, PreTrainedModel

from lightning_fpdt.hf.layers import decoder_modules
from lightning_fpdt.layers.token_mixing import TokenMixer, find_token_mixers, probe_ids

_SELF_ONLY = "lightning_fpdt_self_only"


def _self_only_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Any,
                         **kwargs: Any) -> tuple[Tensor, None]:
    # each query sees its own key only: the output is its value (kv heads repeated for the query heads),
    # [b, kv, s, d] -> [b, s, h, d] as attention functions return it
    repeat = query.shape[1] // value.shape[1]
    return value.repeat_interleave(repeat, dim=1).transpose(1, 2).contiguous(), None


AttentionInterface.register(_SELF_ONLY, _self_only_attention)


def hf_token_mixers(model: PreTrainedModel) -> list[TokenMixer] | None:
    """The modules of ``model`` that mix tokens outside its attention layers (names as in ``model``); ``None``
    when its weights are still on the meta device (probe again once they are in)."""
    param = next(model.parameters(), None)
    if param is None or param.device.type == "meta":
        return None
    inputs = probe_ids(model.config.get_text_config().vocab_size, param.device)
    before = model.config._attn_implementation
    model.set_attn_implementation(_SELF_ONLY)
    try:
        with position_wise(model):  # what runs sequence-parallel besides attention (hf/short_conv.py, hf/recurrent.py)
            return find_token_mixers(lambda x: model.base_model(input_ids=x, use_cache=False),
                                     inputs, model, decoder_modules(model))
    finally:
        model.set_attn_implementation(before)


@contextmanager
def position_wise(model: nn.Module) -> Iterator[None]:
    """Every sequence-parallel forward installed on a module of ``model`` (a short convolution, a recurrence: each
    has a ``position_wise`` switch) computes each position from itself alone for the duration: the stand-ins of the
    token-mixing probe, as attention's is."""
    forwards = [f for m in model.modules() if hasattr(f := m.__dict__.get("forward"), "position_wise")]
    for f in forwards:
        f.position_wise = True
    try:
        yield
    finally:
        for f in forwards:
            f.position_wise = False
