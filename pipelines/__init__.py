"""The jobs' side of watchd: one module per pipeline, each run as ``python -m pipelines.<name>
JOB_DIR`` (:mod:`pipelines.job`).

A job started so imports its modules (torch, numpy, scipy, the pipelines) with Python's cyclic
garbage collector off: ``sys.argv[0]`` is ``"-m"`` while the module named is being located,
which is when this package is imported. What an import makes lives as long as the job, and the
collector, run every few hundred new objects, went over all of it again and again, and once
more as the interpreter ended. :func:`pipelines.job.run_job` freezes what was imported
(``gc.freeze``: never looked at by the collector again, at the job's end neither) and turns
the collector back on. On the development machine a job's imports took ~0.5 s less and its
exit 0.6–1.1 s less (docs/benchmarks.md). Imported any other way (tests, benchmarks), nothing
changes. So every module of this package run with ``-m`` is a job that calls ``run_job`` (or
:func:`pipelines.job.settle_collector` itself): else it runs without the collector.
"""

import gc
import sys

if sys.argv[:1] == ["-m"]:  # python -m pipelines.<name>: a job starting
    gc.disable()
