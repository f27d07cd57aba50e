"""The worker side of a route: one stage serving a layer range (``python -m dgr.worker``).

- ``dgr.worker.sessions``: the session/epoch table (the authority on every cache slot).
- ``dgr.worker.slots``: sessions' slots outside their steps (release and keep as a prefix
  entry, adopt, fork, the prefix store's figures).
- ``dgr.worker.step``: ``Step``, one admitted step (its frame, lease and results).
- ``dgr.worker.pipeline``: the step pipeline (admit, compute, finish, reply), one for the gRPC
  ``Step`` stream and the data plane; it owns the engine, the session table, the slots and
  the scheduler.
- ``dgr.worker.forwarder``: where a data-plane step's frames go (return connections, relay to the
  next stage, the decode loop).
- ``dgr.worker.scheduler``: the stage's scheduler, which forms batches of ready steps
  (``StageLoop``, the decode ring's groups).
- ``dgr.worker.frames``: the data plane's frame codec and I/O (C++ or Python).
- ``dgr.worker.speculation``, ``dgr.worker.grammar``, ``dgr.worker.history``: the last stage's
  drafts and their verification, grammar masks, and the token history penalties read.
- ``dgr.worker.profile``: where a stage's time goes (its Prometheus parts).
- ``dgr.worker.trust``: whom relayed frames may make this worker connect to.
- ``dgr.worker.worker``: ``Worker``, the stage: it owns the pipeline and feeds it from both
  planes; describe, drain.
- ``dgr.worker.process``: workers in a thread of this process or as child processes.
- ``dgr.worker.main``: the command line of ``python -m dgr.worker``.
"""

from dgr.worker.process import LocalCluster, ThreadedWorker, WorkerProcess
from dgr.worker.worker import Worker

__all__ = ["Worker", "ThreadedWorker", "WorkerProcess", "LocalCluster"]
