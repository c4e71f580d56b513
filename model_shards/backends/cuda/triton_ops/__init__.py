"""Triton kernels of the ``cuda`` backend, one module per op family.

Each module's wrapper takes the arguments of the matching
:class:`model_shards.backends.base.Backend` method. Importing needs ``triton``
(it ships with every CUDA build of torch); on CPU the tests run the kernels in
Triton's interpreter (``TRITON_INTERPRET=1``) against the reference backend.
"""
