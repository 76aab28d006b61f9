"""Half precision through the client: float16 is numpy's own; bfloat16 uploads from
float values (rounded to nearest even) or from its bits, and fetches as float32, or
as its bits with raw=True. Through the server and straight to the agents."""

import numpy as np
import pytest

import meshd

# (float32 value, its bfloat16 bits): exact values, ties to even, one rounding up,
# and the specials.
CASES = [(1.0, 0x3F80), (-2.5, 0xC020), (1.0 + 2 ** -8, 0x3F80), (1.0 + 3 * 2 ** -8, 0x3F82),
         (1.0 + 2 ** -8 + 2 ** -20, 0x3F81), (np.inf, 0x7F80), (-0.0, 0x8000), (3.0e38, 0x7F62)]


@pytest.fixture(params=["proxy", "direct"])
def half_mesh(server, request):
    with meshd.connect(server[0], data_path=request.param) as s, s.mesh(gpu=2).activate():
        yield s


def test_float16_round_trip_and_compute(half_mesh):
    a = np.array([0.5, -1.25, 65504.0, 2 ** -14], np.float16)
    t = meshd.tensor(a)
    assert t.dtype == "float16"
    got = meshd.inspect(t, gpu=1)
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, a)
    with np.errstate(over="ignore"):  # 65504 * 2 is inf in float16, on the agents too
        np.testing.assert_array_equal(meshd.inspect(t * 2, gpu=0), a * np.float16(2))


def test_bfloat16_from_floats_rounds_to_nearest_even(half_mesh):
    values = np.array([v for v, _ in CASES], np.float32)
    bits = np.array([b for _, b in CASES], np.uint16)
    t = meshd.tensor(values, dtype="bfloat16")
    assert t.dtype == "bfloat16"
    raw = meshd.inspect(t, gpu=0, raw=True)
    assert raw.dtype == np.uint16
    assert [hex(b) for b in raw] == [hex(b) for b in bits]
    got = meshd.inspect(t, gpu=1)
    assert got.dtype == np.float32  # numpy has no bfloat16: exact float32 values
    np.testing.assert_array_equal(got, (bits.astype(np.uint32) << 16).view(np.float32))


def test_bfloat16_nan_stays_nan_and_bits_round_trip(half_mesh):
    t = meshd.tensor(np.array([np.nan, 1.0], np.float32), dtype="bfloat16")
    got = meshd.inspect(t, gpu=0)
    assert np.isnan(got[0]) and got[1] == 1.0
    bits = np.array([0x3F80, 0x4049, 0xFF80, 0x0001], np.uint16)  # 1, 3.140625, -inf, tiny
    u = meshd.tensor(bits, dtype="bfloat16")
    np.testing.assert_array_equal(meshd.inspect(u, gpu=1, raw=True), bits)
    assert meshd.inspect(u, gpu=1)[1] == 3.140625
    # bits in a big-endian array are bits too (not numbers to convert)
    big = meshd.tensor(bits.astype(">u2"), dtype="bfloat16")
    np.testing.assert_array_equal(meshd.inspect(big, gpu=0, raw=True), bits)


def test_bfloat16_computes(half_mesh):
    t = meshd.tensor(np.array([1.5, -3.0, 0.25], np.float32), dtype="bfloat16")
    s = meshd.fetch_shard(t + t, gpu=0).result()
    np.testing.assert_array_equal(s, np.array([3.0, -6.0, 0.5], np.float32))
