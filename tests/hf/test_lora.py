"""LoRA adapters (peft) on ``HFCausalLM``: trained under FPDT with the memory stack, exact against peft on plain
transformers in one process, exported merged or as peft's adapter, resumed after a SIGKILL.

The oracle is peft's ``get_peft_model`` on the plain transformers model (float64, sdpa) with the same base and
adapter weights (every weight redrawn, B included, so no gradient is zero by construction), its mean cross-entropy
over the same targets computed in float64.
"""

from __future__ import annotations

import copy
import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.export.adapter import export_adapter
from lightning_fpdt.export.hf_directory import HFExport, export
from lightning_fpdt.hf.lora import adapter_layers
from lightning_fpdt.memory import EstimateOptions, ModelShape, estimate
from lightning_fpdt.models import HFCausalLM
from lightning_fpdt.models.from_config import module_from_yaml
from lightning_fpdt.parallel.batches import shard_batch
from lightning_fpdt.parallel.binding import SequenceParallelContext, bind
from lightning_fpdt.parallel.dtensors import full_tensor
from lightning_fpdt.strategy.sharding import shard_module
from lightning_fpdt.testing import run_in_fork, run_on_ranks
from tests.helpers import TokenDataset, assert_same_step, dataloader, step_errors, training_step_peak
from tests.hf.test_hf_causal_lm import SEQ, SIZES, VOCAB, _redraw

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def _llama() -> LlamaConfig:
    return LlamaConfig(**dict(SIZES, num_key_value_heads=1))


def _module(seed: int, **lora: Any) -> HFCausalLM:
    module = HFCausalLM(_llama(), mlp_tiles=3, loss_tiles=5, learning_rate=1e-3, warmup_steps=1,
                        lora={**LORA, **lora}).double()  # float64 in the parent too: it gets the trained weights
    _redraw(module.model, seed)  # the adapters too: B is not zero, so A's gradient is not either
    return module


def _peft_reference(module: HFCausalLM) -> PeftModel:
    """peft's LoRA on the plain transformers model (float64, sdpa), with ``module``'s base and adapter weights."""
    config = copy.deepcopy(module.model.config)  # from_config sets its attention implementation on the config
    plain = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float64)
    ref = get_peft_model(plain, LoraConfig(**LORA))
    ref.base_model.model.load_state_dict(module.model.state_dict())
    with torch.no_grad():  # RoPE's inv_freq is not in the state dict
        buffers = dict(ref.base_model.model.named_buffers())
        for name, buffer in module.model.named_buffers():
            buffers[name].copy_(buffer)
    return ref


def _peft_step(ref: PeftModel, data: TokenDataset) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The mean float64 cross-entropy of each sample alone, and the adapters' gradients under HFCausalLM's names."""
    loss_sum, count = torch.zeros((), dtype=torch.float64), 0
    for i in range(len(data)):
        logits = ref(input_ids=data.ids[i:i + 1], use_cache=False).logits.double()
        targets = data.labels[i:i + 1, 1:]
        loss_sum = loss_sum + F.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
        count += int((targets != -100).sum())
    loss = loss_sum / count
    loss.backward()
    grads = {"model." + n.removeprefix("base_model.model."): p.grad.detach().clone()
             for n, p in ref.named_parameters() if p.requires_grad}
    return loss.detach(), grads


class CaptureAdapters(L.Callback):
    """Saves, on every rank, the first step's loss, the gradient of every trainable parameter, the names of the
    parameters that got a gradient, what the optimizer holds, and whether each decoder layer was sharded."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.pending = {
            "grads": {n: full_tensor(p.grad).detach().clone() for n, p in pl_module.named_parameters()
                      if p.requires_grad},
            "with_grad": sorted(n for n, p in pl_module.named_parameters() if p.grad is not None),
            "in_optimizer": sorted(n for n, p in pl_module.named_parameters() if id(p) in in_optimizer),
            "sharded": [isinstance(layer.module, FSDPModule) for layer in pl_module.decoder_layers()],
        }

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if batch_idx == 0:
            self.pending["loss"] = trainer.callback_metrics["train/loss"].detach().clone()
            torch.save(self.pending, self.out / f"rank{trainer.global_rank}.pt")


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, use_cache=False).logits.detach()


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.distributed
@pytest.mark.parametrize("shard", [False, True], ids=["ddp", "fsdp2"])
def test_fit_step_equals_peft_and_both_exports_reload(shard: bool, tmp_path: Path, fresh_seed: int) -> None:
    """sp=2, 4 chunks of 8 tokens with offload emulation, tiled MLP and loss, every decoder layer checkpointed through
    (emulated) host memory, DDP or FSDP2: the loss and every adapter gradient equal peft's in one process to 1e-10, the
    base weights get no gradient and stay out of the optimizer. The checkpoint (a file, or a sharded directory) then
    exports merged (``from_pretrained``) and as peft's adapter (``PeftModel.from_pretrained``), both with the trained
    model's logits to 1e-12."""
    torch.manual_seed(fresh_seed)
    module = _module(fresh_seed)
    ref = _peft_reference(module)
    data = TokenDataset(2, SEQ, VOCAB, fresh_seed)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[CaptureAdapters(tmp_path), ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="last")],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math", offload="emulate",
                              activation_checkpointing=True, offload_checkpoints="emulate", shard_parameters=shard,
                              start_method="fork"),
    )
    trainer.fit(module, dataloader(data, len(data)))
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    ref_loss, ref_grads = _peft_step(ref, data)
    assert len(ref_grads) == 2 * len(TARGETS) * SIZES["num_hidden_layers"]
    print(f"lora shard={shard}: max rel. error {max(e for _, _, e in step_errors(results, ref_loss, ref_grads)):.2e}")
    assert_same_step(results, ref_loss, ref_grads, tol=1e-10, label=f"lora shard={shard} seed={fresh_seed}")
    for r in results:  # only the adapters: gradients, optimizer; the layers sharded under FSDP2
        assert r["with_grad"] == r["in_optimizer"] == sorted(ref_grads), r["with_grad"][:4]
        assert r["sharded"] == [shard] * SIZES["num_hidden_layers"]

    # the trained module (the launcher hands the parent the workers' weights) and its logits in one process
    ckpt = tmp_path / "ckpt" / "last.ckpt"
    assert ckpt.is_dir() == shard
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(fresh_seed))
    trained = module.forward(ids).detach()
    merged = export(ckpt, tmp_path / "merged")
    plain = AutoModelForCausalLM.from_pretrained(merged, attn_implementation="sdpa", dtype=torch.float64)
    assert _close(_logits(plain, ids), trained) < 1e-12
    adapter = export_adapter(ckpt, tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["r"]
    base = AutoModelForCausalLM.from_config(copy.deepcopy(module.model.config), attn_implementation="sdpa",
                                            dtype=torch.float64)
    base.load_state_dict({n.replace(".base_layer.", "."): t for n, t in module.model.state_dict().items()
                          if ".lora_" not in n})
    assert _close(_logits(base, ids), trained) > 1e-6  # the adapter changes the logits
    peft_model = PeftModel.from_pretrained(base, adapter)
    assert _close(_logits(peft_model, ids), trained) < 1e-12


@pytest.mark.distributed
def test_a_pretrained_directory_trains_sharded_and_exports_its_adapter(tmp_path: Path) -> None:
    """A local directory, built on the meta device and read shard by shard under FSDP2 (each rank its rows of the
    base, its rows of the adapters drawn): one step changes the adapters only, and ``HFExport(adapter=True)`` writes
    an adapter that peft loads onto the directory's model (named in ``adapter_config.json``) with the trained logits."""
    plain = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    plain.save_pretrained(tmp_path / "base")
    module = HFCausalLM(str(tmp_path / "base"), mlp_tiles=3, loss_tiles=5, learning_rate=1e-2, warmup_steps=1,
                        lora=dict(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    data = TokenDataset(2, SEQ, VOCAB, 5)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False,
        callbacks=[HFExport(str(tmp_path / "adapter"), adapter=True)],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math", shard_parameters=True,
                              start_method="fork"),
    )
    trainer.fit(module, dataloader(data, len(data)))
    trained = {n.replace(".base_layer.", "."): t for n, t in module.model.state_dict().items()}
    for name, tensor in plain.state_dict().items():
        assert torch.equal(trained[name], tensor), name
    assert all(layer.lora_B["default"].weight.any() for _, layer in adapter_layers(module.model))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(tmp_path / "base") and config["task_type"] == "CAUSAL_LM"
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", attn_implementation="sdpa", dtype=torch.float64)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter")
    assert _close(_logits(loaded, ids), module.forward(ids).detach()) < 1e-12


# ---- resume ----------------------------------------------------------------------------------------------------


class Kill(L.Callback):
    """SIGKILLs the whole process group at the start of step ``step``; records every step's loss (rank 0)."""

    def __init__(self, out: Path, step: int | None) -> None:
        self.out, self.step = out, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.step is not None and trainer.global_step == self.step and trainer.is_global_zero:
            os.killpg(os.getpgrp(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.is_global_zero:
            with open(self.out / "losses.txt", "a") as f:
                f.write(f"{trainer.global_step} {trainer.callback_metrics['train/loss'].item()!r}\n")


def _resume_job(out: Path, die_at: int | None, ckpt: str | None, shard: bool) -> None:
    torch.manual_seed(0)
    module = _module(0)
    data = TokenDataset(6, SEQ, VOCAB, seed=3)
    trainer = L.Trainer(
        accelerator="cpu", devices=2, precision="64-true", max_steps=5, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[Kill(out, die_at), ModelCheckpoint(dirpath=out.parent / "ckpt", filename="{step}",
                                                      every_n_train_steps=2, save_top_k=-1)],
        strategy=FPDTStrategy(sequence_parallel_size=2, chunk_size=8, attention_backend="math",
                              activation_checkpointing=True, offload_checkpoints="emulate", shard_parameters=shard,
                              start_method="fork"),
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=1, shuffle=True), ckpt_path=ckpt)
    torch.save({k: v.detach().clone() for k, v in module.state_dict().items()}, out / "final.pt")


def _losses(out: Path) -> dict[int, str]:
    return dict(line.split(" ", 1) for line in (out / "losses.txt").read_text().splitlines())


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("shard", [False, True], ids=["replicated-file", "sharded-dcp"])
def test_killed_lora_run_resumes_to_the_same_adapters(shard: bool, tmp_path: Path) -> None:
    """A run SIGKILLed at step 3 and resumed from its step-2 checkpoint (a file, or FSDP2's sharded directory) ends
    with the uninterrupted run's weights, bitwise (the adapters' AdamW state restored with them: two more steps would
    differ otherwise), and logs the same loss at every step; the base weights never change."""
    runs = {name: tmp_path / name / "run" for name in ("whole", "killed")}
    for out in runs.values():
        out.mkdir(parents=True)

    def job(name: str, die_at: int | None = None, ckpt: str | None = None) -> int:
        proc = run_in_fork(lambda: _resume_job(runs[name], die_at, ckpt, shard), ["lora-resume"], timeout=240)
        assert proc.returncode in (0, -signal.SIGKILL), proc.stderr[-3000:]
        return proc.returncode

    assert job("whole") == 0
    assert job("killed", die_at=3) == -signal.SIGKILL
    saved = tmp_path / "killed" / "ckpt" / "step=2.ckpt"
    assert job("killed", ckpt=str(saved)) == 0
    whole, resumed = (torch.load(runs[name] / "final.pt") for name in ("whole", "killed"))
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name
    assert _losses(runs["killed"]) == _losses(runs["whole"]) and len(_losses(runs["whole"])) == 5
    start = _module(0).state_dict()
    changed = sorted(n for n in whole if not torch.equal(whole[n], start[n]))
    assert changed and all(".lora_" in n for n in changed), changed[:4]


# ---- the memory estimate ---------------------------------------------------------------------------------------


def _measured_lora_step(rank: int, world: int, sharded: bool) -> tuple[int, int]:
    """One step of an HFCausalLM heavy in parameters (8 layers, intermediate 2048) with rank-8 adapters on every
    projection, at sp=2, 1024 tokens per rank, 4 chunks, checkpointed and tiled (``sharded``: FSDP2 in bf16-mixed):
    the measured peak of live tensors and the estimate's device peak."""
    torch.manual_seed(0)
    module = HFCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=1024, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2),
                        lora=dict(r=8, target_modules=TARGETS))
    shape, tiling = ModelShape.from_module(module)
    seq, chunk, precision = 1024, 256, "bf16-mixed" if sharded else "32-true"
    bind(module, SequenceParallelContext(group=dist.group.WORLD, chunk_size=chunk, attention_backend="sdpa",
                                         activation_checkpointing=True))
    if sharded:
        shard_module(module, init_device_mesh("cpu", (world,)), precision, offload_optimizer=False)
        register_fsdp_forward_method(module, "loss_terms")
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(seq))
    batch = shard_batch({"input_ids": ids}, world, rank, chunk)

    measured = training_step_peak(module, batch, optimizer, reduce_gradients=not sharded, bf16=sharded,
                                  resizable=sharded)
    options = EstimateOptions(sequence_parallel_size=world, chunk_size=chunk, activation_checkpointing=True,
                              shard_parameters=sharded, precision=precision, **tiling)
    return measured, estimate(shape, seq, options).device_peak


def _measured_lora_steps(rank: int, world: int) -> list[tuple[int, int]]:
    return [_measured_lora_step(rank, world, sharded) for sharded in (False, True)]  # one start of the processes


@pytest.mark.distributed
def test_the_memory_estimate_counts_the_adapters_alone() -> None:
    """Gradients and AdamW state of the adapters only, no gradient for the frozen output projection: the estimate is
    1.00-1.02x the measured peak, replicated and under FSDP2 in bf16-mixed (2.03-2.05x when it counted them for every
    parameter)."""
    for sharded, (measured, estimated) in zip((False, True), run_on_ranks(_measured_lora_steps, 2)[0]):
        print(f"lora sharded={sharded}: measured {measured / 2**20:.1f} MiB, estimate {estimated / 2**20:.1f} MiB")
        assert 0.98 <= estimated / measured <= 1.1, (sharded, measured / 2**20, estimated / 2**20)


def test_the_shape_of_an_adapted_model_is_its_base_models() -> None:
    """LoRA's A and B are nn.Linear modules too: they are not read as the MLP's projections or the output projection."""
    adapted, plain = (ModelShape.from_module(HFCausalLM(_llama(), lora=lora))[0] for lora in (LORA, None))
    adapters = 2 * 4 * SIZES["num_hidden_layers"] * (  # r x (in + out) for each of A and B, per projection
        (32 + 32) * 2 + (32 + 8) * 2 + (32 + 64) * 3) // 2
    assert adapted.trainable_params == adapters and not adapted.head_trainable and plain.trainable_params is None
    fields = ("intermediate_size", "mlp_projections", "vocab_size", "hidden_size", "experts_per_token")
    assert [getattr(adapted, f) for f in fields] == [getattr(plain, f) for f in fields]


# ---- what is refused, and where --------------------------------------------------------------------------------


def test_only_the_adapters_train() -> None:
    module = _module(1)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(TARGETS) * SIZES["num_hidden_layers"] and all(".lora_" in n for n in trainable)
    optimizer = module.configure_optimizers()["optimizer"]
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    assert module.hparams["lora"] == LORA  # a checkpoint rebuilds the adapters


@pytest.mark.parametrize(("lora", "error", "message"), [
    (dict(target_modules=["lm_head"]), NotImplementedError,
     r"model\.lm_head, which lies outside the decoder layers \(the output embedding"),
    (dict(use_dora=True), NotImplementedError, r"\['use_dora'\] are not supported"),
    (dict(bias="all"), NotImplementedError, r"bias='all' trains the base model's biases"),
    (dict(init_lora_weights="pissa"), NotImplementedError, r"init_lora_weights='pissa' is not supported"),
    (dict(rank=4), ValueError, r"\['rank'\] are not LoraConfig options"),
    (dict(target_modules=["no_such_proj"]), ValueError, r"cannot be applied to LlamaForCausalLM"),
    # the MLP's adapters run inside the tiled MLP, recomputed in backward
    (dict(lora_dropout=0.1), NotImplementedError,
     r"lora_dropout=0\.1 on model\.model\.layers\.0\.mlp\.gate_proj; the tiled MLP recomputes each tile"),
])
def test_what_is_refused_at_construction(lora: dict, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        _module(0, **lora)


MOE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2)


@pytest.mark.parametrize(("config", "targets", "message"), [
    # peft wraps the fused expert parameters of "all-linear"'s experts: no nn.Linear
    (lambda: Qwen3MoeConfig(**MOE, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2),
     "all-linear", r"model\.model\.layers\.0\.mlp\.experts, a ParamWrapper: only nn\.Linear projections"),
    # the router's logits feed the auxiliary loss through FPDT's tap on it
    (lambda: MixtralConfig(**MOE, num_local_experts=4), ["gate"],
     r"model\.model\.layers\.0\.mlp\.gate, which runs FPDT's own forward \(RouterTap: a router"),
])
def test_mixture_of_experts_targets_that_would_miss_their_adapter_are_refused(config, targets, message) -> None:
    with pytest.raises(NotImplementedError, match=message):
        HFCausalLM(config(), lora=dict(r=2, target_modules=targets))


def test_dropout_outside_what_is_recomputed_trains_and_checkpointing_refuses_it() -> None:
    """The attention's projections run once without activation checkpointing (dropout as in peft); checkpointed
    decoder layers are recomputed, so binding a context that checkpoints refuses their dropout, by name."""
    module = _module(0, target_modules=["q_proj", "v_proj"], lora_dropout=0.1)
    module.train()
    module.forward(torch.randint(0, VOCAB, (1, SEQ)))
    with pytest.raises(NotImplementedError, match=r"lora_dropout=0\.1 on model\.model\.layers\.0\.self_attn\.q_proj;"
                                                  r" activation_checkpointing recomputes each decoder layer"):
        module.bind_sequence_parallel(SequenceParallelContext(activation_checkpointing=True))


def test_an_adapted_layer_the_forward_does_not_call_is_refused() -> None:
    """A family that read a projection's weight directly would bypass its adapter: found at the first forward."""
    module = _module(0, target_modules=["q_proj"])
    attention = module.model.model.layers[1].self_attn
    attention.adapted = attention.q_proj  # still in the model, no longer called
    attention.q_proj = attention.q_proj.base_layer
    with pytest.raises(NotImplementedError, match=r"model\.model\.layers\.1\.self_attn\.adapted did not run"):
        module.forward(torch.randint(0, VOCAB, (1, SEQ)))


def test_a_pretrained_directory_reads_its_base_under_transformers_names(tmp_path: Path) -> None:
    """Built on the meta device from a local directory: the base weights are the directory's, the adapters drawn as
    peft draws them (A uniform in +-1/sqrt(in), B zero), so the untrained model is the pretrained one."""
    plain = AutoModelForCausalLM.from_config(_llama(), dtype=torch.float64)
    plain.save_pretrained(tmp_path / "base")
    module = HFCausalLM(str(tmp_path / "base"), lora=dict(r=4, target_modules=["q_proj", "down_proj"]))
    assert module.weights_pending
    module.load_weights()
    names = {n.replace(".base_layer.", "."): t for n, t in module.model.state_dict().items() if ".lora_" not in n}
    for name, tensor in plain.state_dict().items():
        assert torch.equal(names[name], tensor), name
    for _, layer in adapter_layers(module.model):
        a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
        assert a.abs().max() <= a.shape[1] ** -0.5 and a.std() > 0 and not b.any()
    ids = torch.randint(0, VOCAB, (1, SEQ))
    assert _close(module.double().forward(ids).detach(), _logits(plain, ids)) < 1e-12


@pytest.mark.parametrize("init", [True, "gaussian"])
def test_adapters_drawn_on_a_pending_model_follow_peft(init: bool | str, tmp_path: Path) -> None:
    """The adapters a meta-device model draws once its weights are in have peft's distributions for its
    ``init_lora_weights``: A uniform in +-1/sqrt(in) (True) or normal with std 1/r ("gaussian", as peft draws it),
    against peft drawing the same adapters itself; B zero."""
    config = LlamaConfig(**dict(SIZES, hidden_size=128, intermediate_size=256, num_key_value_heads=1))
    AutoModelForCausalLM.from_config(config, dtype=torch.float64).save_pretrained(tmp_path / "base")
    lora = dict(r=16, target_modules=["q_proj", "down_proj"], init_lora_weights=init)
    module = HFCausalLM(str(tmp_path / "base"), lora=lora)
    module.load_weights()
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(**lora))
    ours, theirs = (torch.cat([layer.lora_A["default"].weight.flatten() for _, layer in adapter_layers(m)])
                    for m in (module.model, peft))
    assert ours.numel() == theirs.numel() > 10000  # the std of each within 1%
    assert abs(ours.std() / theirs.std() - 1) < 0.05, (init, ours.std(), theirs.std())
    assert abs(ours.abs().max() / theirs.abs().max() - 1) < 0.5
    assert all(not layer.lora_B["default"].weight.any() for _, layer in adapter_layers(module.model))


def test_the_qwen3_recipe_builds_its_adapters(tmp_path: Path) -> None:
    """examples/configs/lora_qwen3_8b_128k.yaml's model section, its model a tiny Qwen3 config: adapters on every
    attention and MLP projection, the rest frozen; its strategy fills one 8-GPU node."""
    fit = yaml.safe_load((Path(__file__).parents[2] / "examples" / "configs" / "lora_qwen3_8b_128k.yaml").read_text())
    Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8).save_pretrained(tmp_path)
    section = copy.deepcopy(fit["model"])
    section["init_args"]["model"] = str(tmp_path)
    module = module_from_yaml(section, on_meta=True)
    assert sorted(module.lora.target_modules) == sorted(TARGETS) and module.lora.lora_dropout == 0
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(TARGETS) * 2 and all(".lora_" in n for n in trainable)
    strategy = fit["trainer"]["strategy"]["init_args"]
    assert fit["trainer"]["devices"] % strategy["sequence_parallel_size"] == 0 and strategy["shard_parameters"]
    assert fit["data"]["init_args"]["seq_len"] == 131072


def test_an_adapter_export_of_a_model_without_adapters_is_refused_before_training(tmp_path: Path) -> None:
    callback = HFExport(str(tmp_path / "adapter"), adapter=True)
    with pytest.raises(ValueError, match=r"--adapter exports LoRA adapters, but the checkpoint holds an HFCausalLM"
                                         r" without lora"):
        callback.on_fit_start(None, HFCausalLM(_llama()))


def test_the_adapters_of_a_bfloat16_base_train_in_float32() -> None:
    """As peft's get_peft_model makes them (autocast_adapter_dtype): the frozen base may stay in bf16 (half its
    memory), the trained adapters and their AdamW state are float32 (bf16-mixed, DDP and FSDP2 train it on CPU)."""
    module = HFCausalLM(AutoModelForCausalLM.from_config(_llama(), dtype=torch.bfloat16),
                        lora=dict(r=4, target_modules=["q_proj", "down_proj"]))
    dtypes: dict[bool, set[torch.dtype]] = {}
    for name, p in module.named_parameters():
        dtypes.setdefault(".lora_" in name, set()).add(p.dtype)
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}
