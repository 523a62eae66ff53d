"""The emulated link's arithmetic and the WAN compressors, without MPI."""

import math
import time

import pytest
import torch

from geompi.comm.buffers import all_finite
from geompi.comm.compression import ErrorFeedback, TopKCompressor, make_compressor
from geompi.comm.linkmodel import Channel, LinkModel, parse_duration, parse_rate
from geompi.config import make_config
from geompi.errors import ConfigError, NonFiniteError
from geompi.ps.wan import TierCodec


@pytest.mark.parametrize(
    "text, bytes_per_s",
    [("100Mbit", 12.5e6), ("1Gbit", 125e6), ("12.5MB", 12.5e6), ("800kbit/s", 1e5)],
)
def test_parse_rate(text, bytes_per_s):
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize("text, s", [("25ms", 0.025), ("0.1s", 0.1), ("500us", 5e-4)])
def test_parse_duration(text, s):
    assert parse_duration(text) == pytest.approx(s)


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--wan-bandwidth", "100"], "--wan-bandwidth '100': give a rate with a unit"),
        (["--wan-bandwidth", "0Mbit"], "must be > 0"),
        (["--wan-latency", "25"], "--wan-latency '25': give a time with a unit"),
        (["--lan-bandwidth", "fast"], "--lan-bandwidth 'fast'"),
        (["--wan-compression", "topk:2"], "unknown --wan-compression 'topk:2'"),
        (["--wan-compression", "zstd"], "choose none, fp16, bf16, int8, int4, topk:FRACTION"),
    ],
)
def test_bad_wan_flags_are_one_line_errors(flags, needle):
    with pytest.raises(ConfigError) as e:
        make_config(flags, env={}).validate()
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_bad_wan_environment_names_the_variable():
    with pytest.raises(ConfigError, match="unknown GEOMPI_WAN_COMPRESSION 'zstd'"):
        make_config([], env={"GEOMPI_WAN_COMPRESSION": "zstd"}).validate()


def test_wan_settings_from_environment():
    env = {"GEOMPI_WAN_BANDWIDTH": "1Gbit", "GEOMPI_WAN_COMPRESSION": "fp16"}
    w = make_config([], env=env).validate().wan_settings()
    assert w.wan.bandwidth == 125e6 and w.compression == "fp16" and not w.lan.active


def test_channel_serializes_and_pipelines_latency():
    ch = Channel(LinkModel(bandwidth=1000.0, latency=0.5))
    # Two transfers ready at t=10: the second starts when the first has left (t=11), and
    # latency is paid once per transfer, overlapped, not added up.
    assert ch.schedule(1000, ready=10.0) == pytest.approx(11.5)
    assert ch.schedule(500, ready=10.0) == pytest.approx(12.0)
    # An idle link starts at once.
    assert ch.schedule(0, ready=20.0) == pytest.approx(20.5)


def test_channel_holds_at_least_latency_plus_size_over_bandwidth():
    ch = Channel(LinkModel(bandwidth=1e6, latency=0.02))
    t0 = time.perf_counter()
    ch.hold_until(ch.schedule(30_000))
    assert time.perf_counter() - t0 >= 0.05
    assert ch.held_s >= 0.049


def test_burst_queues_from_the_first_arrival():
    ch = Channel(LinkModel(bandwidth=1e9, latency=0.03))
    burst: list[float] = []
    t0 = time.perf_counter()
    for _ in range(3):  # three results of one round: one latency, not three
        ch.hold_burst(burst, 10)
    elapsed = time.perf_counter() - t0
    assert 0.03 <= elapsed < 0.085


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "topk:0.01", "topk:0.5"])
def test_payload_size_is_what_the_compressor_announces(spec):
    c = make_compressor(spec)
    for n in (1, 7, 1000, 12345):
        x = torch.randn(n)
        p = c.compress(x)
        assert p.dtype == torch.uint8 and p.numel() == c.payload_nbytes(n)
        assert c.decompress(p, n).shape == (n,)


def test_ratios():
    # fp16: 2 bytes a value plus one fp32 scale per 1024 values; bf16: exactly half
    assert make_compressor("fp16").payload_nbytes(1000) == 2000 + 4
    assert make_compressor("fp16").payload_nbytes(2049) == 2 * 2049 + 3 * 4
    assert make_compressor("fp16").ratio(4096) == 4 * 4096 / (2 * 4096 + 16)
    assert make_compressor("bf16").ratio(1000) == 2.0
    assert make_compressor("topk:0.01").ratio(100_000) == 50.0  # 4 bytes -> (4 + 4) / 100
    assert make_compressor("none").ratio(10) == 1.0


def test_casts_round_like_torch():
    """In fp16's normal range a power-of-two scale changes no rounding: the cast's result."""
    x = torch.randn(1000) * 100
    x = x[x.abs() > 1e-2]
    for spec, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        c = make_compressor(spec)
        assert torch.equal(c.decompress(c.compress(x), x.numel()), x.to(dtype).float())


def test_fp16_carries_values_far_beyond_65504():
    """A sample-weighted sum is often beyond fp16's range: each chunk keeps 11 bits of its
    largest magnitude, never inf. Checked against the bound, not against the codec."""
    torch.manual_seed(1)
    n = 3 * 1024 + 5
    x = torch.randn(n) * torch.logspace(-3, 9, n)  # 1e-3 ... 1e9, one range per chunk
    x[7] = -3e38  # near fp32's largest
    c = make_compressor("fp16")
    y = c.decompress(c.compress(x), n)
    assert torch.isfinite(y).all()
    assert (x.to(torch.float16).isinf()).sum() > 1000  # a plain cast would send inf
    chunk_max = torch.nn.functional.pad(x.abs(), (0, -n % 1024)).view(-1, 1024).amax(1)
    bound = chunk_max.repeat_interleave(1024)[:n] * 2.0**-11
    assert ((y - x).abs() <= bound).all()


def test_fp16_keeps_small_values_that_a_cast_flushes_to_zero():
    x = torch.full((100,), 1e-9)
    c = make_compressor("fp16")
    assert x.to(torch.float16).eq(0).all()
    assert torch.allclose(c.decompress(c.compress(x), 100), x, rtol=2.0**-11, atol=0)


def test_bf16_needs_no_scale_and_never_overflows():
    c = make_compressor("bf16")
    x = torch.tensor([3.4e38, -3.4e38, 1e30, 1.0])  # the top of fp32 rounds to inf in bf16
    assert x.to(torch.bfloat16).isinf().any()
    y = c.decompress(c.compress(x), 4)
    assert torch.isfinite(y).all() and torch.allclose(y, x, rtol=2.0**-7)


@pytest.mark.parametrize("spec", ["fp16", "bf16"])
def test_casts_refuse_nonfinite_in_one_line(spec):
    with pytest.raises(NonFiniteError) as e:
        make_compressor(spec).compress(torch.tensor([1.0, float("inf")]))
    assert "--wan-compression " + spec in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_topk_refuses_nonfinite_in_one_line(bad):
    """As every other codec: a NaN would otherwise be the first value top-k keeps, and the
    receivers would take it into their model without a word."""
    with pytest.raises(NonFiniteError) as e:
        TopKCompressor(0.5).compress(torch.tensor([1.0, bad, 0.5, 0.25]))
    assert "--wan-compression topk:0.5" in str(e.value) and "\n" not in str(e.value)


def test_topk_keeps_the_largest_values_exactly():
    x = torch.tensor([0.1, -5.0, 0.2, 3.0, -0.3, 0.0, 1.0, 0.05])
    c = TopKCompressor(0.25)  # k = 2
    assert torch.equal(c.decompress(c.compress(x), 8), torch.tensor([0, -5.0, 0, 3.0, 0, 0, 0, 0]))


def test_error_feedback_sends_everything_eventually():
    """Top-k with error feedback: the sum of what was sent trails the sum of the inputs by
    exactly the residual, and a constant input is fully delivered over time."""
    torch.manual_seed(0)
    ef = ErrorFeedback(TopKCompressor(0.1))
    c = ef.compressor
    sent = torch.zeros(50)
    total = torch.zeros(50)
    for _ in range(40):
        x = torch.randn(50)
        total += x
        sent += c.decompress(ef.compress("k", x), 50)
        ef.commit()
    assert torch.allclose(sent + ef.residual["k"], total, atol=1e-5)
    ef2 = ErrorFeedback(TopKCompressor(0.1))
    sent = torch.zeros(50)
    for _ in range(200):
        sent += c.decompress(ef2.compress("k", torch.ones(50)), 50)
        ef2.commit()
    assert torch.allclose(sent / 200, torch.ones(50), atol=0.06)


def test_error_feedback_skips_a_nonfinite_round():
    ef = ErrorFeedback(make_compressor("topk:0.5"))
    ef.compress("k", torch.tensor([1.0, 2.0]))
    ef.commit()
    before = ef.residual["k"].clone()
    payload = ef.compress("k", torch.tensor([float("nan"), 1.0]))
    ef.commit()
    assert torch.equal(ef.residual["k"], before)
    assert torch.isfinite(ef.compressor.decompress(payload, 2)).all()


def test_error_feedback_discard_keeps_a_skipped_rounds_residuals():
    """A round whose data the global servers drop (weight 0): its finite keys' residuals
    must be the ones from before it, so the next round sends them."""
    ef = ErrorFeedback(TopKCompressor(0.5))
    ef.compress("a", torch.tensor([4.0, 1.0]))
    ef.compress("b", torch.tensor([-2.0, 0.5]))
    ef.commit()
    before = {k: v.clone() for k, v in ef.residual.items()}  # a: [0, 1], b: [0, 0.5]
    ef.compress("a", torch.tensor([0.0, 3.0]))
    ef.compress("b", torch.tensor([float("nan"), 0.0]))
    ef.discard()
    assert all(torch.equal(ef.residual[k], v) for k, v in before.items())
    sent = ef.compressor.decompress(ef.compress("a", torch.tensor([0.0, 0.0])), 2)
    assert torch.equal(sent, torch.tensor([0.0, 1.0]))


def test_an_idle_parameter_keeps_its_residual_out_of_the_payload():
    """Issue #34, 3: one key [b, a], top-1 of 2; b gets no gradient at a step (the servers
    do not step it). Its residual must stay out of that step's payload and stay whole."""
    codec = TierCodec(TopKCompressor(0.5))
    codec.set_layout([[0, [["b", 0, 1], ["a", 1, 1]]]])
    ef = codec.feedback
    codec.set_presence(torch.tensor([1.0, 1.0]))
    ef.compressor.decompress(codec.encode_push("k", torch.tensor([0.1, 1.0])), 2)
    ef.commit()  # b's 0.1 is left over
    codec.set_presence(torch.tensor([0.0, 1.0]))  # b idle
    idle = codec.idle(0, 0, 2)
    assert idle is not None and idle.tolist() == [True, False]
    assert codec.idle(0, 1, 2) is None  # a shard holding only a
    sent = ef.compressor.decompress(codec.encode_push("k", torch.tensor([0.0, 0.05]), idle=idle), 2)
    ef.commit()
    assert sent.tolist() == pytest.approx([0.0, 0.05])  # b's 0.1 would have won top-1
    assert ef.residual["k"].tolist() == pytest.approx([0.1, 0.0])
    codec.set_presence(torch.tensor([2.0, 1.0]))
    assert codec.present is None and codec.idle(0, 0, 2) is None


def test_fp16_pull_beyond_its_range_keeps_the_replicas_equal_and_finite():
    """The pull direction: a global server's change since the replica can exceed 65504."""
    gs, ls = TierCodec(make_compressor("fp16")), TierCodec(make_compressor("fp16"))
    values = torch.randn(3000) * 1e6
    out = torch.empty(3000)
    for _ in range(3):
        ls.decode_pull("k", gs.encode_pull("k", values), out)
        assert torch.isfinite(out).all() and torch.equal(gs.replica["k"], ls.replica["k"])
    assert torch.allclose(out, values, rtol=1e-6, atol=1e-3)


def test_fp16_hfa_push_of_a_large_weighted_difference():
    """An HFA push is the weighted sum less weight x replica: beyond 65504 for large models'
    values or weights. What it leaves out stays in the model, finite."""
    ls = TierCodec(make_compressor("fp16"))
    ls.set_replica("k", torch.zeros(2000))
    params = torch.randn(2000) * 100
    payload = ls.encode_push("k", 5000.0 * params, ref_weight=5000.0)  # 5000 samples
    sent = ls.compressor.decompress(payload, 2000) / 5000.0
    assert torch.isfinite(sent).all() and torch.allclose(sent, params, rtol=1e-3)
    assert torch.isfinite(ls.kept["k"]).all()


def test_pull_replicas_stay_identical_and_converge():
    """The global server's and a local server's replica move by the same decoded payloads;
    the replica approaches the true values as the pulls repeat (error feedback)."""
    gs, ls = TierCodec(TopKCompressor(0.2)), TierCodec(TopKCompressor(0.2))
    values = torch.randn(100)
    out = torch.empty(100)
    for _ in range(8):
        ls.decode_pull("k", gs.encode_pull("k", values), out)
        assert torch.equal(gs.replica["k"], ls.replica["k"]) and torch.equal(out, ls.replica["k"])
    assert torch.allclose(out, values)


def test_hfa_push_keeps_what_compression_left_out_in_the_model():
    """An HFA datacenter whose change from the replica was only partly sent carries the rest
    in its model, so no local progress is lost to compression."""
    ls = TierCodec(TopKCompressor(0.25))
    ls.set_replica("k", torch.zeros(8))
    params = torch.tensor([4.0, 0.1, -0.2, 0.3, 0.0, 0.5, -3.0, 0.2])
    payload = ls.encode_push("k", 2.0 * params, ref_weight=2.0)  # weight 2: sum of 2 workers
    sent = ls.compressor.decompress(payload, 8) / 2.0
    assert torch.equal(sent, torch.tensor([4.0, 0, 0, 0, 0, 0, -3.0, 0]))
    out = torch.empty(8)
    # a lone datacenter: the global model moves by exactly what it sent ...
    ls.decode_pull("k", ls.compressor.compress(sent), out)
    assert torch.equal(ls.replica["k"], sent)
    # ... and the datacenter's model is its own again, not the sparse replica
    assert torch.allclose(out, params)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_all_finite_finds_one_bad_element(bad):
    t = torch.randn(100_003)
    assert all_finite(t)
    t[77_777] = bad
    assert not all_finite(t)


def test_all_finite_is_exact_when_the_sum_overflows():
    t = torch.full((1000,), 3e38)  # finite values whose sum is inf
    assert not bool(torch.isfinite(t.sum())) and all_finite(t)
    t[0], t[1] = float("inf"), -float("inf")  # their sum is NaN, the check must still fail
    assert not all_finite(t)


# ---- int8 / int4 (issue #14): round trips and error feedback, against numpy written here ----
def _np_quant(x, qmax: int, chunk: int = 256):
    """An independent int quantizer: per-chunk absmax / qmax, round half to even, clamp."""
    import numpy as np

    out = np.zeros_like(x, dtype=np.float32)
    for lo in range(0, len(x), chunk):
        c = x[lo : lo + chunk].astype(np.float32)
        scale = np.float32(np.abs(c).max()) / np.float32(qmax)
        if scale > 0:
            out[lo : lo + chunk] = np.clip(np.round(c / scale), -qmax, qmax) * scale
    return out


@pytest.mark.parametrize("bits, qmax", [(8, 127), (4, 7)])
@pytest.mark.parametrize("n", [1, 3, 255, 256, 257, 1001])
def test_int_round_trip_is_within_half_a_step(bits, qmax, n):
    from geompi.comm.compression import QuantCompressor

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 4, n)  # chunks of very different scale
    c = QuantCompressor(bits)
    payload = c.compress(x)
    assert payload.numel() == c.payload_nbytes(n)
    y = c.decompress(payload, n)
    for lo in range(0, n, 256):
        step = float(x[lo : lo + 256].abs().max()) / qmax
        assert float((y[lo : lo + 256] - x[lo : lo + 256]).abs().max()) <= step / 2 * (1 + 1e-6)
    assert torch.allclose(
        y, torch.from_numpy(_np_quant(x.numpy(), qmax)), rtol=0, atol=1e-6 * float(x.abs().max())
    )


def test_int_zero_chunks_and_empty():
    from geompi.comm.compression import QuantCompressor

    for bits in (8, 4):
        c = QuantCompressor(bits)
        assert torch.equal(c.decompress(c.compress(torch.zeros(300)), 300), torch.zeros(300))
        assert c.decompress(c.compress(torch.zeros(0)), 0).numel() == 0


def test_int_refuses_non_finite():
    from geompi.comm.compression import QuantCompressor

    with pytest.raises(NonFiniteError, match="int8"):
        QuantCompressor(8).compress(torch.tensor([1.0, float("inf")]))


def test_topk_int8_keeps_topk_indices_and_quantizes_their_values():
    from geompi.comm.compression import TopKCompressor, make_compressor

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    c = make_compressor("topk:0.05+int8")
    y = c.decompress(c.compress(x), 1000)
    exact = TopKCompressor(0.05)
    kept = exact.decompress(exact.compress(x), 1000)
    assert torch.equal(y != 0, kept != 0)
    step = float(kept.abs().max()) / 127
    assert float((y - kept).abs().max()) <= step / 2 * (1 + 1e-6)
    assert c.payload_nbytes(1000) == 50 + 4 + 4 * 50


@pytest.mark.parametrize("spec, qmax", [("int8", 127), ("int4", 7)])
def test_int_error_feedback_matches_a_numpy_simulation(spec, qmax):
    """Several rounds of one key: what quantization dropped goes out with the next vector."""
    import numpy as np

    from geompi.comm.compression import ErrorFeedback, make_compressor

    c = make_compressor(spec)
    fb = ErrorFeedback(c)
    g = torch.Generator().manual_seed(7)
    residual = np.zeros(600, dtype=np.float32)
    for _ in range(6):
        x = torch.randn(600, generator=g)
        got = c.decompress(fb.compress("k", x), 600)
        fb.commit()
        v = residual + x.numpy()
        sent = _np_quant(v, qmax)
        residual = v - sent
        np.testing.assert_allclose(got.numpy(), sent, rtol=0, atol=1e-5)


@pytest.mark.parametrize("spec", ["fp16", "int8", "topk:0.5+int8"])
def test_values_next_to_fp32s_largest_decode_finite(spec):
    """A chunk whose largest magnitude rounds up to the next power of two on the wire (fp16:
    to 2^15 times its scale; int8: 127 times max/127) would decode past fp32's largest value,
    to inf. Clamped to it, the error stays within the codec's bound."""
    fmax = torch.finfo(torch.float32).max
    c = make_compressor(spec)
    for top in (fmax, 3.402e38, 3.40199e38):
        x = torch.tensor([top, -top, 1.0, -2.5e38] * 300, dtype=torch.float32)
        y = c.decompress(c.compress(x), x.numel())
        assert bool(torch.isfinite(y).all()), (spec, top)
        kept = y != 0  # top-k leaves some out
        err = (y - x)[kept].abs().max()
        assert float(err) <= top * 2.0**-8, (spec, top, float(err))


def test_topk_keeps_exactly_the_ceiling_of_its_fraction():
    """ceil(F * n) in exact arithmetic (0.07 * 100 is 7.000000000000001 in floating point),
    and the fraction travels to the servers with all its digits."""
    from fractions import Fraction

    for spec in ("0.07", "0.1", "0.3", "0.123456789"):
        c = make_compressor(f"topk:{spec}")
        for n in range(1, 2001):
            assert c.k(n) == max(1, math.ceil(Fraction(spec) * n)), (spec, n)
        assert make_compressor(c.name).k(10**7) == c.k(10**7)
        assert c.name == f"topk:{spec}"
