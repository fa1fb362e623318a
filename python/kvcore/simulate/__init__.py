"""``kvcore simulate``: replay a serving workload through a KV-cache manager.

Modules: :mod:`~kvcore.simulate.workload` (requests and the synthetic chat mix),
:mod:`~kvcore.simulate.trace` (the JSONL trace format), :mod:`~kvcore.simulate.backends`
(kvcore and the reference behind one adapter), :mod:`~kvcore.simulate.scheduler` (the
continuous-batching loop), :mod:`~kvcore.simulate.report` (summary and table),
:mod:`~kvcore.simulate.plot` and :mod:`~kvcore.simulate.progress`.
"""
