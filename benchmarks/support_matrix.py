"""Support matrix: what ``HFCausalLM`` does with every causal-LM family transformers ships, measured (CPU, gloo).

    python benchmarks/support_matrix.py --json /tmp/support_matrix.json --md /tmp/support_matrix.md  # all (15 min)
    python benchmarks/support_matrix.py --families llama,bert,mixtral         # some of them
    python benchmarks/support_matrix.py --families llama,bert --jobs 2        # two families at a time
    python benchmarks/support_matrix.py --families llama --build-only         # configs and construction only
    python benchmarks/support_matrix.py --aux-loss --json /tmp/aux.json       # MoE families, router loss on
    python benchmarks/support_matrix.py --resume --json /tmp/support_matrix.json   # finish an interrupted run

For every model type of ``transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (or those of
``--families``), in a fresh subprocess of its own (its address space limited to ``--memory-gb``, killed after
``--timeout`` seconds: a family whose tiny config still builds something huge costs its row, not the machine):

1. a tiny config of the family, its defaults otherwise (:func:`tiny_config`): hidden 32, 4 heads of 8 (2 KV heads),
   intermediate 64, vocabulary 128, 4 experts with 2 per token, latent attention through rank-8 bottlenecks, 2 layers
   or, where the config has per-layer lists (``layer_types``, ``mlp_layer_types``, index lists, pattern strings,
   ``per_layer_config``), one layer per distinct combination of them (2 to 6 layers); sliding windows and attention
   chunks shortened to 11 tokens (``--window``) so that they cut the 32-token sequence; dropout and router jitter
   off (random draws cannot be compared); ``is_decoder=True`` where the config has it (the encoder families' causal
   LMs); token ids of padding/bos/eos inside the vocabulary and none of them in the samples; sub-configs (the text
   config of a multimodal entry, its vision and audio towers) shrunk the same way. :data:`FIELDS` overrides the
   generic shrinker where a family needs it, with a comment where the family's own defaults do not build;
2. the plain transformers model of that config and its forward (float32): failing, *transformers cannot build it*
   or *transformers cannot run it*;
3. ``HFCausalLM(config)`` (``_experts_implementation = "eager"``, built in float64): raising, the family is
   *refused* (our message, ``HFCausalLM:`` or ``fpdt_attention:``) or *HFCausalLM crashes* (any other error: ours,
   since transformers builds and runs the model; the detail names the innermost ``lightning_fpdt`` frame);
4. one ``Trainer.fit`` step under ``FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math",
   start_method="fork")`` at ``precision="64-true"`` (32 tokens, 4 chunks per rank, a plain batch of 2 random
   sequences, weights redrawn with std ``1/sqrt(fan_in)``: ``tests/hf/test_hf_causal_lm.py``'s ``_redraw`` and
   ``_fit``; parameters the plain model's forward never uses frozen, any other that gets no gradient on a rank
   counting as a zero one), against the plain transformers model
   (``_plain``: sdpa, or the float64 eager reference, here also for layers with more keys than queries) in one
   process on the whole batch: the float64 mean cross-entropy, or, where the family's forward adds an auxiliary
   router loss, its own loss with the labels (transformers' cross-entropy in float64), which includes it. Every
   class method and function of the family's modules that computes in float32 whatever its input (norms, routers,
   softmaxes, recurrent kernels) computes in float64 on both sides (``tests.helpers.in_float64``; the forked ranks
   inherit it). *exact*: the loss and every gradient of both ranks within 1e-10 of the reference (relative, as
   ``tests.helpers.step_errors`` measures them); *DIFFERS* otherwise; *fails at sp=2*: the step raised (a refusal
   raised by the strategy at set-up is *refused*).

The table: the family (``model_type``), the class ``AutoModelForCausalLM`` builds, the status, the detail (the
largest relative error, or the first line of the reason) and the tests in ``tests/`` that construct the family's
config class (the family tests first). ``--json PATH`` writes the rows with more (the parameters without gradient,
the largest errors, tracebacks), ``--md PATH`` the table. Run from the repository root (it imports ``tests``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

TOLERANCE = 1e-10
SEQ, VOCAB, RESERVED = 32, 128, 8  # sample tokens drawn from [RESERVED, VOCAB): none is a pad/bos/eos id
SPECIAL = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
           "sep_token_id": 3, "cls_token_id": 4, "mask_token_id": 5, "unk_token_id": 6}
DETAIL_CHARS = 160
FAMILY_TESTS = r"test_(hf_|recurrent|latent|short_conv|chunked)"  # the tests that check families step by step
MAX_TESTS = 3

# the generic shrinker: a field of the family's config (its own name or an alias in its attribute_map) -> tiny value
SIZES: dict[str, Any] = {
    "vocab_size": VOCAB, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "d_ff": 64, "ffn_hidden_size": 64,
    "intermediate_size_mlp": 64, "decoder_ffn_dim": 64, "encoder_ffn_dim": 64, "dense_intermediate_size": 64,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "expert_intermediate_size": 16,
    "shared_intermediate_size": 16, "moe_shared_expert_intermediate_size": 16,
    "decoder_attention_heads": 4, "encoder_attention_heads": 4, "decoder_layers": 2, "encoder_layers": 2,
    # experts: 4, 2 per token; groups of the DeepSeek-style routers 2 of which 1 is chosen
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "top_k_experts": 2, "moe_k": 2,
    "num_selected_experts": 2, "moe_top_k": 2,
    # Mamba-2 mixers: 4 heads of 16 (expand 2), state 8, the scan in chunks of 8
    "mamba_n_heads": 4, "mamba_d_state": 8, "mamba_chunk_size": 8, "ssm_state_size": 8, "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    # latent attention (DeepSeek-V2/V3, MiniCPM3, ...): q and kv through rank-8 bottlenecks, rotary half 4 wide
    "q_lora_rank": 8, "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 8,
    # linear attention / gated delta-nets
    "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    # per-layer inputs (Gemma-3n / Gemma-4)
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,
    # Gemma-4's full layers: wider heads of their own, one KV head
    "global_head_dim": 16, "num_global_key_value_heads": 1,
    # vision / audio towers of multimodal entries (built, never run on text-only batches)
    "num_channels": 3, "image_size": 32, "patch_size": 8, "projection_dim": 32, "adapter_in_dim": 32,
    "adapter_input_size": 32, "adapter_out_dim": 32,
}
# fields whose default is kept unless it is larger (counts where a smaller default means something)
AT_MOST = {"n_shared_experts": 1, "num_shared_experts": 1, "n_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
           "num_dense_layers": 1, "moe_layer_freq": 1, "decoder_sparse_step": 1, "num_kv_shared_layers": 1,
           "interleave_moe_layer_step": 2, "moe_every_n_layers": 2}
AUX_LOSS = [False]  # --aux-loss: output_router_logits=True where the config has it
LAYERS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
WINDOWS = ("sliding_window", "attention_chunk_size", "local_window_size", "window_size", "sliding_window_size",
           "attention_window_size")



class _Drop:
    def __repr__(self) -> str:
        return "DROP"


DROP = _Drop()  # in FIELDS: leave this field at the family's default
MAMBA = dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=2)
NO_PER_LAYER_INPUTS = dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0)
LINEAR, FULL, SLIDING = "linear_attention", "full_attention", "sliding_attention"
# per-family overrides of the generic shrinker: config fields, set last (DROP: the family's default; "@key": the
# fields of sub-config ``key``). Where the defaults themselves fail to build, the comment says so.
FIELDS: dict[str, dict[str, Any]] = {
    "codegen": dict(rotary_dim=4),  # half of each 8-wide head (the default 64 is wider than the head)
    "gptj": dict(rotary_dim=4),
    "opt": dict(word_embed_proj_dim=32),  # no projection around the decoder (as the released models but 350m)
    "reformer": dict(axial_pos_shape=[4, 8], axial_pos_embds_dim=[16, 16]),  # 32 tokens, hidden 32
    "xlnet": dict(d_head=8),
    # defaults fail: DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig lacks, and clamps with
    # clip_qkv=None
    "dbrx": {"@attn_config": dict(rope_theta=500000.0, clip_qkv=8.0)},
    # defaults fail: rope_parameters holds no entry for the full-attention layers
    "cohere_compass_text": dict(rope_parameters={FULL: {"rope_type": "default", "rope_theta": 10000.0}}),
    "dots1": dict(n_shared_experts=1),  # defaults fail: n_shared_experts None
    "kimi_linear": dict(linear_num_heads=4, linear_head_dim=8),  # its delta attention's own widths (128 x 32)
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", FULL, "conv"], num_dense_layers=1),  # layer_types None
    "zaya": dict(num_experts_per_tok=1),  # "ZAYA currently supports num_experts_per_tok=1 only"
    # defaults fail: the QSA indexer's sizes are None
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16,
                           indexer_compress_ratio=4),
    # hybrids: every kind of layer (the defaults of some have no attention layer in their first layers)
    "bamba": dict(num_hidden_layers=3, attn_layer_indices=[1], **MAMBA),
    "granitemoehybrid": dict(num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"], **MAMBA),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1,
                      mamba_chunk_size=8),
    "zamba": dict(num_hidden_layers=4, layers_block_type=[LINEAR, "hybrid", LINEAR, "hybrid"], mamba_d_state=8,
                  attention_head_dim=16, attention_hidden_size=64),  # two hybrid layers share one transformer
    "zamba2": dict(num_hidden_layers=3, layers_block_type=["mamba", "hybrid", "mamba"], hybrid_layer_ids=DROP,
                   mamba_headdim=8, mamba_d_state=8, mamba_ngroups=1, chunk_size=8, num_mem_blocks=1),
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=1, chunk_size=8, state_size=8),
    "jamba": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1, mamba_d_state=8),
    # MLA on every layer, the sliding layers with their own heads and ranks (per_layer_config); kv heads = heads
    "dots3_note_text": dict(num_key_value_heads=4, index_head_dim=8, index_n_heads=2, per_layer_config=lambda f: {
        i: dict(num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=4, head_dim=8)
        for i in f.get("per_layer_config", {})}),
    # its validator wants no per-layer inputs (which its defaults have)
    "gemma4_assistant": {"@defaults": dict(text_config=NO_PER_LAYER_INPUTS), "@text_config": NO_PER_LAYER_INPUTS},
    "xmod": dict(default_language="en_XX"),  # its forward wants a language
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=8, expand=2),
    "musicgen": {"@decoder": dict(num_codebooks=1)},  # one codebook: input_ids [batch, tokens]
    "musicgen_melody": {"@decoder": dict(num_codebooks=1)},
    "recurrent_gemma": dict(num_hidden_layers=3, lru_width=32, attention_window_size=11),
}
# model types whose causal-LM class takes one of the entry's sub-configs, not the entry's own config
CAUSAL_LM_SUB_CONFIG = {"musicgen": "decoder", "musicgen_melody": "decoder"}


def _get(obj: Any, name: str) -> Any:
    """A config's attribute without its heterogeneity checks (a per-layer attribute read globally raises)."""
    getter = getattr(obj, "_getattr_without_heterogeneous_validation", None)
    try:
        return getter(name, None) if getter is not None else getattr(obj, name, None)
    except Exception:
        return vars(obj).get(name)


# ---- tiny configs ------------------------------------------------------------------------------------------------

def _config_classes() -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def _fields(cls: type) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(inspect.signature(cls.__init__).parameters) - {"self", "kwargs"}


def _has(cls: type, name: str) -> bool:
    return name in _fields(cls) or name in getattr(cls, "attribute_map", {})


def _field(cls: type, name: str) -> str:
    """The config's own field for ``name`` (an alias resolved: passed as the alias, it would be set only after the
    config's ``__post_init__`` has read the field)."""
    return name if name in _fields(cls) else getattr(cls, "attribute_map", {}).get(name, name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_index_list(name: str, value: Any, layers: int) -> bool:
    return (isinstance(value, list) and value != [] and all(_is_int(v) for v in value)
            and all(0 <= v < layers for v in value) and value == sorted(set(value))
            and re.search(r"(layers|idxs|indices|_ids|layer_ids)$", name) is not None
            and not (len(value) == layers and set(value) <= {0, 1} and value != list(range(layers))))


def _per_layer_fields(defaults: Any, layers: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(per-layer lists and pattern strings, per-layer index lists)`` of a default config with ``layers`` layers."""
    per_layer, index = {}, {}
    if not layers or layers < 2:
        return per_layer, index
    for name, value in vars(defaults).items():
        if name.startswith("_") or name in ("architectures", "id2label", "label2id"):
            continue
        if _is_index_list(name, value, layers):
            index[name] = value
        elif isinstance(value, list) and len(value) == layers and all(not isinstance(v, (list, dict)) for v in value):
            per_layer[name] = value
        elif isinstance(value, str) and len(value) == layers and re.search(r"pattern|block|layer", name):
            per_layer[name] = value
    return per_layer, index


def _sized(name: str, values: list) -> list | None:
    """A per-layer list of sizes, shrunk (heads per layer, intermediate size per layer), or None."""
    if not all(_is_int(v) for v in values) or max(values) <= 64:
        return None
    if "head" in name:
        return [4] * len(values)
    if "intermediate" in name or "ffn" in name:
        return [64] * len(values)
    return None


def _overrides(defaults: Any) -> dict[int, dict[str, Any]]:
    """A heterogeneous config's per-layer overrides (``per_layer_config``), by layer index."""
    spec = vars(defaults).get("_heterogeneity_spec")
    return dict(getattr(spec, "per_layer_overrides", None) or {})


def _tiny_override(defaults: Any, name: str, value: Any) -> Any:
    """A per-layer override shrunk: a size wider than the global one twice the tiny size, narrower half of it."""
    tiny = SIZES.get(name)
    if tiny is None or not _is_int(value):
        return value
    base = _get(defaults, name)
    if _is_int(base) and value > base:
        return tiny * 2
    if _is_int(base) and value < base:
        return max(1, tiny // 2)
    return tiny


def _layer_plan(defaults: Any, layers: int | None, max_layers: int) -> tuple[int, dict[str, Any]]:
    """The number of tiny layers and the per-layer fields for them: one layer per distinct combination of the
    default's per-layer values (first occurrences in order), at least 2."""
    per_layer, index = _per_layer_fields(defaults, layers)
    sized = {n: v for n, v in per_layer.items() if _sized(n, v) is not None}
    kinds = {n: v for n, v in per_layer.items() if n not in sized}
    overrides = _overrides(defaults) if layers else {}
    columns = {**{n: list(v) for n, v in kinds.items()},
               **{n: [i in set(v) for i in range(layers)] for n, v in index.items()}} if layers else {}
    if overrides:
        columns["per_layer_config"] = [repr(sorted(overrides.get(i, {}).items())) for i in range(layers)]
    chosen: list[int] = []
    seen: set = set()
    for i in range(layers or 0):
        combo = tuple(columns[n][i] for n in columns)
        if combo not in seen:
            seen.add(combo)
            chosen.append(i)
    chosen = chosen[:max_layers]
    while len(chosen) < 2:
        chosen.append(chosen[-1] if chosen else 0)
    n = len(chosen)
    fields: dict[str, Any] = {}
    for name, value in kinds.items():
        picked = [value[i] for i in chosen]
        fields[name] = "".join(picked) if isinstance(value, str) else picked
    for name, value in index.items():
        fields[name] = [j for j, i in enumerate(chosen) if i in set(value)]
    for name, value in sized.items():
        fields[name] = _sized(name, value)[:1] * n
    if overrides:
        fields["per_layer_config"] = {j: {k: _tiny_override(defaults, k, v) for k, v in overrides[i].items()}
                                      for j, i in enumerate(chosen) if overrides.get(i)}
    return n, fields


def _special_ids(cls: type, defaults: Any, vocab: int) -> dict[str, Any]:
    """Token ids the model uses for padding and bos/eos inside the tiny vocabulary (others, e.g. image tokens,
    stay outside it: never drawn)."""
    fields: dict[str, Any] = {}
    for name, tiny in SPECIAL.items():
        if not _has(cls, name):
            continue
        value = _get(defaults, name)
        if _is_int(value) and value >= vocab:
            fields[name] = tiny
        elif isinstance(value, list) and any(_is_int(v) and v >= vocab for v in value):
            fields[name] = [tiny]
    return fields


def tiny_fields(cls: type, defaults: Any, window: int | None, max_layers: int, override: dict[str, Any]) -> dict:
    """The keyword arguments of the tiny config of ``cls`` (``defaults``: its default instance)."""
    fields: dict[str, Any] = {}
    for name, value in SIZES.items():
        for field in (name, "swa_" + name):  # sliding layers' own sizes (Inkling-2)
            if value is not None and _has(cls, field):
                fields[_field(cls, field)] = value
    for name, value in AT_MOST.items():
        default = _get(defaults, name) if _has(cls, name) else None
        if _is_int(default) and default > value:
            fields[_field(cls, name)] = value
    if "kv_lora_rank" in fields:  # latent attention: every head its own keys, head_dim the rotary part where it was
        fields[_field(cls, "num_key_value_heads")] = fields.get("num_attention_heads", 4)
        if _has(cls, "head_dim") and _get(defaults, "head_dim") == _get(defaults, "qk_rope_head_dim"):
            fields["head_dim"] = SIZES["qk_rope_head_dim"]
    layers = next((_get(defaults, n) for n in LAYERS if _has(cls, n) and _is_int(_get(defaults, n))), None)
    n, per_layer = _layer_plan(defaults, layers, max_layers)
    if layers is not None:
        fields[_field(cls, next(name for name in LAYERS if _has(cls, name)))] = n
    fields.update(per_layer)
    if window is not None:
        for name in WINDOWS:
            value = _get(defaults, name) if _has(cls, name) else None
            if _is_int(value) and value > window:
                fields[_field(cls, name)] = window
    for name in _fields(cls):  # no random draws in training: dropout (which cannot be checked exactly) and jitter
        value = _get(defaults, name)
        if isinstance(value, float) and value > 0 and re.search(r"dropout|pdrop|layerdrop|drop_path|jitter", name):
            fields[name] = 0.0
    if AUX_LOSS[0] and _has(cls, "output_router_logits"):  # --aux-loss
        fields[_field(cls, "output_router_logits")] = True
    if "is_decoder" in _fields(cls):  # the encoder families' causal-LM heads want it (they warn without it)
        fields["is_decoder"] = True
    vocab = fields.get("vocab_size", _get(defaults, "vocab_size"))
    if _is_int(vocab):
        fields.update(_special_ids(cls, defaults, vocab))
    for name, value in override.items():
        if value is DROP:
            fields.pop(name, None)
        elif callable(value):  # a function of the fields so far
            fields[name] = value(fields)
        elif not name.startswith("@"):
            fields[name] = value
    return fields


def tiny_config(model_type: str, window: int | None = 11, max_layers: int = 6, cls: type | None = None,
                override: dict[str, Any] | None = None) -> Any:
    """The tiny config of ``model_type`` (or of the sub-config class ``cls``), its defaults otherwise."""
    top = cls is None
    cls = cls or _config_classes()[model_type]
    override = dict(FIELDS.get(model_type, {}) if override is None else override)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = cls(**override.get("@defaults", {}))  # (where the defaults themselves fail validation)
        fields = tiny_fields(cls, defaults, window, max_layers, override)
        for key in getattr(cls, "sub_configs", None) or {}:
            sub_default = _get(defaults, key)
            spec = (getattr(cls, "sub_configs_defaults", None) or {}).get(key)
            if sub_default is None and getattr(spec, "model_type", None):  # made in __post_init__ when not given
                sub_default = _config_classes()[spec.model_type]()
            if sub_default is None or not hasattr(sub_default, "to_dict"):
                continue
            own = FIELDS.get(getattr(type(sub_default), "model_type", ""), {})  # e.g. the text config's entry
            fields[key] = tiny_config(model_type, window, max_layers, type(sub_default),
                                      override=override.get("@" + key, own))
        config = cls(**fields)
    if top and model_type in CAUSAL_LM_SUB_CONFIG:
        return getattr(config, CAUSAL_LM_SUB_CONFIG[model_type])
    return config


# ---- float64 on both sides ---------------------------------------------------------------------------------------

MARKERS = ("torch.float32", ".float()")


def _recompiled(function: Any, cls: type | None = None) -> Any:
    """``function`` compiled again from its own source with float32 read as float64 (``tests.helpers.in_float64``;
    a method's zero-argument ``super()`` spelled out)."""
    from tests.helpers import in_float64

    if cls is not None and "super()" in inspect.getsource(function):
        lines = inspect.getsource(function)
        namespace = inspect.unwrap(function).__globals__
        if namespace.get(cls.__name__) is not cls:
            raise TypeError("class not in its module's namespace")
        import textwrap

        source = textwrap.dedent(lines).replace("super()", f"super({cls.__name__}, self)")
        source = "\n".join(x for x in source.splitlines() if not x.startswith("@auto_docstring"))
        source = source.replace("torch.float32", "torch.float64").replace(".float()", ".double()")
        out: dict[str, Any] = {}
        exec(source, namespace, out)
        return out[function.__name__]
    return in_float64(function)


def float64_everywhere(modules: list[Any]) -> list[str]:
    """Patch every class method and module function of ``modules`` whose source computes in float32 to compute in
    float64 (the family's own source, one dtype changed); the names patched."""
    from lightning_fpdt.hf.kernel_binding import kernel_function

    patched = []
    for module in modules:
        for name, obj in list(vars(module).items()):
            kernel = kernel_function(obj) if not inspect.isfunction(obj) and not isinstance(obj, type) else None
            if kernel is not None and kernel.__module__ == module.__name__:  # transformers 5.25's kernels Func
                try:
                    if any(m in inspect.getsource(inspect.unwrap(kernel)) for m in MARKERS):
                        setattr(module, name, _recompiled(obj))
                        patched.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
                except Exception:  # a source that cannot be compiled again stays as it is
                    pass
            elif inspect.isfunction(obj) and obj.__module__ == module.__name__:
                try:
                    if any(m in inspect.getsource(obj) for m in MARKERS):
                        setattr(module, name, _recompiled(obj))
                        patched.append(f"{module.__name__.rsplit('.', 1)[-1]}.{name}")
                except Exception:  # a source that cannot be compiled again stays as it is
                    pass
            elif isinstance(obj, type) and obj.__module__ == module.__name__:
                for attr, fn in list(vars(obj).items()):
                    if not inspect.isfunction(fn):
                        continue
                    try:
                        if any(m in inspect.getsource(fn) for m in MARKERS):
                            setattr(obj, attr, _recompiled(fn, obj))
                            patched.append(f"{obj.__name__}.{attr}")
                    except Exception:
                        pass
    return patched


def _loss_in_float64() -> None:
    """transformers' causal-LM loss (``LOSS_MAPPING["ForCausalLM"]``) without its float32 cast of the logits."""
    from transformers.loss import loss_utils

    from tests.helpers import in_float64

    for key in ("ForCausalLM",):
        loss_utils.LOSS_MAPPING[key] = in_float64(loss_utils.LOSS_MAPPING[key])


# ---- one family (in its own subprocess) ---------------------------------------------------------------------------

def _first_line(error: BaseException | str, limit: int = 400) -> str:
    text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
    lines = [x.strip() for x in str(text).strip().splitlines() if x.strip()]
    return (lines[0] if lines else str(text))[:limit]


def _root(error: BaseException) -> tuple[str, str]:
    """``(type name, message)`` of the error, or of the error a rank raised (a ``ProcessRaisedException`` carries
    the rank's traceback as text: its last exception line)."""
    text = str(error)
    if type(error).__name__ == "ProcessRaisedException":
        lines = text.strip().splitlines()
        for i in range(len(lines) - 1, -1, -1):
            match = re.match(r"^([\w.]+(?:Error|Exception|Interrupt|Exit)): ?(.*)$", lines[i])
            if match:
                return match.group(1).rsplit(".", 1)[-1], "\n".join([match.group(2), *lines[i + 1:]])
    return type(error).__name__, text


def _is_refusal(error: BaseException) -> bool:
    return _root(error)[1].strip().startswith(("HFCausalLM:", "fpdt_attention:"))


def _message(error: BaseException) -> str:
    """The first line of the error (a refusal without its type: it names itself)."""
    name, text = _root(error)
    return _first_line(text if _is_refusal(error) else f"{name}: {text}")


class Result:
    def __init__(self, path: str, family: str) -> None:
        self.path, self.row = path, {"family": family, "class": "", "status": "", "detail": "", "stage": "start"}

    def update(self, **fields: Any) -> None:
        self.row.update(fields)
        Path(self.path).write_text(json.dumps(self.row))


def run_family(family: str, result_path: str, args: argparse.Namespace) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    import torch

    torch.set_num_threads(1)
    result = Result(result_path, family)
    warnings.simplefilter("ignore")
    torch.manual_seed(args.seed)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    result.update(**{"class": MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]}, stage="config")
    try:
        config = tiny_config(family, window=args.window or None, max_layers=args.max_layers)
    except Exception as error:
        result.update(status="transformers cannot build it", detail="config: " + _first_line(_validation(error)),
                      trace=traceback.format_exc()[-3000:])
        return
    _set_experts_eager(config)
    result.update(stage="plain model")
    try:
        probe = _plain_model(family, config)
        if not type(probe)._supports_sdpa:  # the attention the reference runs: sdpa, or eager (in float64 there)
            probe = _plain_model(family, config, attn_implementation="eager")
    except Exception as error:
        result.update(status="transformers cannot build it", detail=_first_line(error),
                      trace=traceback.format_exc()[-3000:])
        return
    result.update(**{"class": type(probe).__name__}, params=sum(p.numel() for p in probe.parameters()),
                  layers=_layer_summary(config))
    try:  # the family's own forward at these settings (its own attention, default dtype)
        probe(input_ids=torch.randint(RESERVED, VOCAB, (2, SEQ)), use_cache=False)
    except Exception as error:
        result.update(status="transformers cannot run it", detail=_first_line(error),
                      trace=traceback.format_exc()[-3000:])
        return
    modules = sorted({sys.modules[type(m).__module__] for m in probe.modules()
                      if type(m).__module__.startswith("transformers.models.")}, key=lambda m: m.__name__)
    del probe
    if not args.build_only:
        result.update(patched=float64_everywhere(modules))
        _loss_in_float64()
    result.update(stage="HFCausalLM")
    from lightning_fpdt.models import HFCausalLM

    try:
        # built in float64: its probes run the family's forward, which computes in float64 from here on
        torch.set_default_dtype(torch.float64 if not args.build_only else torch.float32)
        model = config if family not in CAUSAL_LM_SUB_CONFIG else _plain_model(family, config)
        module = HFCausalLM(model, learning_rate=1e-3, warmup_steps=1, mlp_tiles=1, loss_tiles=1)
    except Exception as error:
        if _is_refusal(error):
            result.update(status="refused", detail=_first_line(str(error)))
        else:  # transformers builds and runs it (above): our code failed
            result.update(status="HFCausalLM crashes", detail=_where(error) + _message(error),
                          trace=traceback.format_exc()[-3000:])
        return
    finally:
        torch.set_default_dtype(torch.float32)
    if args.build_only:
        result.update(status="built", detail="")
        return
    check_step(module, result, args)


def _plain_model(family: str, config: Any, **kwargs: Any) -> Any:
    """The family's causal LM from ``config`` (``AutoModelForCausalLM``; the mapped class itself for an entry
    whose class takes a sub-config, which the auto classes do not map)."""
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if family in CAUSAL_LM_SUB_CONFIG:
        return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family])._from_config(config, **kwargs)
    return AutoModelForCausalLM.from_config(config, **kwargs)


def _validation(error: BaseException) -> str:
    """A strict config's validation error: its message without the validator's header line."""
    lines = [x.strip() for x in str(error).splitlines() if x.strip()]
    if len(lines) > 1 and lines[0].startswith("Class validation error"):
        return f"{type(error).__name__}: " + " ".join(lines[1:])
    return f"{type(error).__name__}: {error}"


def _where(error: BaseException) -> str:
    """``at lightning_fpdt/...py:LINE: ``: the innermost frame of this project in the error's traceback (or in
    the traceback text a rank's error carries)."""
    frames = [(f.filename, f.lineno) for f in traceback.extract_tb(error.__traceback__)]
    frames += [(m.group(1), int(m.group(2))) for m in re.finditer(r'File "([^"]+)", line (\d+)', str(error))]
    ours = [(name, line) for name, line in frames if "/lightning_fpdt/" in name]
    if not ours:
        return ""
    name, line = ours[-1]
    return f"at {name[name.rindex('/lightning_fpdt/') + 1:]}:{line}: "


def _layer_summary(config: Any) -> str:
    text = getattr(config, "get_text_config", lambda: config)()
    for name in ("layer_types", "layers_block_type", "block_types", "hybrid_override_pattern"):
        value = getattr(text, name, None)
        if value:
            return f"{name}={value}"
    return f"{getattr(text, 'num_hidden_layers', '?')} layers"


def _set_experts_eager(config: Any) -> None:
    """The per-expert loop (grouped_mm has no float64 kernel), on the config and its sub-configs."""
    configs = [config] + [getattr(config, k) for k in (getattr(config, "sub_configs", None) or {})
                          if getattr(config, k, None) is not None]
    for c in configs:
        c._experts_implementation = "eager"


def _oracle(ref: Any, data: Any) -> tuple[Any, dict, bool]:
    """One process on the whole batch: the float64 mean cross-entropy, or, where the family's forward adds an
    auxiliary loss (its ``aux_loss`` output), the family's own loss with the labels (which includes it)."""
    import torch
    import torch.nn.functional as F

    out = ref(input_ids=data.ids, use_cache=False)
    aux = getattr(out, "aux_loss", None) is not None
    if aux:
        out = ref(input_ids=data.ids, labels=data.labels, use_cache=False)
    targets = data.labels[:, 1:]
    ce = F.cross_entropy(out.logits[:, :-1].double().flatten(0, 1), targets.flatten(), reduction="mean")
    loss = out.loss if aux and getattr(out, "loss", None) is not None else ce
    loss.backward()
    grads = {f"model.{n}": p.grad.detach().clone() for n, p in ref.named_parameters() if p.grad is not None}
    for n, p in ref.named_parameters():  # parameters the loss does not reach: zero gradients
        grads.setdefault(f"model.{n}", torch.zeros_like(p))
    return loss.detach(), grads, aux


def _reference_attention(module: Any, q: Any, k: Any, v: Any, attention_mask: Any, scaling: float,
                         softcap: float | None = None, **kwargs: Any) -> tuple[Any, None]:
    """``tests/hf/test_hf_causal_lm.py``'s float64 eager reference, also where a layer attends to more keys than it
    has queries (DeepSeek-V4's compressed keys beside the sequence's): ``[b, h, s, d]`` in, ``[b, s, h, d]`` out."""
    import torch

    b, h, s, _ = q.shape
    n = k.shape[2]
    k = k.repeat_interleave(h // k.shape[1], dim=1)
    v = v.repeat_interleave(h // v.shape[1], dim=1)
    scores = q @ k.transpose(2, 3) * scaling  # [b, h, s, n]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if attention_mask is not None:
        scores = scores + attention_mask[..., :n]
    sinks = getattr(module, "sinks", None)
    if sinks is not None:
        scores = torch.cat([scores, sinks.reshape(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :n]
    return (probs @ v).transpose(1, 2), None


def _reference(module: Any, family: str) -> Any:
    """The plain transformers model with the module's weights in float64 (``tests.hf.test_hf_causal_lm._plain``; where
    ``AutoModelForCausalLM`` does not map the model's config, the same steps with the model's class itself)."""
    import copy

    import torch
    from transformers import AttentionInterface

    from tests.hf.test_hf_causal_lm import _plain

    AttentionInterface.register("float64_reference", _reference_attention)  # the tests' one, generalised
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if type(module.model.config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return _plain(module)
    # a causal LM built from an entry's config that holds a text config it does not map (Emu3, Mllama, Musicgen)
    config = copy.deepcopy(module.model.config)
    attention = "sdpa" if type(module.model)._supports_sdpa else "float64_reference"
    ref = type(module.model)._from_config(config, attn_implementation=attention, dtype=torch.float64).double()
    ref.load_state_dict(module.model.state_dict())
    with torch.no_grad():
        buffers = dict(ref.named_buffers())
        for name, buffer in module.model.named_buffers():
            buffers[name].copy_(buffer)
    return ref


def _capture_without_gradients() -> None:
    """``_fit``'s gradient capture (``CaptureStack``), also where a parameter got no gradient on a rank: saved as
    zeros (the reference's are zeros where its loss does not reach the parameter), their names recorded."""
    import torch

    from tests.hf import test_hf_causal_lm

    class CaptureNoneAsZero(test_hf_causal_lm.CaptureStack):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            missing = [(n, p) for n, p in pl_module.named_parameters() if p.grad is None]
            for _, p in missing:
                p.grad = torch.zeros_like(p)
            try:
                super().on_before_optimizer_step(trainer, pl_module, optimizer)
            finally:
                for _, p in missing:
                    p.grad = None
            self._pending["no_grad"] = [n for n, _ in missing]

    test_hf_causal_lm.CaptureStack = CaptureNoneAsZero  # _fit looks it up when called


def check_step(module: Any, result: Result, args: argparse.Namespace) -> None:
    import torch

    from tests.helpers import TokenDataset, step_errors
    from tests.hf.test_hf_causal_lm import Case, _fit, _redraw

    _capture_without_gradients()

    torch.manual_seed(args.seed)
    _redraw(module.model, args.seed)
    data = TokenDataset(2, SEQ, VOCAB - RESERVED, args.seed)
    data.ids += RESERVED
    data.labels[data.labels != -100] += RESERVED
    result.update(stage="reference")
    # float64 by default too, on both sides (XGLM's eager attention makes its mask's fill value in the default
    # dtype); the forked ranks inherit it
    torch.set_default_dtype(torch.float64)
    try:
        ref = _reference(module, result.row["family"])
        ref_loss, ref_grads, aux = _oracle(ref, data)
    except Exception as error:
        result.update(status="transformers cannot run it", detail="plain model: " + _first_line(error),
                      trace=traceback.format_exc()[-3000:])
        return
    # parameters the forward never uses (a vision tower on text-only batches) frozen, as the strategy asks of them
    unused = [n for n, p in ref.named_parameters() if p.grad is None and p.requires_grad]
    if unused:
        frozen = set(unused)
        for n, p in module.model.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        result.update(frozen=len(unused))
    result.update(stage="sp=2 step")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            results = _fit(module, data, Case(result.row["family"], sp=2, chunk_size=8), Path(tmp))
        except Exception as error:
            refused = _is_refusal(error)
            result.update(status="refused" if refused else "fails at sp=2",
                          detail=("" if refused else _where(error)) + _message(error),
                          trace=traceback.format_exc()[-3000:])
            return
    missing = sorted(set(ref_grads) - set(results[0]["grads"]))
    if missing:
        result.update(status="fails at sp=2", detail=f"gradients missing: {', '.join(missing[:3])}")
        return
    no_grad = sorted({n for r in results for n in r.get("no_grad", [])})
    if no_grad:
        result.update(no_grad=no_grad)
    errors = list(step_errors(results, ref_loss, ref_grads))
    ranked = sorted(errors, key=lambda e: -e[2] if e[2] == e[2] else -float("inf"))
    result.update(largest=[f"rank {rank} {what}: {err:.1e}" for rank, what, err in ranked[:8]],
                  loss=[f"rank {rank} {what}: {err:.1e}" for rank, what, err in errors if what.startswith("loss")])
    rank, what, worst = max(errors, key=lambda e: e[2] if e[2] == e[2] else float("inf"))
    note = (" (aux loss)" if aux else "") + (f" ({len(unused)} unused parameters frozen)" if unused else "")
    if worst <= TOLERANCE:
        result.update(status="exact", detail=f"max rel. error {worst:.1e}{note}", error=worst)
    else:
        result.update(status="DIFFERS", detail=f"{worst:.1e}: rank {rank} {what}{note}", error=worst)


# ---- the driver ----------------------------------------------------------------------------------------------------

def _limit_memory(gb: float) -> Any:
    def apply() -> None:
        limit = int(gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        os.nice(0)

    return apply


def covering_tests(config_class: str, model_type: str) -> str:
    """The test files that construct ``config_class`` (or build ``model_type`` through ``AutoConfig.for_model``)."""
    hits = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):  # tests/ and tests/hf/
        text = path.read_text()
        if re.search(rf"\b{re.escape(config_class)}\b", text) or (
                "AutoConfig.for_model(" in text and re.search(rf"[\"']{re.escape(model_type)}[\"']\s*:", text)):
            hits.append(path.name)
    # the family tests first (the exactness checks), then the others
    hits.sort(key=lambda name: not re.match(FAMILY_TESTS, name))
    shown = hits[:MAX_TESTS]
    return ", ".join(shown) + (f" (+{len(hits) - MAX_TESTS})" if len(hits) > MAX_TESTS else "") if hits else "-"


def _has_router_loss(model_type: str) -> bool:
    """Whether the family's config (or a sub-config of it) has ``output_router_logits``."""
    cls = _config_classes()[model_type]
    classes = [cls] + [c for c in (getattr(cls, "sub_configs", None) or {}).values() if isinstance(c, type)]
    return any(_has(c, "output_router_logits") for c in classes)


def run_one_subprocess(family: str, args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, os.path.abspath(__file__), "--one", family, "--result", path, "--seed", str(args.seed),
           "--window", str(args.window), "--max-layers", str(args.max_layers)]
    cmd += [flag for flag, on in (("--build-only", args.build_only), ("--aux-loss", args.aux_loss)) if on]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=ROOT,
                              preexec_fn=_limit_memory(args.memory_gb))
        code, stderr = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as error:
        code, stderr = None, (error.stderr or b"").decode(errors="replace") if isinstance(error.stderr, bytes) \
            else (error.stderr or "")
    seconds = time.perf_counter() - start
    try:
        row = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        row = {"family": family, "class": "", "status": "", "detail": "", "stage": "start"}
    Path(path).unlink(missing_ok=True)
    if not row.get("status"):
        stage = row.get("stage", "start")
        if code is None:
            why = f"timed out after {args.timeout:.0f} s at stage: {stage}"
        elif code < 0 or "MemoryError" in stderr or "std::bad_alloc" in stderr:
            why = f"killed (signal {-code}) or out of memory ({args.memory_gb} GB) at stage: {stage}" if code \
                else f"out of memory ({args.memory_gb} GB) at stage: {stage}"
        else:
            last = [x for x in stderr.strip().splitlines() if x.strip()][-1:] or [f"exit {code}"]
            why = f"exit {code} at stage {stage}: {last[0]}"
        status = "fails at sp=2" if stage == "sp=2 step" else \
            "transformers cannot run it" if stage == "reference" else "transformers cannot build it"
        row.update(status=status, detail=why)
    row["seconds"] = round(seconds, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=None, help="comma-separated model types (default: every one)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the rows as JSON")
    parser.add_argument("--md", default=None, metavar="PATH", help="write the table as Markdown")
    parser.add_argument("--build-only", action="store_true", help="stop after HFCausalLM(config): no step")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--window", type=int, default=11,
                        help="sliding windows and attention chunks longer than this shortened to it (0: defaults)")
    parser.add_argument("--max-layers", type=int, default=6, help="at most this many tiny layers (kinds of layer)")
    parser.add_argument("--aux-loss", action="store_true",
                        help="output_router_logits=True (the auxiliary router loss) where the config has it; without"
                             " --families, only the families that have it")
    parser.add_argument("--resume", action="store_true", help="keep the rows --json already holds; run the rest")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per family")
    parser.add_argument("--memory-gb", type=float, default=6.0, help="address-space limit of a family's processes")
    parser.add_argument("--jobs", type=int, default=1,
                        help="families measured at once, each in its own subprocess (rows still in order)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    AUX_LOSS[0] = args.aux_loss
    if args.one:
        run_family(args.one, args.result, args)
        return
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    if args.families:
        wanted = [f.strip() for f in args.families.split(",") if f.strip()]
        unknown = [f for f in wanted if f not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES]
        if unknown:
            parser.error(f"not causal-LM model types: {', '.join(unknown)}")
        families = wanted
    elif args.aux_loss:
        families = [f for f in families if _has_router_loss(f)]
    done = {}
    if args.resume and args.json and Path(args.json).exists():  # rows of an interrupted run of these settings
        done = {r["family"]: r for r in json.loads(Path(args.json).read_text())}
    rows = []
    pool = ThreadPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else None  # a thread waits on each subprocess
    pending = {f: pool.submit(run_one_subprocess, f, args) for f in families if f not in done} if pool else {}
    for i, family in enumerate(families):
        row = done[family] if family in done else pending[family].result() if pool else run_one_subprocess(family, args)
        row["test"] = covering_tests(CONFIG_MAPPING_NAMES.get(family, ""), family)
        rows.append(row)
        print(f"[{i + 1}/{len(families)}] {family}: {row['status']} ({row['seconds']} s) {row['detail'][:120]}",
              file=sys.stderr, flush=True)
        if args.json:  # after every family: a long run can be read while it runs
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if pool:
        pool.shutdown()
    table = print_table(["family", "class", "status", "detail", "test"],
                        [[r["family"], r["class"], r["status"], _cell(r["detail"]), r["test"]] for r in rows])
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    summary = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    print(f"\n{len(rows)} families: {summary}")
    if args.md:
        Path(args.md).write_text(table + f"\n\n{len(rows)} families: {summary}\n")


def _cell(text: str) -> str:
    text = " ".join(str(text).split()).replace("|", "\\|")
    return text if len(text) <= DETAIL_CHARS else text[:DETAIL_CHARS - 3] + "..."


if __name__ == "__main__":
    main()
