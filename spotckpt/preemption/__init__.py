"""Preemption notices: `PreemptionWatcher`, and the sources it watches (one class a cloud)."""

from __future__ import annotations

from spotckpt.preemption.aws import (
    AWS_DEFAULT_ENDPOINT,
    AWS_MALFORMED_TRUSTED,
    AWS_NOTICE_S,
    AWS_TOKEN_TTL_S,
    AwsNoticeSource,
    aws_metadata_endpoint,
)
from spotckpt.preemption.azure import (
    AZURE_DEFAULT_ENDPOINT,
    AZURE_NOTICE_S,
    AzureNoticeSource,
    azure_metadata_endpoint,
)
from spotckpt.preemption.gce import (
    GCE_DEFAULT_HOST,
    GCE_NOTICE_S,
    GceNoticeSource,
    gce_metadata_url,
)
from spotckpt.preemption.signals import DEFAULT_SIGNALS, SignalHandler
from spotckpt.preemption.source import MAX_ANSWER_BYTES, Backoff, Notice, NoticeSource
from spotckpt.preemption.watcher import SIGNAL_WINDOW, NoticeWindow, PreemptionWatcher

__all__ = [
    "AWS_DEFAULT_ENDPOINT",
    "AWS_MALFORMED_TRUSTED",
    "AWS_NOTICE_S",
    "AWS_TOKEN_TTL_S",
    "AZURE_DEFAULT_ENDPOINT",
    "AZURE_NOTICE_S",
    "DEFAULT_SIGNALS",
    "GCE_DEFAULT_HOST",
    "GCE_NOTICE_S",
    "MAX_ANSWER_BYTES",
    "SIGNAL_WINDOW",
    "AwsNoticeSource",
    "AzureNoticeSource",
    "Backoff",
    "GceNoticeSource",
    "Notice",
    "NoticeSource",
    "NoticeWindow",
    "PreemptionWatcher",
    "SignalHandler",
    "aws_metadata_endpoint",
    "azure_metadata_endpoint",
    "gce_metadata_url",
]
