"""A decoder layer under FPDT: ``FPDTBlock`` and rotary embeddings (the own models' layers), activation checkpointing
and streaming (a layer's forward, recomputation and backward chunk by chunk), the token-mixing probe, the tiled
cross-entropy and the one token mean of an accumulation window."""
