"""The driver side of a route: runs sessions across a route's stages (no compiled core needed).

- ``dgr.driver.route``: the public names (``Route``/``AsyncRoute`` and their sessions,
  ``check_route``, ``retryable``); it says which module holds which job.
- ``dgr.driver.provider``: where stages come from (``RouteProvider``, ``StaticPool``).
"""

from dgr.driver.provider import RouteProvider, StaticPool
from dgr.driver.route import (
                              AsyncRoute,
                              AsyncRouteSession,
                              Generation,
                              Route,
                              RouteConfig,
                              RouteSession,
                              StageStats,
)

__all__ = ["Route", "RouteSession", "RouteConfig", "AsyncRoute", "AsyncRouteSession",
           "Generation", "StageStats", "RouteProvider", "StaticPool"]
