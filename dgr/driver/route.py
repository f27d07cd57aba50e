"""The route driver's public names, in one place: ``Route`` / ``RouteSession`` (blocking) over
``AsyncRoute`` / ``AsyncRouteSession`` (asyncio), the route check and the retry classification.

Where each job lives:

- ``dgr.driver.checks``: whether described stages form one route (``check_route``).
- ``dgr.driver.config``: ``RouteConfig``, every route setting in one typed table.
- ``dgr.driver.async_route``: ``AsyncRoute``, the stages and clients of a route.
- ``dgr.driver.session``: ``AsyncRouteSession``, history and epoch, recovery around the path.
- ``dgr.driver.paths``: the step interface and its paths (hop by hop, relay, decode loop).
- ``dgr.driver.headers``: every ``wire.Forward`` the driver sends.
- ``dgr.driver.recovery``: what is retried (``retryable``), stage replacement, re-prefill.
- ``dgr.driver.deadlines``, ``dgr.driver.links``, ``dgr.driver.tokenizers``: step
  deadlines, the data links of direct relay, where a route tokenizes.
- ``dgr.driver.sync``: the blocking wrappers.
"""

from __future__ import annotations

from dgr.driver.async_route import AsyncRoute
from dgr.driver.checks import check_route
from dgr.driver.config import RouteConfig
from dgr.driver.provider import parse_endpoints
from dgr.driver.recovery import retryable
from dgr.driver.results import Generation, StageStats
from dgr.driver.session import AsyncRouteSession
from dgr.driver.sync import Route, RouteSession

__all__ = ["AsyncRoute", "AsyncRouteSession", "Route", "RouteSession", "RouteConfig",
           "Generation", "StageStats", "check_route", "parse_endpoints", "retryable"]
