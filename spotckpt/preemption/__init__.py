"""Preemption notices: `PreemptionWatcher` and the sources it watches."""

from __future__ import annotations

from spotckpt.preemption.watcher import (
    AWS_DEFAULT_ENDPOINT,
    AWS_MALFORMED_TRUSTED,
    AWS_NOTICE_S,
    AWS_TOKEN_TTL_S,
    DEFAULT_SIGNALS,
    GCE_DEFAULT_HOST,
    GCE_NOTICE_S,
    MAX_ANSWER_BYTES,
    PreemptionWatcher,
    SignalHandler,
    aws_metadata_endpoint,
    gce_metadata_url,
)

__all__ = [
    "AWS_DEFAULT_ENDPOINT",
    "AWS_MALFORMED_TRUSTED",
    "AWS_NOTICE_S",
    "AWS_TOKEN_TTL_S",
    "DEFAULT_SIGNALS",
    "GCE_DEFAULT_HOST",
    "GCE_NOTICE_S",
    "MAX_ANSWER_BYTES",
    "PreemptionWatcher",
    "SignalHandler",
    "aws_metadata_endpoint",
    "gce_metadata_url",
]
