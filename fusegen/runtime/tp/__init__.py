"""Tensor parallelism for generated fused models, on Transformers' own machinery (`from_pretrained(tp_plan="auto")`).

Why fused models need more than Transformers' built-in styles: a merged linear stacks several projections, and each
must be split on its own. `qkv_proj` holds q (by query heads), then k and v (by key/value heads); when there are fewer
kv heads than processes, each process keeps the kv head its query heads read (k and v are then replicated). Transformers'
`packed_colwise` only splits equal halves, and its `colwise` would hand process 0 all of q and process 1 all of k and v.

The pieces, for a generated file with a `TP_PLAN`:

- `TP_PLAN` (in the generated file) is the fused form of the config's `base_model_tp_plan`: the rules for
  `q_proj`/`k_proj`/`v_proj` become one `fusegen_merged_colwise` rule for `qkv_proj` plus a `fusegen_local_heads` rule
  for the attention module, `gate_proj`/`up_proj` become `gate_up_proj`; row-parallel `o_proj`/`down_proj`, and every
  rule for an unfused module, are kept as they are.
- `init_fused_parallel_plans` runs when a fused base model is built: Transformers merges the config's plan (which names
  projections that no longer exist); this swaps those rules for `TP_PLAN`'s and registers the two styles below.
- `LocalHeadsParallel` (on the attention module) checks the head counts against the number of processes N, raising a
  `ValueError` that names the model, the sizes and N, and sets the module's head counts to this process's.
- `MergedColumnParallel` (on each merged linear) replaces its weight and bias by this process's rows of each piece,
  sets `output_sizes` to the local piece sizes (the generated forward splits by it), and keeps inputs and outputs local.
- `check_plan_honoured` runs before anything is sharded: a fused rule matching a module it cannot work on (the
  merged style on a plain linear, local heads on a module without a merged q/k/v, MLA's `mla_kv_a_proj` on a merged
  linear whose last piece is not the rope-carrying one) raises a `ValueError` naming the model, the module and the
  rule. DeepSeek MLA needs no style of its own: its config's plan replicates the low-rank a-projections (merged into
  `fused_qkv_a_proj`, which keeps `mla_kv_a_proj`: the rope key's gradient is all-reduced, and those columns are
  still the merged output's last), splits q_b/kv_b by heads and o_proj by rows, and replicates the norms.

The merged parameters' placement, `MergedRowShard`, says what each process holds (its rows of every piece, kv heads
replicated over processes included), so `full_tensor()`, redistributing, gradients and saving see the true merged
weight; `model.state_dict()` lists the canonical pieces for distributed checkpointing (`fusegen.runtime.distributed`).

Loading reads only each process's slices where the layout allows: Transformers' shard-on-read slices every checkpoint
tensor by the placement of the parameter it feeds, one piece at a time, and `MergedRowShard` reads as `Shard(0)`, so
the merged parameter gets exactly `Shard(0)` block r of q, of k and of v (of gate and of up: ceil(rows/N) rows, the
last ranks fewer, when a piece of rows does not divide by N, as Transformers' `colwise` splits the original's). Replicated kv heads cannot be expressed
as a placement Transformers' loader reads by; such a `qkv_proj` is read whole (one layer at a time),
`PartitionedConcatenate` keeps this process's rows, and once loaded it takes its `MergedRowShard` (`describe_loaded`).

This module is imported when a fused model is first built, not when a generated file is imported.

The modules: `partition` (which rows each process keeps), `styles` (the two styles, the placement), `replicated_kv` (loading and saving replicated kv heads), `plans` (the run-time plan and its
checks), `packed` (packed q/k/v of the original classes, which no generated file uses). The compiler derives a
generated file's `TP_PLAN` (`fusegen.compiler.mappings.fused_plan_from`).
"""

from .packed import PACKED_ATTENTION, PACKED_COLWISE, PACKED_ROWWISE, PackedAttention, apply_packed_tp_plan
from .partition import RowPartition, check_head_counts, partition_rows
from .plans import check_plan_honoured, fused_tp_plan, init_fused_parallel_plans, register_styles
from .replicated_kv import PartitionedConcatenate, PartitionedSplit, use_partitioned_concatenate
from .styles import LOCAL_HEADS, MERGED_COLWISE, MLA_KV_A, LocalHeadsParallel, MergedColumnParallel

__all__ = [
    "LOCAL_HEADS",
    "MERGED_COLWISE",
    "MLA_KV_A",
    "PACKED_ATTENTION",
    "PACKED_COLWISE",
    "PACKED_ROWWISE",
    "LocalHeadsParallel",
    "MergedColumnParallel",
    "PackedAttention",
    "PartitionedConcatenate",
    "PartitionedSplit",
    "RowPartition",
    "apply_packed_tp_plan",
    "check_head_counts",
    "check_plan_honoured",
    "fused_tp_plan",
    "init_fused_parallel_plans",
    "partition_rows",
    "register_styles",
    "use_partitioned_concatenate",
]
