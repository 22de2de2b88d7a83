"""Loom's C++ CPU kernels, registered as torch operators (`torch.ops.loom.*`).

The C++ sources sit beside this file. Built once per machine by torch's cpp_extension (cached
on disk, rebuilt when a source changes) with -march=native. Each source includes the ATen
headers of the ops it calls rather than ATen/ATen.h or torch/extension.h, whose parsing was
most of the build (45 s on two cores instead of 63). Being real operators, with
shape-only "fake" versions below, they run inside `torch.compile`d graphs as opaque calls, and
eager calls cost no Python.
  paged_decode_attention, paged_prefill_attention  attention over the paged KV pool
                          (paged_attention.cpp)
  paged_decode_attention_scored, attention_row_scores, gumbel_noise  the scores of KV
                          policies (H2O, Keyformer), from the same kernels
  write_kv, quantize_kv, move_head_slots  stores into the pool (an int8 pool's rows quantized
                          first) and moves within it
  dense_linear            fp32 / bf16 linear layers over panel-layout weights (linear.cpp)
  amx_linear, amx_tiles   the bf16 ones through AMX tiles, for many rows (CPUs with AMX)
  int8_linear, int4_linear  weight-only matmuls over the same panels (linear.cpp)
  int8_dequantize, int4_dequantize  the same weights as a bf16 matrix, for large prefill chunks
  linear_isa              which vector path those kernels were built with (AVX-512 BF16, AVX2)
  rms_norm, rotary, silu_and_mul  the elementwise layers of eager steps, rounded as the
                          compiled decode graphs round them (elementwise.cpp)
  DecodeStep              a Llama-family model's whole decode step in one call, over the
                          kernels above (a Python class of the module `load_kernels` returns;
                          decode_step.cpp)
  shm_open_group, shm_all_reduce, shm_reduce_scatter, shm_all_gather, shm_all_to_all  the
                          collectives between the processes of one machine, through shared
                          memory (shm_all_reduce.cpp), for parallel ranks; the all-to-all
                          also in two halves (shm_all_to_all_start / _wait), to overlap it
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import logging
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCES = ("paged_attention.cpp", "linear.cpp", "elementwise.cpp", "decode_step.cpp", "shm_all_reduce.cpp")


@functools.cache
def load_kernels() -> ModuleType:
    """Builds or loads the kernels; afterwards `torch.ops.loom.<name>` exist. Returns the
    library's Python module (its classes)."""
    from torch.utils.cpp_extension import _get_build_directory, load

    here = Path(__file__).parent
    with exclusive_build(Path(_get_build_directory("loom_kernels", verbose=False))):
        try:
            module = load(name="loom_kernels", sources=[str(here / s) for s in SOURCES], is_python_module=True,
                          extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"])
        except Exception as e:  # the message names the missing compiler or header
            raise RuntimeError(
                f"could not build Loom's C++ kernels ({e}); install a C++ compiler and ninja, "
                "or run with attention_backend='torch' and without quantization"
            ) from e
    _register_fakes()
    return module


@contextlib.contextmanager
def exclusive_build(build_dir: Path) -> Iterator[None]:
    """Makes the caller the only process building or loading the kernels in `build_dir`.

    torch's loader guards a build with a plain `lock` file and waits for it to vanish, forever if
    the build was killed. Loom's processes first take an flock, which the OS releases when its
    holder dies; so under it, a `lock` file can only be a dead build's, and is removed.
    """
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "loom.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # waits while another process builds
        leftover = build_dir / "lock"
        if leftover.exists():
            logger.warning("removing %s, left by a build of Loom's kernels that did not finish", leftover)
            leftover.unlink(missing_ok=True)
        yield


def _register_fakes() -> None:
    @torch.library.register_fake("loom::shm_all_reduce")
    def _(x, group):
        return torch.empty_like(x)

    @torch.library.register_fake("loom::shm_all_gather")
    def _(x, group, world):
        return x.new_empty(world, *x.shape)

    @torch.library.register_fake("loom::shm_all_to_all")
    def _(x, group):
        return torch.empty_like(x)

    @torch.library.register_fake("loom::shm_all_to_all_start")
    def _(x, group):
        return x.new_empty((), dtype=torch.long)

    @torch.library.register_fake("loom::shm_all_to_all_wait")
    def _(ticket, x, group, after):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("loom::shm_reduce_scatter")
    def _(x, group):
        return x.new_empty(x.shape[1:])

    @torch.library.register_fake("loom::paged_decode_attention")
    def _(q, key_cache, value_cache, block_tables, context_lens, scale, key_scales=None, value_scales=None):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("loom::paged_decode_attention_scored")
    def _(q, key_cache, value_cache, block_tables, context_lens, scale, score_rows, score_temps, row_keys, newest,
          layer, key_scales=None, value_scales=None):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("loom::attention_row_scores")
    def _(logits, num_kv_heads, visible, score_temps, row_keys, layer):
        return logits.new_empty(num_kv_heads, logits.shape[2])

    @torch.library.register_fake("loom::paged_prefill_attention")
    def _(q, key_cache, value_cache, block_ids, context_len, key_positions, scale, query_positions=None,
          key_scales=None, value_scales=None):
        return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)

    @torch.library.register_fake("loom::quantize_kv")
    def _(x):
        return x.new_empty(x.shape, dtype=torch.int8), x.new_empty(*x.shape[:2], 1, dtype=torch.float32)

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

    @torch.library.register_fake("loom::rms_norm")
    def _(x, weight, eps):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    @torch.library.register_fake("loom::rotary")
    def _(positions, q, k, cos, sin, rotary_dim):
        return (torch.empty_like(q, memory_format=torch.contiguous_format),
                torch.empty_like(k, memory_format=torch.contiguous_format))

    @torch.library.register_fake("loom::silu_and_mul")
    def _(gate_up):
        return gate_up.new_empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    @torch.library.register_fake("loom::dense_linear")
    def _(x, w, out_features):
        return x.new_empty(x.shape[0], out_features)

    @torch.library.register_fake("loom::amx_linear")
    def _(x, w, out_features):
        return x.new_empty(x.shape[0], out_features)
