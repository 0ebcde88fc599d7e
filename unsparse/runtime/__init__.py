"""Running sparse models: backends, sparse modules, timing, the comparator and its plans."""

from unsparse.runtime.backends import available_backends, backend_names, get_backend
from unsparse.runtime.modules import SparseConv, set_backend, sparse_layers, sparsify
from unsparse.runtime.plan import Plan, use_plan

__all__ = ["Plan", "SparseConv", "available_backends", "backend_names", "get_backend", "set_backend",
           "sparse_layers", "sparsify", "use_plan"]
