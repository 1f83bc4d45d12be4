"""The driver side of a chain: ``StageClient`` is one lane to a first stage."""

from skippy.driver.client import PrefillResult, StageClient, StageClientError, StageLost

__all__ = ["PrefillResult", "StageClient", "StageClientError", "StageLost"]
