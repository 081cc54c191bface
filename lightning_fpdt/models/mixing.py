"""Which modules of an own model (a :class:`~lightning_fpdt.models.contract.DecoderModel`) mix tokens outside its
sequence-parallel attention (:mod:`lightning_fpdt.layers.token_mixing`), with that attention stood in for.

Stood in: every :class:`~lightning_fpdt.layers.block.FPDTAttention` by its self-only form (each query sees its own key,
so its output is ``o_proj(v_proj(x))``, key/value heads repeated: the projections still run, no pipeline does),
and any other :class:`~lightning_fpdt.parallel.binding.SequenceParallelAttention` that is not an ``FPDTBlock`` by its
own forward on each position alone (blocks run whole for the probe, not streamed). The rest of the model (embeddings,
norms, MLPs, whatever the user wrote) runs as it is. ``CausalLM`` refuses such a model when trained on more than one
rank of a sequence-parallel group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_fpdt.layers.block import FPDTAttention, FPDTBlock
from lightning_fpdt.layers.token_mixing import PROBE_LENGTH, TokenMixer, find_token_mixers, probe_ids
from lightning_fpdt.parallel.binding import sequence_parallel_modules
from lightning_fpdt.parallel.layout import default_position_ids


def own_token_mixers(model: nn.Module, vocab_size: int) -> list[TokenMixer]:
    """The modules of ``model`` (its ``hidden_states(input_ids, position_ids)`` run on random ids) that mix tokens
    outside its sequence-parallel attention (names as in ``model``)."""
    device = next(model.parameters()).device
    positions = default_position_ids(1, PROBE_LENGTH, device=device)
    layers = [(name, m) for name, m in model.named_modules() if isinstance(m, FPDTBlock)]
    with _stood_in(model):
        return find_token_mixers(lambda x: model.hidden_states(x, positions), probe_ids(vocab_size, device), model,
                                 layers)


def _self_only(attention: FPDTAttention) -> Any:
    def forward(x: Tensor, position_ids: Tensor, documents: Any = None) -> Tensor:
        b, s, _ = x.shape
        v = attention.v_proj(x).view(b, s, attention.n_kv_heads, attention.head_dim)
        v = v.repeat_interleave(attention.n_heads // attention.n_kv_heads, dim=2)  # [b, s, n_heads, head_dim]
        return attention.o_proj(v.reshape(b, s, attention.n_heads * attention.head_dim))

    return forward


def _each_position_alone(module: nn.Module) -> Any:
    forward = module.forward

    def each(x: Tensor, position_ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return torch.cat([forward(x[:, i:i + 1], position_ids[:, i:i + 1]) for i in range(x.shape[1])], dim=1)

    return each


@contextmanager
def _stood_in(model: nn.Module) -> Iterator[None]:
    replaced = [(m, _self_only(m)) for m in model.modules() if isinstance(m, FPDTAttention)]
    replaced += [(m, _each_position_alone(m)) for _, m in sequence_parallel_modules(model)
                 if not isinstance(m, FPDTBlock) and isinstance(m, nn.Module)]
    with ExitStack() as stack:
        for module, forward in replaced:
            module.forward = forward  # an instance attribute: the class's forward comes back when it is deleted
            stack.callback(module.__dict__.pop, "forward", None)
        for block in (m for m in model.modules() if isinstance(m, FPDTBlock)):
            # a streamed block computes its attention itself (lightning_fpdt.layers.streaming): run it whole, stood in
            stack.callback(setattr, block, "context", block.context)
            block.context = dataclasses.replace(block.context, streaming=False)
        yield
