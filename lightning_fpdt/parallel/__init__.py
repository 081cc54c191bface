"""How a sequence is spread over ranks: the FPDT layout (label shift, padding, the strided chunk permutation, packed
documents), the collectives between sequence- and head-sharded layouts, the device mesh and its groups, each batch
checked and made into this rank's shard, DTensor helpers, and the binding contract between the strategy and a model
(``SequenceParallelContext``, the layer protocols, the walker that binds them)."""
