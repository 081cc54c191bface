"""``gpu_check.py``'s check of ``shard_parameters`` with ``offload_optimizer`` (FSDP2's CPU offload), which only a
CUDA device runs: a small Llama read from a local Hugging Face directory on the meta device, sharded by FSDP2 over a
mesh of this one device with its shards in host memory (as ``FPDTStrategy`` shards and fills it), one training step
(forward, backward, gradient clipping, an optimizer step on the host) against the same model unsharded on the
device, float32: the loss, every gradient and every weight after the step. The step is SGD with momentum, whose
update scales the gradient (Adam's first step divides it by its own size, which would turn a kernel's last-bit
difference in a near-zero gradient into a visible one). On CPU (``--cpu``) the same code runs without the offload,
which CPU refuses: a smoke run of the harness.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import max_rel_error
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_fpdt.errors import one_line
from lightning_fpdt.models import LlamaLM
from lightning_fpdt.strategy.sharding import host_shards_backend, load_shards_of, shard_module

TOLERANCE = 1e-5  # max|a - b| / max|b| of float32 steps; the offloaded optimizer step runs on the host


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().to("cpu", torch.float64)


def _step(module: LlamaLM, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One step of ``module`` on ``ids``: the loss, the gradients (clipped) and the weights after the step."""
    optimizer = torch.optim.SGD(module.parameters(), lr=1e-2, momentum=0.9)
    logits = module(ids)
    loss = F.cross_entropy(logits[0, :-1].float(), ids[0, 1:])
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    grads = {name: _whole(p.grad) for name, p in module.named_parameters()}
    optimizer.step()
    return loss.item(), grads, {name: _whole(p) for name, p in module.named_parameters()}


def offload_optimizer_rows(device: torch.device, cpu: bool) -> tuple[list[list[Any]], bool]:
    """The check's one row (where the shards lived, the errors of the loss, the worst gradient and the worst weight
    after the step, the status) and whether it passed; an error is reported in the row, not raised."""
    offload = not cpu
    started = not dist.is_initialized()
    if started:  # one process: FSDP2 needs a process group and a device mesh
        backend = host_shards_backend(device, offload) or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        import transformers

        with tempfile.TemporaryDirectory() as directory:
            config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=False)
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(config).save_pretrained(directory)
            reference = LlamaLM(hf_checkpoint=directory)
            reference.load_weights(device)
            sharded = LlamaLM(hf_checkpoint=directory)
            shard_module(sharded, init_device_mesh(device.type, (1,)), "32-true", offload_optimizer=offload)
            load_shards_of(sharded, device, on_host=offload)
            shards = sorted({p.to_local().device.type for p in sharded.parameters()})
            ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1)).to(device)
            loss_ref, grads_ref, weights_ref = _step(reference, ids)
            loss, grads, weights = _step(sharded, ids)
        errors = [max_rel_error(loss, loss_ref), max(max_rel_error(grads[name], grads_ref[name]) for name in grads_ref),
                  max(max_rel_error(weights[name], weights_ref[name]) for name in weights_ref)]
        ok = all(e <= TOLERANCE for e in errors) and shards == (["cpu"] if offload else [device.type])
        return [[f"offload_optimizer={offload}", "/".join(shards), *errors, TOLERANCE, "ok" if ok else "FAILED"]], ok
    except Exception as err:  # the remaining sections still run
        line = one_line(err)[:300]
        return [[f"offload_optimizer={offload}", "-", "-", "-", "-", TOLERANCE, f"FAILED: {type(err).__name__}: {line}"]
                ], False
    finally:
        if started:
            dist.destroy_process_group()
