"""AWS spot notices through IMDSv2: the instance-action notice and the rebalance recommendation.

Every look fetches a token first if it has none (a PUT), then GETs ``spot/instance-action`` with
it: 404 means no notice, 401 means the token expired (a new one is fetched at once), 200 carries
the notice, whose ``time`` becomes the deadline. A 200 that is not a valid notice is retried like
any bad answer; when it keeps coming (`AWS_MALFORMED_TRUSTED` in a row) it counts as a notice.
The endpoint comes from ``AWS_EC2_METADATA_SERVICE_ENDPOINT``, else from the DMI data.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

from spotckpt.errors import MetadataAnswerError
from spotckpt.preemption.dmi import dmi_says
from spotckpt.preemption.source import Notice, fetch, log, snippet

AWS_DEFAULT_ENDPOINT = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600
AWS_NOTICE_S = 120.0
"""AWS's spot notice period: the deadline of a notice whose time is unreadable."""
AWS_MALFORMED_TRUSTED = 3
"""Malformed instance-action answers in a row (no 404 between) taken as a notice."""


def aws_metadata_endpoint() -> str | None:
    """The IMDS base URL to poll, or None when this is evidently not an EC2 machine."""
    explicit = os.environ.get("AWS_EC2_METADATA_SERVICE_ENDPOINT")
    if explicit:
        return explicit.rstrip("/")
    return AWS_DEFAULT_ENDPOINT if dmi_says("Amazon EC2", "Amazon") else None


class AwsNoticeSource:
    """The spot instance-action notice, polled every `poll_interval_s` (AWS gives two minutes).

    With `rebalance`, every look that finds no notice also asks for a rebalance recommendation
    (elevated risk, no deadline yet): the first one is logged and sets `rebalance_recommended`.
    """

    name = "AWS"
    window_s = AWS_NOTICE_S
    """The shortest notice this cloud gives (`PreemptionWatcher.window`)."""

    def __init__(
        self, endpoint: str, *, poll_interval_s: float, request_timeout_s: float, rebalance: bool
    ) -> None:
        self.endpoint = endpoint
        self.where = f"{endpoint}/latest/meta-data/spot/instance-action"
        self.poll_interval_s = poll_interval_s
        self.request_timeout_s = request_timeout_s
        self.rebalance = rebalance
        self.rebalance_recommended = False
        self._token: str | None = None
        self._malformed: tuple[float, int] | None = None  # (first seen, count)

    @property
    def hint(self) -> str | None:
        """``aws:rebalance`` once a rebalance recommendation was seen (`PreemptionWatcher.hint`)."""
        return "aws:rebalance" if self.rebalance_recommended else None

    def poll_once(self) -> Notice | float:
        """One look at the instance-action notice: the notice, or the pause before the next."""
        fresh = self._token is None
        token = self._token = self._token or self._fetch_token()
        status, body, _ = fetch(
            self.where,
            headers={"X-aws-ec2-metadata-token": token},
            timeout_s=self.request_timeout_s,
        )
        if status == 401:
            self._token = None
            if fresh:
                raise MetadataAnswerError("HTTP 401 with a fresh token")
            return 0.0  # the token expired: fetch a new one at once
        if status == 404:
            self._malformed = None
            if self.rebalance:
                self._check_rebalance(token)
            return self.poll_interval_s
        if status != 200:
            raise MetadataAnswerError(f"HTTP {status}", snippet(body))
        return self._notice(body)

    def _fetch_token(self) -> str:
        status, body, _ = fetch(
            f"{self.endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
            timeout_s=self.request_timeout_s,
        )
        token = body.decode("ascii", errors="replace").strip()
        if status != 200 or not token.isprintable() or " " in token or not token:
            raise MetadataAnswerError(f"IMDSv2 token request answered HTTP {status}", snippet(body))
        return token

    def _notice(self, body: bytes) -> Notice:
        """The notice in a 200 answer; a malformed one counts only when it keeps coming."""
        notice = _parse_notice(body)
        if notice is not None:
            action, seconds_left = notice
            return Notice(f"aws:{action}", time.monotonic() + seconds_left)
        now = time.monotonic()
        first, count = self._malformed or (now, 0)
        self._malformed = (first, count + 1)
        if count + 1 < AWS_MALFORMED_TRUSTED:
            raise MetadataAnswerError("malformed instance-action notice", snippet(body))
        log.warning(
            "AWS answered %d malformed instance-action notices in a row; taking them "
            "as a termination notice",
            count + 1,
        )
        return Notice("aws:terminate", first + AWS_NOTICE_S)

    def _check_rebalance(self, token: str) -> None:
        status, _, _ = fetch(
            f"{self.endpoint}/latest/meta-data/events/recommendations/rebalance",
            headers={"X-aws-ec2-metadata-token": token},
            timeout_s=self.request_timeout_s,
        )
        if status == 200 and not self.rebalance_recommended:
            self.rebalance_recommended = True
            log.warning("AWS rebalance recommendation: this spot instance is at elevated risk")


def _parse_notice(body: bytes) -> tuple[str, float] | None:
    """(action, seconds left) of an instance-action notice, or None when it is malformed."""
    try:
        notice = json.loads(body)
    except ValueError:
        return None
    if not isinstance(notice, dict) or not isinstance(notice.get("action"), str):
        return None
    action = str(notice["action"])
    try:
        when = datetime.fromisoformat(str(notice["time"]).replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        seconds_left = (when - datetime.now(timezone.utc)).total_seconds()
    except (KeyError, ValueError):
        return action, AWS_NOTICE_S
    return action, max(0.0, seconds_left)
