"""Operating a running node: a Prometheus metrics endpoint and a live web dashboard.

Start them with ``--http-port`` on ``swarmtrain coordinator``, ``peer`` or ``stage`` (or
``[ops] http_port``); see docs/operations.md.
"""

from swarmtrain.app.ops.http import HttpLimits, HttpServer, ThreadedHttpServer, parse_request_head
from swarmtrain.app.ops.metrics import CoordinatorCollector, PeerCollector, StageCollector
from swarmtrain.app.ops.serve import routes_for, serve_coordinator, serve_peer, serve_stage
from swarmtrain.app.runlog import json_safe

__all__ = ["CoordinatorCollector", "HttpLimits", "HttpServer", "PeerCollector", "StageCollector",
           "ThreadedHttpServer", "json_safe", "parse_request_head", "routes_for", "serve_coordinator",
           "serve_peer", "serve_stage"]
