"""The built-in clouds' notice sources, and which of them this machine needs: the one place
that changes when a cloud is added (the watcher does not)."""

from __future__ import annotations

from collections.abc import Callable

from spotckpt.preemption.aws import AWS_DEFAULT_ENDPOINT, AwsNoticeSource, aws_metadata_endpoint
from spotckpt.preemption.azure import (
    AZURE_DEFAULT_ENDPOINT,
    AzureNoticeSource,
    azure_metadata_endpoint,
)
from spotckpt.preemption.gce import GCE_DEFAULT_URL, GceNoticeSource, gce_metadata_url
from spotckpt.preemption.source import NoticeSource


def cloud_sources(
    *,
    aws: bool | None,
    gce: bool | None,
    aws_rebalance: bool,
    azure: bool | None = None,
    poll_interval_s: float,
    request_timeout_s: float,
) -> list[NoticeSource]:
    """The sources to poll: a cloud's when it is switched on (True) or found (None: its
    endpoint variable, else the machine's DMI data); False switches it off."""
    sources: list[NoticeSource] = []
    aws_endpoint = _endpoint(aws, aws_metadata_endpoint, AWS_DEFAULT_ENDPOINT)
    if aws_endpoint:
        sources.append(
            AwsNoticeSource(
                aws_endpoint,
                poll_interval_s=poll_interval_s,
                request_timeout_s=request_timeout_s,
                rebalance=aws_rebalance,
            )
        )
    gce_url = _endpoint(gce, gce_metadata_url, GCE_DEFAULT_URL)
    if gce_url:
        sources.append(
            GceNoticeSource(
                gce_url, poll_interval_s=poll_interval_s, request_timeout_s=request_timeout_s
            )
        )
    azure_endpoint = _endpoint(azure, azure_metadata_endpoint, AZURE_DEFAULT_ENDPOINT)
    if azure_endpoint:
        sources.append(
            AzureNoticeSource(
                azure_endpoint,
                poll_interval_s=poll_interval_s,
                request_timeout_s=request_timeout_s,
            )
        )
    return sources


def _endpoint(enabled: bool | None, found: Callable[[], str | None], default: str) -> str | None:
    """A cloud's endpoint: none when off, else the one found, else (when on) its default."""
    if enabled is False:
        return None
    endpoint = found()
    return default if endpoint is None and enabled else endpoint
