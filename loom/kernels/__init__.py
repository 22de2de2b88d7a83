"""Loom's C++ CPU kernels, registered as torch operators (`torch.ops.loom.*`).

The C++ sources sit beside this file. Built once per machine by torch's cpp_extension (cached
on disk, rebuilt when a source changes) with -march=native. Being real operators, with
shape-only "fake" versions below, they run inside `torch.compile`d graphs as opaque calls, and
eager calls cost no Python.
  paged_decode_attention  decode attention over the paged KV pool (paged_attention.cpp)
  dense_linear            fp32 / bf16 linear layers over panel-layout weights (linear.cpp)
  int8_linear, int4_linear  weight-only matmuls over the same panels (linear.cpp)
  int8_dequantize, int4_dequantize  the same weights as a bf16 matrix, for large prefill chunks
  linear_vectorized       whether this build has those kernels' AVX-512 BF16 paths
"""
from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = ("paged_attention.cpp", "linear.cpp")
# A build takes a minute or two; a lock file older than this was left by a build that was killed,
# and torch's loader would wait for it forever.
STALE_LOCK_SECONDS = 15 * 60


@functools.cache
def load_kernels() -> None:
    """Builds or loads the kernels; afterwards `torch.ops.loom.<name>` exist."""
    from torch.utils.cpp_extension import _get_build_directory, load

    here = Path(__file__).parent
    remove_stale_lock(Path(_get_build_directory("loom_kernels", verbose=False)))
    try:
        load(name="loom_kernels", sources=[str(here / s) for s in SOURCES], is_python_module=False,
             extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"])
    except Exception as e:  # the message names the missing compiler or header
        raise RuntimeError(
            f"could not build Loom's C++ kernels ({e}); install a C++ compiler and ninja, "
            "or run with attention_backend='torch' and without quantization"
        ) from e
    _register_fakes()


def remove_stale_lock(build_dir: Path, max_age: float = STALE_LOCK_SECONDS) -> bool:
    """Removes the build lock in `build_dir` if it is older than `max_age` seconds; whether it did."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age:
        return False
    logger.warning("removing %s, left %.0f minutes ago by a build of Loom's kernels that did not finish", lock,
                   age / 60)
    lock.unlink(missing_ok=True)
    return True


def _register_fakes() -> None:
    @torch.library.register_fake("loom::paged_decode_attention")
    def _(q, key_cache, value_cache, block_tables, context_lens, scale):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("loom::int8_linear")
    def _(x, q, scale):
        return x.new_empty(x.shape[0], scale.shape[0])

    @torch.library.register_fake("loom::int4_linear")
    def _(x, q, scale, zero, group_size, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("loom::int8_dequantize")
    def _(q, scale, in_features):
        return q.new_empty(scale.shape[0], in_features, dtype=torch.bfloat16)

    @torch.library.register_fake("loom::int4_dequantize")
    def _(q, scale, zero, group_size, in_features, out_features):
        return q.new_empty(out_features, in_features, dtype=torch.bfloat16)

    @torch.library.register_fake("loom::dense_linear")
    def _(x, w, out_features):
        return x.new_empty(x.shape[0], out_features)
