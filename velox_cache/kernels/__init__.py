"""Kernels: attention on MLX's CPU backend and the routing that puts a model on it.

Velox's blocked attention kernel (``kernel``, ``attend``), the exact reference
arithmetic (``attention``), masks, RoPE re-rotation (``rope``), stand-ins for
mlx-lm's elementwise ops (``elementwise``), the native C++ primitives
(``native/``, checked against the pure ops by ``native_check``) and
``observe`` / ``fast_attention``, which route a model's attention onto them.

Layer: the bottom. Imports nothing else from velox_cache.
"""
