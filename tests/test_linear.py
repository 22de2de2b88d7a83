"""Dense (fp32 / bf16) linear layers over panel-layout weights, against plain PyTorch."""
import pytest
import torch
from torch import nn

from loom.layers.linear import (DenseLinear, pack_columns, pack_pairs, panel_kernels_available, unpack_columns,
                                unpack_pairs, use_panel_linears)

pytestmark = pytest.mark.skipif(not panel_kernels_available(torch.device("cpu")),
                                reason="this CPU has no AVX-512 BF16: the engine keeps torch's linear layers")


def test_layouts_round_trip():
    # Output channels not a multiple of the 32-channel panel, an odd number of inputs.
    for n, k in ((5, 7), (32, 64), (70, 201)):
        w = torch.randn(n, k)
        assert torch.equal(unpack_columns(pack_columns(w), n, k), w)
        assert torch.equal(unpack_pairs(pack_pairs(w.bfloat16()), n, k), w.bfloat16())


# Row counts cover every register tiling: 1-3 rows alternate accumulators, 40 rows are 4 tiles.
@pytest.mark.parametrize("dtype, bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 9, 40])
@pytest.mark.parametrize("in_features, out_features", [(64, 96), (201, 70)])
def test_dense_linear_matches_reference(dtype, bound, tokens, in_features, out_features):
    """Relative error (max abs / max |ref|) against fp64 arithmetic on the same inputs: fp32
    accumulates in fp32; bf16 multiplies exactly and accumulates in fp32, then rounds its output
    to bf16 (relative 2^-9)."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=True).to(dtype)
    layer = DenseLinear(linear)
    x = torch.randn(tokens, in_features, dtype=dtype)
    ref = x.double() @ linear.weight.double().t() + linear.bias.double()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    assert (out.double() - ref).abs().max() / ref.abs().max() < bound
    assert torch.equal(layer.unpacked_weight(), linear.weight)


def test_swap_keeps_outputs_and_refuses_other_dtypes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(3, 48)
    expected = model(x)
    use_panel_linears(model)
    assert isinstance(model[0], DenseLinear) and isinstance(model[2], DenseLinear)
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        DenseLinear(nn.Linear(8, 8).half())


def test_a_killed_build_s_lock_is_removed_and_builds_take_turns(tmp_path):
    """torch's extension loader waits forever on the lock file a killed build leaves behind; under
    Loom's build lock such a file is removed however recent, and a second builder waits its turn."""
    import fcntl
    import subprocess
    import sys

    from loom.kernels import exclusive_build

    lock = tmp_path / "lock"
    lock.touch()  # a build killed a moment ago
    with exclusive_build(tmp_path):
        assert not lock.exists()
        probe = "import fcntl, sys; fcntl.flock(open(sys.argv[1], 'w'), fcntl.LOCK_EX | fcntl.LOCK_NB)"
        held = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "loom.flock")], capture_output=True)
        assert held.returncode != 0 and b"BlockingIOError" in held.stderr, held.stderr
    with open(tmp_path / "loom.flock", "w") as f:  # released on leaving
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
