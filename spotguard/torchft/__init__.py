"""The torchft replica-group engine in one folder (docs/torchft.md).

- ``engine.py`` — ``ReplicaGuard``: a notice marks this replica group as leaving, torchft's own step agrees
  who leaves, the leavers stop after the step commits, the others go on (on top of ``spotguard.hook.Hook``).
- ``refusal.py`` — loops the leave vote cannot ride on (torchft's LocalSGD/DiLoCo, a ``should_commit()``
  without ``vote()``), refused at install or at the first step with ``UnsupportedLoop``.
- ``worker.py`` — one complete replica-group worker (``python -m spotguard.torchft.worker``): a small
  deterministic model trained with torchft and a ``ReplicaGuard``, printing JSON lines.
- ``launch.py`` — the lighthouse and groups with their own daemons on one machine, shared by the tests,
  ``benchmarks/bench_torchft.py`` and ``spotguard demo --engine torchft``.

Nothing is imported here: ``engine`` needs torch and torchft, the others import them only when run.
"""
