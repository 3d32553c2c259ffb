"""The fast tier: each node's `local_dir`, copies on other nodes, and restore from the nearest.

- `node`: which node and zone this process runs on (``SPOTCKPT_NODE``, ``SPOTCKPT_ZONE``).
- `redundancy`: ``replicate:F`` / ``ec:K+M`` specs and where each rank's copies go.
- `erasure`: Reed-Solomon parity and reconstruction (zfec), one stripe at a time.
- `exchange`: moving pieces of objects between ranks over the job's process group.
- `record`: the tier record (placement, parity checksums) written before a tier manifest.
- `recovery`: which step the union of surviving copies can restore, and how.
- `fast_tier`: a node's folder: saves with the manifest commit, inventory, retention, space.
"""
