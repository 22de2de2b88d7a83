"""`loom bench`: measurements that write JSON and a PNG under docs/benchmarks/."""
