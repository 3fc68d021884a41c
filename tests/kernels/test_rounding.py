"""kernels/rounding: float32 into float16/bfloat16 weights, stochastically, on both backends.

Each result must be one of the two neighbours of the float32 value in the narrow type (found
here from float64 and the type's bit patterns), chosen away from zero with probability equal
to the value's fraction of the gap, so that the mean over many draws is the value itself
(unbiased, where rounding to nearest is not); the two backends give the same bits.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from embcache.kernels.rounding import rounding_key, stochastic_round
from embcache.ops.update.spec import stochastic_round_ref, uniform_ref

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]


def neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(toward zero, away from zero)`` neighbours of each ``x`` in ``dtype``: among
    the nearest value's bit pattern and the two next to it, the largest not above ``|x|`` and
    the smallest not below it (with ``x``'s sign)."""
    near = x.to(dtype).view(torch.int16).to(torch.int32)
    candidates = torch.stack([near - 1, near, near + 1], dim=-1).to(torch.int16)
    values = candidates.view(dtype).double().abs()  # [..., 3]
    mag = x.double().abs().unsqueeze(-1)
    inf = torch.tensor(math.inf, dtype=torch.float64)
    lo = torch.where(values <= mag, values, -inf).amax(-1)
    hi = torch.where(values >= mag, values, inf).amin(-1)
    sign = torch.where(x < 0, -1.0, 1.0).double()
    return sign * lo, sign * hi


def wide_values(seed: int, n: int = 64, dim: int = 19) -> torch.Tensor:
    """float32 ``[n, dim]`` over many magnitudes (fp16 subnormals to 6e4), both signs, with
    zeros and exactly representable values among them."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.logspace(-7, 4.5, dim, dtype=torch.float64).float()
    x = torch.randn(n, dim, generator=gen) * scale
    x[0, :4] = torch.tensor([0.0, -0.0, 1.0, -0.5])
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stochastic_round_picks_a_neighbour_and_backends_agree(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    x = wide_values(1)
    ids = torch.randint(0, 2**62, (x.shape[0],), generator=torch.Generator().manual_seed(2))
    key = rounding_key(7, 3)
    got = stochastic_round(x.to(device), dtype, ids.to(device), key).cpu()
    assert got.dtype == dtype
    lo, hi = neighbours(x, dtype)
    value = got.double()
    assert bool(((value == lo) | (value == hi)).all()), "not a neighbour of the float32 value"
    exact = x.double() == x.to(dtype).double()
    assert torch.equal(value[exact], x.double()[exact]), "a representable value changed"
    twin = stochastic_round_ref(x, dtype, uniform_ref(ids, x.shape[1], key))
    assert torch.equal(got.view(torch.int16), twin.view(torch.int16)), "backends differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_stochastic_round_is_unbiased_where_nearest_is_not(
    backend: str, device: torch.device, dtype: torch.dtype
) -> None:
    """Each value, rounded in 16,384 rows (independent draws), averages to itself within five
    standard errors, and rounds up with probability equal to its fraction of the gap; rounding
    to nearest is off by the whole fraction."""
    n = 16384
    base = torch.tensor([1.0 + 1e-3, -3e-3, 0.3337, 7.1e-6, 1e-7, 1234.567, -2.5e-5])
    x = base.repeat(n, 1)
    ids = torch.arange(n, dtype=torch.int64) * 7919 + 11
    key = rounding_key(0, 1)
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter runs each program in Python: the kernel rounds every 64th row, whose
        # bits must be the twin's, and the statistics are those of the twin's rows (a row's
        # draws are a function of its id, key and column alone). Compiled, it rounds them all.
        every = torch.arange(0, n, 64)
        some = stochastic_round(x[every].to(device), dtype, ids[every].to(device), key).cpu()
        got = stochastic_round_ref(x, dtype, uniform_ref(ids, x.shape[1], key))
        assert torch.equal(some.view(torch.int16), got[every].view(torch.int16)), "backends differ"
    else:
        got = stochastic_round(x.to(device), dtype, ids.to(device), key).cpu()
    lo, hi = neighbours(base, dtype)
    gap = (hi - lo).abs()
    fraction = (base.double() - lo).abs() / gap
    mean = got.double().mean(0)
    sigma = gap * torch.sqrt(fraction * (1 - fraction) / n)
    assert bool(((mean - base.double()).abs() <= 5 * sigma + 1e-12).all()), (
        f"biased: mean {mean.tolist()} vs {base.double().tolist()}"
    )
    up = (got.double() == hi).double().mean(0)
    assert bool(((up - fraction).abs() <= 5 * torch.sqrt(fraction * (1 - fraction) / n)).all())
    nearest_error = (base.to(dtype).double() - base.double()).abs()
    assert bool((nearest_error > 20 * sigma).any()), "the values should defeat nearest rounding"


def test_stochastic_round_bad_input() -> None:
    x, ids = torch.zeros(2, 3), torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="16-bit"):
        stochastic_round(x, torch.float32, ids, 0)
    with pytest.raises(TypeError, match="x must be float32"):
        stochastic_round(x.double(), torch.float16, ids, 0)
    with pytest.raises(ValueError, match="ids has 1 entries"):
        stochastic_round(x, torch.float16, ids[:1], 0)
    with pytest.raises(ValueError, match="key must be 32-bit"):
        stochastic_round(x, torch.float16, ids, 1 << 32)
