"""The ``SPOTCKPT_*`` environment variables that are not settings, named in one low place.

`spotckpt.config` reads every other ``SPOTCKPT_*`` variable as a setting and refuses one it does
not know, so a feature's own variable is declared here (not in the feature's module), where the
feature reads it from and config skips it without importing the feature.
"""

from __future__ import annotations

NODE_VARIABLE = "SPOTCKPT_NODE"
"""This machine's node id for the fast tier (`spotckpt.tiers.node`); else the host name."""
ZONE_VARIABLE = "SPOTCKPT_ZONE"
"""This node's failure domain for copy placement (`spotckpt.tiers.node`)."""
AZURE_ENDPOINT_ENV = "SPOTCKPT_AZURE_METADATA_ENDPOINT"
"""The Azure instance metadata base URL (`spotckpt.preemption.azure`)."""
AZURE_VM_NAME_ENV = "SPOTCKPT_AZURE_VM_NAME"
"""This VM's name in Azure Scheduled Events (`spotckpt.preemption.azure`)."""

FEATURE_VARIABLES = frozenset({NODE_VARIABLE, ZONE_VARIABLE, AZURE_ENDPOINT_ENV, AZURE_VM_NAME_ENV})
"""Every variable above: what `spotckpt.config` does not read as a setting."""
