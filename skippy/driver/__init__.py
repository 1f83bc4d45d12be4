"""The driver side of a chain: ``StageClient`` is one lane to a first stage; ``Generator`` runs requests on it."""

from skippy.driver.client import PrefillResult, StageClient, StageClientError, StageLost, StageRemoteError
from skippy.driver.generator import (
    Completion,
    ContextOverflow,
    Generation,
    GenerationRequest,
    Generator,
    Timing,
)

__all__ = [
    "Completion", "ContextOverflow", "Generation", "GenerationRequest", "Generator", "PrefillResult",
    "StageClient", "StageClientError", "StageLost", "StageRemoteError", "Timing",
]
