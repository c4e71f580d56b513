"""C++ sources of the ``cpu`` backend's fused kernels; built and loaded by
:mod:`model_shards.backends.cpu_build`, called through :mod:`model_shards.backends.cpu`."""
