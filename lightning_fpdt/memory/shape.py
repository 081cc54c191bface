"""The shape of a model as the memory model needs it, read from the module itself.

:meth:`ModelShape.from_module` reads a model built from :class:`~lightning_fpdt.layers.block.FPDTBlock` s or wrapping a
Hugging Face decoder (:class:`~lightning_fpdt.models.HFCausalLM`): its decoder layers (through
:func:`lightning_fpdt.parallel.binding.decoder_layers`), its output projection or token embedding, its parameters and
whether its MLP and loss are tiled. No model class is imported: the rules are structural.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from lightning_fpdt.errors import FPDTError
from lightning_fpdt.memory.experts import read_experts
from lightning_fpdt.offload.tiling import configured_tiles
from lightning_fpdt.parallel.binding import DecoderLayer, SequenceMixerMemory, decoder_layers

_EXPLICIT = "set an explicit chunk_size instead of 'auto' (`python -m lightning_fpdt.memory` helps choose one)"


@dataclass(frozen=True)
class LayerKind:
    """What one decoder layer has, for a hybrid: attention, an MLP, and the sequence-parallel modules that mix
    tokens besides attention (:class:`~lightning_fpdt.parallel.binding.SequenceMixerMemory`: a gated delta-net, a
    Mamba-2 mixer, a short convolution)."""

    attention: bool = True
    mlp: bool = True
    mixers: tuple[SequenceMixerMemory, ...] = ()
    streams: bool = True  # nothing refuses it streaming (DecoderLayer.stream_refusal is None)

    def can_stream(self, ring_size: int) -> bool:
        """Whether, checkpointed in two or more chunks, the layer streams: attention with per-token work
        (:mod:`lightning_fpdt.layers.streaming`), or token mixers whose state is carried from chunk to chunk and no
        attention (:mod:`lightning_fpdt.layers.carried`: not under a ring, whose chunks are not in sequence order)."""
        carried = bool(self.mixers) and not self.attention and ring_size == 1 and all(m.chunked for m in self.mixers)
        return self.streams and (carried or (self.attention and not self.mixers))


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs to know about a decoder; :meth:`from_module` reads it from a model.

    Attributes:
        hidden_size: width of the residual stream (the blocks' input and output).
        num_layers: FPDT blocks.
        num_heads: query heads of each block's attention.
        num_kv_heads: key/value heads of each block's attention.
        intermediate_size: the MLP's inner width.
        vocab_size: logits per token (the output projection's width).
        num_params: parameters of the whole model, each shared (tied) parameter once.
        tied_embeddings: the output projection shares the token embedding's weight.
        head_dim: per-head width of q and k (and of v unless ``v_head_dim``); ``None`` means ``hidden_size //
            num_heads``.
        mlp_projections: linear layers producing the intermediate: 2 gated (SwiGLU's gate and up), 1 plain (GELU).
        block_params: parameters of one block (FSDP2 gathers it; every expert); ``None``: from ``num_params``.
        norm_extras: hidden-wide tensors a block's norms keep besides their input (LayerNorm 0, RMSNorm 1 each).
        chunked_projections: q/k/v are projected chunk by chunk inside the attention pipeline (``FPDTBlock``);
            ``False`` (Hugging Face layers): the whole local q/k/v exist while a layer runs.
        mlp_tiles: the MLP's ``num_tiles`` when it is tiled, sized by the rule of :mod:`lightning_fpdt.offload.tiling`;
            ``None``: automatic (also for an untiled MLP: what an estimate with ``mlp_tiled`` assumes).
        loss_tiles: the loss's ``num_tiles`` when it is tiled, likewise.
        experts_per_token: an MoE layer's ``top_k`` (1: dense): MLP activations count once per routed expert.
        layers: what each decoder layer has (:class:`LayerKind`), for a hybrid; ``None``: every layer an attention
            layer with an MLP.
        v_head_dim: per-head width of v and of the attention output, where it differs from ``head_dim`` (multi-head
            latent attention: DeepSeek-V2/V3, MiniCPM3); ``None`` means ``head_dim``.
        trainable_params: parameters the optimizer updates (``requires_grad``: LoRA's adapters alone); ``None``: all
            of ``num_params``. Gradients and optimizer state are counted for these only.
        block_trainable: the trainable parameters of one block; ``None``: ``block_params`` when everything trains.
        head_trainable: the output projection gets a gradient (``False``: frozen, as under LoRA).
        mlp_adapter_values: intermediate-wide values per token LoRA's adapters on the MLP's projections into the
            intermediate add to a tile's backward (one for gate and up both adapted).
        capped_attention: the attention caps its logits (Gemma-2's softcap): a route whose kernels cannot cap
            computes the scores of its blocks (:mod:`lightning_fpdt.memory.scores`).
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    num_params: int
    tied_embeddings: bool = False
    head_dim: int | None = None
    mlp_projections: int = 2
    block_params: int | None = None
    norm_extras: int = 2
    chunked_projections: bool = True
    mlp_tiles: int | None = None
    loss_tiles: int | None = None
    experts_per_token: int = 1
    layers: tuple[LayerKind, ...] | None = None
    v_head_dim: int | None = None
    trainable_params: int | None = None
    block_trainable: int | None = None
    head_trainable: bool = True
    mlp_adapter_values: int = 0
    capped_attention: bool = False

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", self.head_dim)

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's :class:`LayerKind` (every one the default: attention and an MLP, unless :attr:`layers`)."""
        return self.layers if self.layers is not None else (LayerKind(),) * self.num_layers

    @property
    def mlp_intermediates(self) -> int:
        """Values an untiled MLP keeps per token for backward: two intermediate-wide tensors per projection
        (SwiGLU: gate, up, silu(gate) and the product; GELU: fc's output and the activation's)."""
        return (2 * self.mlp_projections + self.mlp_adapter_values) * self.intermediate_size * self.experts_per_token

    @classmethod
    def from_module(cls, module: nn.Module) -> tuple[ModelShape, dict[str, bool]]:
        """The shape of a model built from :class:`~lightning_fpdt.layers.block.FPDTBlock` s or wrapping a Hugging
        Face decoder (:class:`~lightning_fpdt.models.HFCausalLM`), and whether its MLP and loss are tiled
        (``{"mlp_tiled": ..., "loss_tiled": ...}``, fields of :class:`EstimateOptions`).

        What is read, and from where (``module`` may be the ``LightningModule`` or the model inside it):

        - the decoder layers (:func:`~lightning_fpdt.parallel.binding.decoder_layers`: the FPDT blocks, or the
          transformers decoder layers, sized from the model's config), which must all have the same shape:
          ``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``v_head_dim``;
        - ``norm_extras``: 0 for each LayerNorm of a layer, 1 for any other norm (RMSNorm);
        - the MLP (inside its tiling if tiled): its output projection is its last ``nn.Linear`` back to
          ``hidden_size``; ``intermediate_size`` is that layer's ``in_features`` and ``mlp_projections`` is
          the width of its other ``nn.Linear`` s over the intermediate (2 for a gated MLP, fused or not); an MoE
          MLP's experts likewise, and its ``top_k`` (:mod:`lightning_fpdt.memory.experts`). It is tiled when
          every layer's MLP is, in ``mlp_tiles`` tiles (:func:`~lightning_fpdt.offload.tiling.configured_tiles`);
        - ``vocab_size``: the ``out_features`` of the output projection, the widest ``nn.Linear`` outside
          the layers that reads ``hidden_size``; without one, the ``num_embeddings`` of the first
          ``nn.Embedding`` of width ``hidden_size`` outside the layers (the token embedding, taken as
          tied). Embeddings are tied when the output projection's weight is such an embedding's weight;
        - ``num_params``: every parameter of ``module``, shared ones once (position embeddings, norms
          and biases included); ``trainable_params``, ``block_trainable`` and ``head_trainable`` from their
          ``requires_grad`` (LoRA: the adapters alone; their ``lora_A`` / ``lora_B`` are read as no projection);
        - ``loss_tiles``: the first ``loss_tiles`` attribute on ``module`` (``CausalLM``'s), a submodule or its
          ``config`` (tiled unless 1); without one the loss is taken as untiled (the larger estimate).

        Raises:
            ValueError: when ``module`` cannot be sized (no decoder layer; layers of different shapes; an
                MLP without an ``nn.Linear`` back to ``hidden_size``; no output projection and no token
                embedding), naming what is missing.
        """
        name = type(module).__name__
        layers = decoder_layers(module)
        if not layers:
            raise FPDTError(
                f"{name} has no FPDTBlock and no Hugging Face decoder layer (HFCausalLM), so its memory cannot be"
                f" estimated (the memory model reads the layer shapes from them): build its layers from FPDTBlock,"
                f" or {_EXPLICIT}."
            )
        read = [_read_layer(layer) for layer in layers]
        shapes = sorted({dims for dims, _, _, _ in read})
        mlps = sorted({mlp for _, mlp, _, _ in read if mlp is not None})
        if len(shapes) > 1 or len(mlps) > 1:
            raise FPDTError(
                f"{name}: its decoder layers differ in shape (hidden, heads, kv heads, head_dim, v_head_dim, norm"
                f" extras: {shapes}; intermediate, MLP projections, experts per token: {mlps}); the memory model"
                f" assumes one attention shape and one MLP shape: {_EXPLICIT}."
            )
        hidden, heads, kv_heads, head_dim, v_head_dim, norm_extras = shapes[0]
        inter, projections, top_k = mlps[0] if mlps else (0, 2, 1)
        block_params = max(params for _, _, params, _ in read)  # FSDP2 gathers the largest layer too
        kinds = tuple(LayerKind(layer.attention, mlp is not None, layer.mixers, layer.stream_refusal is None)
                      for layer, (_, mlp, _, _) in zip(layers, read))
        in_layers = {id(m) for layer in layers for m in layer.module.modules()}
        outside = [m for m in module.modules() if id(m) not in in_layers]
        adapters = {id(m) for m in _adapter_linears(module)}  # LoRA's A and B: no output projection
        heads_out = [m for m in outside if isinstance(m, nn.Linear) and m.in_features == hidden
                     and id(m) not in adapters]
        embeddings = [m for m in outside if isinstance(m, nn.Embedding) and m.embedding_dim == hidden]
        if heads_out:
            head = max(heads_out, key=lambda m: m.out_features)
            vocab, tied = head.out_features, any(e.weight is head.weight for e in embeddings)
        elif embeddings:
            vocab, tied = embeddings[0].num_embeddings, True
        else:
            raise FPDTError(
                f"{name} has neither an output projection (an nn.Linear from hidden_size={hidden} outside the"
                f" decoder layers) nor a token embedding (an nn.Embedding of width {hidden}), so its vocabulary"
                f" size, and with it the loss's memory, cannot be read: {_EXPLICIT}."
            )
        num_params = sum(p.numel() for p in module.parameters())  # parameters() yields a shared one once
        trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
        block_trainable = max(sum(p.numel() for p in layer.module.parameters() if p.requires_grad)
                              for layer in layers)
        head_trainable = head.weight.requires_grad if heads_out else embeddings[0].weight.requires_grad
        mlp_tiles = {configured_tiles(layer.module) for layer, kind in zip(layers, kinds) if kind.mlp} or {1}
        if len(mlp_tiles) > 1:
            raise FPDTError(f"{name}: its decoder layers' MLPs run in different tile counts ({mlp_tiles}); the"
                            f" memory model assumes one: {_EXPLICIT}.")
        mlp_count, loss_count = mlp_tiles.pop(), _loss_tiles(module)
        # LoRA's B on projections into the intermediate: a tile's backward holds one more intermediate-wide value per
        # token for every two of them (measured: tests/hf/test_lora.py)
        adapted = [m for layer in layers if layer.mlp is not None for name, m in layer.mlp.named_modules()
                   if isinstance(m, nn.Linear) and adapter_part(name) == "lora_B" and inter
                   and m.out_features % inter == 0]
        adapter_values = sum(m.out_features // inter for m in adapted) // len(layers) // 2 if adapted else 0
        shape = cls(hidden, len(layers), heads, kv_heads, inter, vocab, num_params, tied, head_dim, projections,
                    block_params, norm_extras, all(layer.chunked_projections for layer in layers),
                    mlp_tiles=None if mlp_count == 1 else mlp_count, loss_tiles=None if loss_count == 1 else loss_count,
                    experts_per_token=top_k, layers=None if all(k == LayerKind() for k in kinds) else kinds,
                    v_head_dim=v_head_dim, trainable_params=None if trainable == num_params else trainable,
                    block_trainable=None if trainable == num_params else block_trainable,
                    head_trainable=head_trainable, mlp_adapter_values=adapter_values,
                    capped_attention=any(layer.attention_softcap is not None for layer in layers))
        return shape, {"mlp_tiled": all(tiled for _, mlp, _, tiled in read if mlp is not None),
                       "loss_tiled": loss_count != 1}


def _read_layer(layer: DecoderLayer) -> tuple[tuple[int, ...], tuple[int, int, int] | None, int, bool]:
    """``((hidden, heads, kv_heads, head_dim, v_head_dim, norm_extras), (intermediate, mlp_projections,
    experts_per_token) or None without an MLP, parameters, mlp_tiled)``; an MoE MLP is read by
    :func:`~lightning_fpdt.memory.experts.read_experts`."""
    hidden, mlp = layer.hidden_size, layer.mlp
    # LayerNorm's kernel keeps only its input (and per-token statistics); RMSNorm, torch's included, also
    # keeps the normalized values
    norm_extras = sum(not isinstance(norm, nn.LayerNorm) for norm in layer.norms)
    dims = (hidden, layer.n_heads, layer.n_kv_heads, layer.head_dim, layer.v_head_dim or layer.head_dim, norm_extras)
    params = sum(p.numel() for p in layer.module.parameters())
    if mlp is None:
        if layer.attention or layer.mixers:  # a hybrid's attention-only or mixer-only layer (Nemotron-H)
            return dims, None, params, layer.mlp_tiled
        raise FPDTError(f"{layer.name} has no 'mlp' module, so its intermediate size cannot be read: {_EXPLICIT}.")
    adapters = {id(m) for m in _adapter_linears(mlp)}  # LoRA's A and B: not the MLP's projections
    linears = [m for m in mlp.modules() if isinstance(m, nn.Linear) and id(m) not in adapters]
    back = [m for m in linears if m.out_features == hidden]
    experts = read_experts(mlp, hidden, layer.experts_per_token)
    if not back and experts is None:
        raise FPDTError(
            f"{layer.name}: its MLP ({type(mlp).__name__}) has no nn.Linear back to hidden_size={hidden}, so its"
            f" intermediate size cannot be read: {_EXPLICIT}."
        )
    if experts is None:
        down = back[-1]  # the output projection; the intermediate is its input
        # gate and up (SwiGLU: 2), a fused gate_up (Phi-3: 2), fc (GeLU: 1): their width over the intermediate's
        widths = sum(m.out_features for m in linears if m is not down and m.out_features % down.in_features == 0)
        experts = (down.in_features, max(1, widths // down.in_features), 1)
    beside = None if layer.experts is None else read_experts(layer.experts, hidden, layer.experts_per_token)
    if beside is not None:  # experts beside the MLP (Gemma-4): as many more MLPs per token as their values take
        inter, projections, per_token = experts
        extra = beside[0] * beside[1] * beside[2]
        experts = (inter, projections, per_token + -(-extra // (inter * projections)))
    return dims, experts, params, layer.mlp_tiled


def _loss_tiles(module: nn.Module) -> int | None:
    """The first ``loss_tiles`` found (see :meth:`ModelShape.from_module`); ``1`` (untiled) without one."""
    for sub in module.modules():
        for owner in (sub, getattr(sub, "config", None)):
            if owner is not None and hasattr(owner, "loss_tiles"):
                return owner.loss_tiles
    return 1


ADAPTER_PARTS = ("lora_A", "lora_B")  # peft's names of a LoRA layer's two adapter projections


def adapter_part(name: str) -> str | None:
    """``"lora_A"`` or ``"lora_B"`` where ``name`` (a module's or a parameter's) lies inside that adapter projection
    of a LoRA layer (peft's names; :mod:`lightning_fpdt.hf.lora` reads the same rule), else ``None``."""
    return next((part for part in ADAPTER_PARTS if f".{part}." in f".{name}."), None)


def _adapter_linears(module: nn.Module) -> list[nn.Module]:
    """The ``nn.Linear`` s inside LoRA layers that are the adapters' ``lora_A`` / ``lora_B`` (peft's), not a layer's
    base projection."""
    return [m for name, m in module.named_modules() if isinstance(m, nn.Linear) and adapter_part(name) is not None]
