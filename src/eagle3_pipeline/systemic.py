"""Systemic failures: when most records of a job fail for one reason, the job stops and names the fix.

Per-record stages (ingest, tokenize, regenerate) count a bad record and go on. That is right for a few
bad records and wrong when the cause is the setup (a target without a chat template drops every record):
counting 2,000 drops and writing an empty shard only moves the failure to a later, costlier stage.
"""

from __future__ import annotations

from collections.abc import Mapping

from eagle3_pipeline.logs import ClearError

MIN_FAILURES = 5  # fewer failures than this are never "systemic": small shards stay tolerant
MAJORITY = 0.5


class SystemicFailure(ClearError):
    """Most records of a job failed the same way (or none survived)."""


def check(stage: str, where: str, total: int, kept: int, failures: Mapping[str, int],
          fixes: Mapping[str, str], default_fix: str, example: str | None = None) -> None:
    """Raise SystemicFailure when `kept == 0 < total`, or one reason holds most of `total` (and >= MIN_FAILURES)."""
    failures = {reason: count for reason, count in failures.items() if count}
    if total == 0 or not failures:
        if total and not kept:
            raise SystemicFailure(f"{stage} {where}: none of {total} records survived")
        return
    reason, count = max(failures.items(), key=lambda item: item[1])
    if kept and (count < MIN_FAILURES or count <= MAJORITY * total):
        return
    detail = f" (e.g. {example})" if example else ""
    raise SystemicFailure(f"{stage} {where}: {count} of {total} records failed with {reason}{detail}; "
                          f"{'nothing is left' if not kept else 'this is not a few bad records'}. "
                          f"Fix: {fixes.get(reason, default_fix)}")
