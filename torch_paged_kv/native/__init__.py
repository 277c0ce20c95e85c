"""The package's one native library: C++ sources compiled on first use with the system compiler
and loaded with ctypes (`build.py`). Standard library only, below both `ops/` (the `cpu` backend's
kernels: `kernels.cpp` and its headers) and `distributed/` (the wire's copy and checksum:
`wire_copy.cpp`); each declares the functions it calls. See docs/cpu.md.
"""
