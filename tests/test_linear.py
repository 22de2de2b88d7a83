"""Dense (fp32 / bf16) linear layers and every kernel they dispatch to, against plain PyTorch;
the dispatch plans and their calibration."""
import json

import pytest
import torch
from torch import nn

from loom.layers import dispatch
from loom.layers.dispatch import (DEFAULT_PLANS, candidates, choose, cpu_family, load_plan, panels_available,
                                  plan_from_times, plan_switches, planned_kernels)
from loom.layers.linear import DenseLinear, pack_columns, pack_pairs, unpack_columns, unpack_pairs, use_dense_linears

PANELS = panels_available()
NO_PANELS = "this CPU has neither AVX-512 BF16 nor AVX2 with FMA: Loom's panel kernels do not run here"
FORMAT = {torch.float32: "fp32", torch.bfloat16: "bf16"}
FORMAT_BOUNDS = [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]


def test_layouts_round_trip():
    # Output channels not a multiple of the 32-channel panel, an odd number of inputs.
    for n, k in ((5, 7), (32, 64), (70, 201)):
        w = torch.randn(n, k)
        assert torch.equal(unpack_columns(pack_columns(w), n, k), w)
        assert torch.equal(unpack_pairs(pack_pairs(w.bfloat16()), n, k), w.bfloat16())


# Row counts cover every register tiling of the panel kernel (AVX-512: 1-3 rows alternate
# accumulators, 40 rows are 4 tiles; AVX2: one row alternates accumulators, two take a panel
# whole, 3 to 6 in halves: 9 rows are tiles of 4 and 5, 40 of 5 and 6). 2048 inputs put rows of x
# 4 KB (bf16) and 8 KB (fp32) apart, which the AVX-512 kernel takes in tiles of at most 8 rows
# (40 rows: five tiles of 8).
@pytest.mark.parametrize("kernel, dtype, bound", [
    pytest.param(kernel, dtype, bound, marks=pytest.mark.skipif(kernel == "panel" and not PANELS, reason=NO_PANELS))
    for dtype, bound in FORMAT_BOUNDS for kernel in candidates(FORMAT[dtype], panels=True)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 9, 40])
@pytest.mark.parametrize("in_features, out_features", [(64, 96), (201, 70), (2048, 40)])
def test_every_kernel_matches_reference(kernel, dtype, bound, tokens, in_features, out_features):
    """Relative error (max abs / max |ref|) against fp64 arithmetic on the same inputs: fp32
    accumulates in fp32; bf16 weights multiply exactly and accumulate in fp32, then the output
    rounds to bf16 (relative 2^-9). Each kernel through the dispatching forward, with a plan that
    names it alone."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=True).to(dtype)
    layer = DenseLinear(linear, ((1, kernel),))
    x = torch.randn(tokens, in_features, dtype=dtype)
    ref = x.double() @ linear.weight.double().t() + linear.bias.double()
    out = layer(x)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    assert (out.double() - ref).abs().max() / ref.abs().max() < bound
    assert torch.equal(layer.unpacked_weight(), linear.weight)
    assert layer.packed == (kernel in ("panel", "amx"))


AMX = PANELS and dispatch.amx_tiles()
NO_AMX = "no AMX here (or the kernels were built without it): Loom's AMX kernel does not run"


@pytest.mark.skipif(not AMX, reason=NO_AMX)
@pytest.mark.parametrize("tokens", [1, 16, 17, 32, 33, 300, 600])
@pytest.mark.parametrize("in_features, out_features", [(768, 96), (201, 70), (2050, 33), (2050, 900)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_amx_tiles_match_reference(tokens, in_features, out_features, dtype):
    """Rows in tiles of 16 and blocks of 32, whole and partial; inputs in whole blocks of 32 (768)
    and with pairs after the last one (201: odd, padded; 2050); a partial last panel; x past half
    of a 2 MB L2 (600 x 2050), whose panels go to the threads in groups (900 outputs: 29 panels,
    the last group short). bf16 weights, activations in bf16 or fp32 (rounded to bf16 first), as
    the dense bf16 kernel takes them."""
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
    layer = DenseLinear(linear, ((1, "amx"),))
    x = torch.randn(tokens, in_features, dtype=dtype)
    ref = x.bfloat16().double() @ linear.weight.double().t()
    out = layer.amx(x)
    assert out.dtype == dtype and out.shape == (tokens, out_features)
    assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-2
    panel = layer.panel(x.bfloat16()).double()  # the same sums in another order, each rounded to bf16
    torch.testing.assert_close(out.bfloat16().double(), panel, rtol=2 ** -7, atol=1e-3 * ref.abs().max().item())


@pytest.mark.skipif(not AMX, reason=NO_AMX)
def test_amx_refuses_fp32_weights():
    layer = DenseLinear(nn.Linear(64, 32), ((1, "panel"),))
    with pytest.raises(RuntimeError, match="amx_linear: w must be bf16"):
        torch.ops.loom.amx_linear(torch.randn(4, 64), layer.weight, 32)


def test_swap_keeps_outputs_and_refuses_other_dtypes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(48, 40), nn.ReLU(), nn.Linear(40, 8, bias=False))
    x = torch.randn(3, 48)
    expected = model(x)
    use_dense_linears(model)
    assert isinstance(model[0], DenseLinear) and isinstance(model[2], DenseLinear)
    assert model[0].plan == load_plan("fp32")
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        DenseLinear(nn.Linear(8, 8).half())


def test_dense_dispatch_follows_the_plan(monkeypatch):
    layer = DenseLinear(nn.Linear(16, 8).to(torch.bfloat16), ((2, "gemm"), (8, "gemm_fp32")))
    used = []
    for kernel in ("gemm", "gemm_fp32"):
        monkeypatch.setattr(layer, kernel, lambda x, k=kernel: used.append(k) or torch.zeros(x.shape[0], 8,
                                                                                              dtype=x.dtype))
    for m in (1, 2, 3, 8, 9, 500):
        layer(torch.randn(m, 16, dtype=torch.bfloat16))
    assert used == ["gemm", "gemm", "gemm_fp32", "gemm_fp32", "gemm_fp32", "gemm_fp32"]
    assert [choose(((4, "a"), (16, "b")), m) for m in (1, 4, 5, 16, 17)] == ["a", "a", "b", "b", "b"]


def test_defaults_name_only_kernels_this_cpu_has():
    family = cpu_family()
    assert family in DEFAULT_PLANS and (family == "other") == (not PANELS)
    for fmt, plan in DEFAULT_PLANS[family].items():
        assert {kernel for _, kernel in plan} <= set(candidates(fmt, PANELS))
        assert [bound for bound, _ in plan] == sorted(bound for bound, _ in plan)


def test_plan_takes_the_fastest_and_holds_through_near_ties():
    tokens = [1, 2, 4, 8, 16]
    ms = {"a": [1.0, 2.0, 4.0, 8.0, 16.0],
          "b": [3.0, 2.04, 3.9, 3.0, 5.0],  # a within 5% at 2 and 4: a is kept there
          "c": [9.0, 9.0, 9.0, 2.9, 5.1]}   # c, once running, within 5% of b at 16: kept
    assert plan_from_times(tokens, ms) == ((4, "a"), (16, "c"))
    assert plan_from_times(tokens, ms, stickiness=0) == ((2, "a"), (4, "b"), (8, "c"), (16, "b"))


def test_model_plans_give_the_compiled_graphs_switch_points():
    model = nn.Sequential(DenseLinear(nn.Linear(8, 8), ((1, "gemm"),)),
                          DenseLinear(nn.Linear(8, 8).to(torch.bfloat16), ((8, "gemm"), (64, "gemm_fp32"))))
    assert planned_kernels(model, 4) == {"gemm"} and planned_kernels(model, 9) == {"gemm", "gemm_fp32"}
    assert plan_switches(model, 4) == set() and plan_switches(model, 256) == {9}


def test_calibration_checks_its_own_choice(tmp_path, monkeypatch):
    """On small layers, with the timing given (a figure per kernel and token count, nothing timed):
    every candidate and the dispatched layers are run at every count, the plan picks the fastest
    figure at each count, and the check compares the plan's pick with the fastest of the second
    pass. (Which kernel wins on a machine is a timing, reported by `loom calibrate --linears`.)"""
    monkeypatch.setenv("LOOM_CACHE", str(tmp_path))
    ran: list[set[str]] = []  # the names run by each call: counts 1, 4, then 1, 4 again, per format

    def given_ms(kernels: dict, repeats: int) -> dict[str, float]:
        first_count = len(ran) % 2 == 0
        ran.append(set(kernels))
        for fns in kernels.values():
            for fn in fns:
                fn()
        # The winner changes with the count: the first name at 1 token, the last at 4.
        return {name: float(rank + 1 if first_count else len(kernels) - rank)
                for rank, name in enumerate(sorted(kernels))}

    monkeypatch.setattr(dispatch, "_fastest_ms", given_ms)
    result = dispatch.calibrate(tokens=(1, 4), shapes=((64, 32), (32, 64)), copies=2, repeats=2,
                                formats=("bf16", "int8"))
    for fmt in ("bf16", "int8"):
        kernels = set(candidates(fmt, PANELS))
        assert set(result["ms"][fmt]) == kernels | {"dispatched"}
        assert all(len(times) == 2 for times in result["ms"][fmt].values())
        fastest = [min(kernels, key=lambda k: result["ms"][fmt][k][i]) for i in range(2)]
        assert [choose(tuple(map(tuple, result["plans"][fmt])), m) for m in (1, 4)] == fastest
        assert result["plans"][fmt][-1][0] == 4
        assert len(result["check"][fmt]) == 2
    assert ran == [set(candidates(fmt, PANELS)) | extra for fmt in ("bf16", "int8")
                   for extra in (set(), set(), {"forward"}, {"forward"})]
    dispatch.save_plans(result)
    assert load_plan("int8") == tuple(tuple(step) for step in result["plans"]["int8"])
    assert json.loads(dispatch.plan_path().read_text())["family"] == cpu_family()
    plans = json.loads(dispatch.plan_path().read_text())
    plans["plans"]["int8"] = [[4, "tiles"]]
    dispatch.plan_path().write_text(json.dumps(plans))
    with pytest.raises(ValueError, match=r"int8 plan names kernels this CPU does not run \(\['tiles'\]\)"):
        load_plan("int8")
    dispatch.plot_calibration(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


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
