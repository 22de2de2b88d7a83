"""Where Loom's measurements (the benchmarks, and the linear layers' kernel calibration) read the
time: `clock.now()`, seconds from an arbitrary origin.

One function, so that a test checking a measurement's bookkeeping replaces it with a counter and
the figures it checks are fixed rather than measured (tests never time anything)."""
from time import perf_counter as now

__all__ = ["now"]
