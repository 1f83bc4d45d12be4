"""The OpenAI-compatible HTTP API in front of a chain: app, lane pool, metrics, server."""

from skippy.api.app import ChainService, create_app
from skippy.api.errors import ApiError
from skippy.api.lanes import LanePool, StageInfo
from skippy.api.server import serve_api

__all__ = ["ApiError", "ChainService", "LanePool", "StageInfo", "create_app", "serve_api"]
