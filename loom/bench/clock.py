"""Where Loom's measurements (the benchmarks, and the linear layers' kernel calibration) read the
time: `clock.now()`, seconds from an arbitrary origin.

One function, so that the test suite can refuse it: no test reads the time. A test of a
measurement's bookkeeping gives the measurement its durations, or replaces this with a counter so
that the figures it checks are fixed rather than measured."""
from time import perf_counter as now

__all__ = ["now"]
