"""Single-process tests of geompi.ps.protocol: round headers and their agreement check."""

from __future__ import annotations

import pytest
import torch

from geompi.errors import ProtocolError
from geompi.ps.protocol import (
    FLAG_GLOBAL,
    FLAG_SUM,
    MAX_KEYS,
    TAG_DATA,
    TAG_RESULT,
    Op,
    Round,
    agree,
    header_len,
    sender_weights,
)


def stack(*rounds: Round) -> torch.Tensor:
    return torch.stack([r.encode() for r in rounds])


# --- encode / decode ----------------------------------------------------------------------------
def test_header_layout() -> None:
    assert header_len() == 8 + 2 * MAX_KEYS  # op, round, weight, nkeys, spec_len, flags, step, k2
    h = Round(
        Op.GRAD, 7, [(3, 100), (9, 5)], weight=0.5, spec_len=12, flags=FLAG_SUM, step=42, k2=6
    ).encode()
    assert h.dtype == torch.float64 and h.shape == (header_len(),)
    assert h[:12].tolist() == [2.0, 7.0, 0.5, 2.0, 12.0, 1.0, 42.0, 6.0, 3.0, 100.0, 9.0, 5.0]
    assert not h[12:].any()
    assert TAG_RESULT == TAG_DATA + MAX_KEYS  # result tags never collide with data tags


@pytest.mark.parametrize(
    "rnd",
    [
        Round(Op.INIT, 0, [(0, 10), (1, 3)], weight=0.0, spec_len=57),
        Round(Op.GRAD, 12, [(5, 1000), (2, 7), (9, 1)], weight=1 / 3, flags=FLAG_SUM),
        Round(Op.AVG, 99, [(0, 2**40 + 1)], weight=2 / 3, flags=FLAG_GLOBAL),
        Round(Op.AVG, 5, [(0, 8), (1, 2)], weight=3.0, k2=17),
        Round(Op.AVG, 3, [(k, k + 1) for k in range(MAX_KEYS)], weight=1 / 7),
        Round(Op.STOP, 2**31),
        Round(Op.SAVE, 4, [(1, 0)], weight=1e-300),
    ],
    ids=lambda r: r.op.name,
)
def test_encode_decode_round_trip(rnd: Round) -> None:
    back = Round.decode(rnd.encode())
    assert back == rnd
    assert back.weight == rnd.weight  # exact, not approximately
    assert type(back.op) is Op and all(type(k) is int and type(n) is int for k, n in back.keys)


def test_weight_one_third_is_exact() -> None:
    back = Round.decode(Round(Op.GRAD, 1, [(0, 4)], weight=1 / 3).encode())
    assert back.weight == 1 / 3
    assert back.weight != float(torch.tensor(1 / 3, dtype=torch.float32))  # not squeezed to fp32


def test_sender_weights_read_each_header_weight() -> None:
    h = stack(Round(Op.GRAD, 3, [(1, 4)], weight=1 / 3), Round(Op.GRAD, 3, [(1, 4)], weight=48.0))
    assert sender_weights(h).tolist() == [Round.decode(r).weight for r in h] == [1 / 3, 48.0]


def test_too_many_keys() -> None:
    with pytest.raises(ValueError):
        Round(Op.GRAD, 0, [(k, 1) for k in range(MAX_KEYS + 1)]).encode()


# --- agree --------------------------------------------------------------------------------------
def test_agree_returns_the_round_the_summed_weight_and_the_spec_senders() -> None:
    keys = [(4, 10), (1, 20)]
    headers = stack(
        Round(Op.GRAD, 5, keys, weight=0.5),
        Round(Op.GRAD, 5, keys, weight=0.25, spec_len=40),
        Round(Op.GRAD, 5, keys, weight=0.125),
    )
    rnd, weight, with_spec = agree(headers, [3, 6, 9], "dc 1")
    assert rnd.op is Op.GRAD and rnd.round_id == 5 and rnd.keys == keys
    assert weight == 0.875
    assert with_spec == [6]


def test_agree_sums_thirds_to_one() -> None:
    headers = stack(*[Round(Op.AVG, 2, [(0, 3)], weight=1 / 3) for _ in range(3)])
    _, weight, with_spec = agree(headers, [0, 1, 2], "global tier")
    assert weight == 1.0
    assert with_spec == []


def test_agree_with_one_sender() -> None:
    rnd, weight, with_spec = agree(
        stack(Round(Op.INIT, 0, [(0, 8)], spec_len=3)), [11], "global tier"
    )
    assert (rnd.op, weight, with_spec) == (Op.INIT, 0.0, [11])


def test_agree_every_sender_with_a_spec() -> None:
    r = Round(Op.INIT, 0, [(0, 8)], spec_len=3)
    assert agree(stack(r, r, r), [2, 4, 8], "x")[2] == [2, 4, 8]


def test_agree_tolerates_differing_weights_and_spec_lengths() -> None:
    headers = stack(
        Round(Op.GRAD, 1, [(0, 5)], weight=3.0, spec_len=0),
        Round(Op.GRAD, 1, [(0, 5)], weight=0.0, spec_len=9),
    )
    rnd, weight, with_spec = agree(headers, [0, 1], "dc 0")
    assert weight == 3.0 and with_spec == [1] and rnd.spec_len == 0


@pytest.mark.parametrize(
    "other",
    [
        Round(Op.GRAD, 8, [(1, 10), (0, 20)]),  # same keys, other order
        Round(Op.GRAD, 8, [(0, 20)]),  # a key missing
        Round(Op.GRAD, 8, [(0, 20), (1, 10), (2, 1)]),  # an extra key
        Round(Op.GRAD, 8, [(0, 20), (1, 11)]),  # another size
        Round(Op.AVG, 8, [(0, 20), (1, 10)]),  # another op
        Round(Op.GRAD, 9, [(0, 20), (1, 10)]),  # another round
        Round(Op.GRAD, 8, [(0, 20), (1, 10)], flags=FLAG_SUM),  # other flags
        Round(Op.GRAD, 8, [(0, 20), (1, 10)], k2=3),  # another K2 (adaptive HFA)
    ],
)
def test_agree_mismatch_names_the_ranks(other: Round) -> None:
    good = Round(Op.GRAD, 8, [(0, 20), (1, 10)], weight=1.0)
    headers = stack(good, good, other)
    with pytest.raises(ProtocolError) as exc:
        agree(headers, [10, 11, 13], "datacenter 2")
    message = str(exc.value)
    assert "\n" not in message
    assert message.startswith("datacenter 2: ")
    assert "rank 13" in message and "rank 10" in message
    assert "rank 11" not in message  # the agreeing sender is not blamed
    assert f"round {other.round_id} {other.op.name}" in message
    assert "same keys in the same order" in message


def test_agree_mismatch_in_the_middle_names_that_sender() -> None:
    good = Round(Op.AVG, 1, [(0, 4), (1, 4)])
    bad = Round(Op.AVG, 1, [(1, 4), (0, 4)])
    with pytest.raises(ProtocolError) as exc:
        agree(stack(good, bad, good, good), [20, 21, 22, 23], "dc 4")
    message = str(exc.value)
    assert "rank 21 sent round 1 AVG keys [1, 0]" in message
    assert "rank 20 sent round 1 AVG keys [0, 1]" in message


def test_agree_mismatch_in_the_presence_key_names_that_sender() -> None:
    from geompi.ps.protocol import FLAG_PRESENCE

    good = Round(Op.GRAD, 3, [(0, 4), (9, 2)], weight=1.0, flags=FLAG_PRESENCE)
    bad = Round(Op.GRAD, 3, [(0, 4), (9, 3)], weight=1.0, flags=FLAG_PRESENCE)
    assert agree(stack(good, good), [0, 1], "dc 0")[0].keys == [(0, 4), (9, 2)]
    with pytest.raises(ProtocolError) as exc:
        agree(stack(good, bad), [30, 31], "dc 1")
    assert "rank 31 sent round 3 GRAD key 9 of 3 values (rank 30: 2)" in str(exc.value)


def test_agree_mismatch_of_sizes_names_the_key_and_both_sizes() -> None:
    """Issue 35 item 9: workers whose models differ in size were told "rank 1 sent round 1
    INIT keys [0, 1] but rank 0 sent round 1 INIT keys [0, 1]", the same words twice."""
    mine = Round(Op.INIT, 1, [(0, 20), (1, 10)])
    theirs = Round(Op.INIT, 1, [(0, 20), (1, 12)])
    with pytest.raises(ProtocolError) as exc:
        agree(stack(mine, theirs), [0, 1], "datacenter 0")
    message = str(exc.value)
    assert "\n" not in message
    assert "rank 1 sent round 1 INIT key 1 of 12 values (rank 0: 10)" in message
    assert "models differ in size" in message
    assert "key 0" not in message  # the key that agrees is not named


def test_agree_sums_the_weights_in_sender_order() -> None:
    weights = [0.1, 0.2, 0.3, 1e16, -1e16]  # a float sum that depends on its order
    headers = stack(*(Round(Op.GRAD, 1, [(0, 5)], weight=w) for w in weights))
    assert agree(headers, [0, 1, 2, 3, 4], "x")[1] == sum(weights)


# --- presence (FLAG_PRESENCE) -------------------------------------------------------------------
def test_presence_key_rides_outside_the_wire_prefix() -> None:
    from geompi.ps.protocol import FLAG_PRESENCE, wire_header

    rnd = Round(Op.GRAD, 4, [(0, 100), (1, 7), (2, 12)], weight=3.0, flags=FLAG_PRESENCE)
    h = rnd.encode()
    assert Round.decode(h).keys == rnd.keys  # a full (LAN) header keeps it
    wire = torch.zeros(header_len(), dtype=torch.float64)
    wire[: wire_header(h).numel()] = wire_header(h)
    assert wire_header(h).numel() == 8 + 2 * 2  # no more than the two bucket keys
    assert Round.decode(wire).keys == [(0, 100), (1, 7)]  # the global servers add it back


def test_presence_payload_is_empty_when_all_present() -> None:
    from geompi.ps.protocol import expect_presence, presence_payload, received_presence

    assert presence_payload(torch.tensor([1.0, 2.0])).numel() == 0
    some = torch.tensor([1.0, 0.0])
    assert presence_payload(some) is some
    buf = torch.zeros(2)
    expect_presence(buf)  # an empty message leaves the sentinel: every parameter present
    assert received_presence(buf) == 0 and buf.tolist() == [1.0, 1.0]
    buf.copy_(some)  # a full one arrived
    assert received_presence(buf) == 8 and buf.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("n, workers", [(0, 3), (2, 5), (7, 3), (10, 4), (1000, 16)])
def test_worker_slices_cover_a_key_once(n, workers):
    """A scattered key's slices, one per worker, cover every value exactly once, in order."""
    from geompi.ps.protocol import worker_slice

    slices = [worker_slice(n, j, workers) for j in range(workers)]
    assert slices[0][0] == 0 and slices[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    assert max(hi - lo for lo, hi in slices) - min(hi - lo for lo, hi in slices) <= 1


def test_scattered_positions_leave_out_the_presence_key():
    from geompi.ps.protocol import FLAG_PRESENCE, FLAG_SCATTER, scattered_positions

    keys = [(0, 10), (1, 4), (2, 3)]
    assert scattered_positions(Round(Op.GRAD, 1, keys, flags=FLAG_SCATTER)) == {0, 1, 2}
    both = FLAG_SCATTER | FLAG_PRESENCE
    assert scattered_positions(Round(Op.GRAD, 1, keys, flags=both)) == {0, 1}
    assert scattered_positions(Round(Op.GRAD, 1, keys)) == set()


def test_auto_lan_reduce_scatters_large_rounds_of_big_datacenters():
    from geompi.ps.client import scatters

    assert not scatters("auto", 3, 2**30) and not scatters("auto", 16, 2**20 - 1)
    assert scatters("auto", 4, 2**20) and not scatters("auto", 4, 2**20, one_node=True)
    assert scatters("scatter", 2, 4) and not scatters("scatter", 1, 2**30)
    assert not scatters("funnel", 64, 2**30)
