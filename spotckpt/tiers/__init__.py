"""The fast tier: each node's `local_dir`, copies on other nodes, and restore from the nearest.

- `node`: which node and zone this process runs on (``SPOTCKPT_NODE``, ``SPOTCKPT_ZONE``).
- `redundancy`: where each rank's copies go for a ``replicate:F`` / ``ec:K+M`` spec (the
  spec's value and parser: `spotckpt.redundancy`, below config).
- `erasure`: Reed-Solomon parity and reconstruction (zfec), one stripe at a time.
- `exchange`: moving pieces of objects between ranks over the job's process group.
- `record`: the tier record (placement, parity checksums) written before a tier manifest.
- `retention`: retention's view of a node's tier steps (the bucket's rule, read on one node).
- `recovery`: which step the union of surviving copies can restore, and how.
- `folder`: a node's tier folder on its disk (`local_dir` resolved, the folder id).
- `copies`: the copies and parity pieces a tier operation writes into a node's folder.
- `peers`: the collectives of one tier operation; a lost peer named on every rank.
- `fast_tier`: the tier's API and `TierWriter`: saves with the manifest commit, inventory,
  retention, space.
"""
