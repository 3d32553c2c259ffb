"""The engine: everything that speaks PyTorch Distributed Checkpoint (DCP).

Above it, `spotckpt.manager` decides when and where to save and which step to restore; below it,
`spotckpt.catalog` owns the bucket layout and `spotckpt.format` the on-bucket formats. The engine
knows nothing of policy.

- `checkpointer`: the one caller of ``dcp.save``, ``dcp.async_save`` and ``dcp.load`` (groups,
  staging, DCP's errors turned into spotckpt's).
- `flat_state`: a big plain state dict handed to DCP under one top-level key (DCP's cost per
  top-level key), with planners that unwrap it.
- `writer`: `ObjectStoreWriter`, DCP's storage writer: one streamed safetensors object per rank,
  then the commit.
- `manifests`: what each rank reports of its writes, and the manifest (or indexed root) built
  from it.
- `packing`: packs of small tensors on save, runs of them on restore.
- `reader`: `ObjectStoreReader`, DCP's storage reader: read planning, in-place reads, coalescing.
- `shared_reads`: a piece wanted by several ranks is read once and broadcast.
- `chunks`: verified reads of stored chunks (sizes and CRC32Cs), shared with verify and export.
- `planners`: load planning with checked keys, a rank's local plan, what a load reads; the save
  planner of indexed saves (`ScalingSavePlanner`).
- `global_plan`: the coordinator's global save plan from compact local plans, and the cache of
  unchanged plans.
- `plan_check`: DCP's global-plan rules (bounds, overlaps, fill) in O(n log n) per tensor.

Save, in order: `Checkpointer.save` -> DCP -> `ObjectStoreWriter` (``prepare_global_plan``,
``write_data``, ``finish`` -> `manifests.build_manifest` -> `Catalog.commit`). Restore:
`Catalog.read_manifest` -> `ObjectStoreReader` -> `Checkpointer.load` with a
`CheckedLoadPlanner` -> DCP -> ``read_data``.
"""
