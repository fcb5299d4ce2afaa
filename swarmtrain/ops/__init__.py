"""Operating a running node: a Prometheus metrics endpoint and a live web dashboard.

Start them with ``--http-port`` on ``swarmtrain coordinator``, ``peer`` or ``stage`` (or
``[ops] http_port``); see docs/operations.md.
"""

from swarmtrain.ops.http import HttpLimits, HttpServer, ThreadedHttpServer, parse_request_head
from swarmtrain.ops.metrics import CoordinatorCollector, PeerCollector, StageCollector
from swarmtrain.ops.serve import json_safe, routes_for, serve_coordinator, serve_peer, serve_stage

__all__ = ["CoordinatorCollector", "HttpLimits", "HttpServer", "PeerCollector", "StageCollector",
           "ThreadedHttpServer", "json_safe", "parse_request_head", "routes_for", "serve_coordinator",
           "serve_peer", "serve_stage"]
