"""How ``checkpoint_before_the_move.ckpt`` was made: run at commit 8458161 (the last one before the package's root
modules moved into folders, issue 41) from the repository root, as

    PYTHONPATH=. python tests/data/make_checkpoint.py tests/data/checkpoint_before_the_move.ckpt

A tiny LlamaLM (one layer of 16 wide, 32 tokens of vocabulary) trained one step under FPDTStrategy in one process,
saved by the trainer: the model's and optimizer's states, the run state, and the hyper-parameters with their
``_class_path``. ``tests/test_checkpoint_compat.py`` loads it with the code as it is now.
"""

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader

from lightning_fpdt import FPDTStrategy
from lightning_fpdt.models import LlamaConfig, LlamaLM
from tests.helpers import TokenDataset

CONFIG = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
              vocab_size=32)

if __name__ == "__main__":
    torch.manual_seed(0)
    module = LlamaLM(LlamaConfig.tiny(**CONFIG), learning_rate=1e-3, warmup_steps=1)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, strategy=FPDTStrategy(chunk_size=8))
    trainer.fit(module, DataLoader(TokenDataset(2, 16, 32, seed=0), batch_size=2))
    trainer.save_checkpoint(sys.argv[1])
