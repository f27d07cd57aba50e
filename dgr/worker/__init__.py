"""The worker side of a route: one stage serving a layer range (``python -m dgr.worker``).

- ``dgr.worker.sessions``: the session/epoch table (the authority on every cache slot).
- ``dgr.worker.stage``: ``Worker``, the stage: the step pipeline behind the gRPC ``Step`` stream
  and the data plane, relay forwarding, describe.
- ``dgr.worker.process``: workers in a thread of this process or as child processes.
- ``dgr.worker.main``: the command line of ``python -m dgr.worker``.
"""

from dgr.worker.process import LocalCluster, ThreadedWorker, WorkerProcess
from dgr.worker.stage import Worker

__all__ = ["Worker", "ThreadedWorker", "WorkerProcess", "LocalCluster"]
