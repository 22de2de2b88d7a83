"""Where Loom's measurements (the benchmarks, and the linear layers' kernel calibration) read the
time: `clock.now()`, seconds from an arbitrary origin.

One function, so that a test checking a measurement's bookkeeping replaces it with a counter and
the figures it checks are fixed rather than measured (tests never time anything)."""
from time import perf_counter

now = perf_counter


def is_machine_clock() -> bool:
    """Whether `now` reads the machine's clock. Where a test has replaced it with a counter, the
    timing kept outside Python (the C++ decode step's) counts the same way."""
    return now is perf_counter


__all__ = ["now", "is_machine_clock"]
