"""The inference job's stages, shared by the CPU and the GPU: everything but the device stage is
the same code on both.

- :mod:`~pipelines.inference.source`: the images read, verified and decoded ahead of the net;
- :mod:`~pipelines.inference.device`: the net on the CPU or the GPU, masks and confidences out
  (:mod:`~pipelines.inference.placement`: which device, how many at once, what precision);
- :mod:`~pipelines.inference.finish`: each mask made objects (touching ones cut apart,
  :mod:`pipelines.instances`), measured, encoded and written;
- :mod:`~pipelines.inference.durable`: masks made durable together before the ledger records
  them;
- :mod:`~pipelines.inference.pool` and :mod:`~pipelines.inference.slabs`: the worker processes
  that run the source and finish stages, as many as the job has CPUs, and the shared memory
  they hand images over in;
- :mod:`~pipelines.inference.stages`: the main process steering them all;
- :mod:`~pipelines.inference.slides`: images too large to decode whole, window by window.
"""
