"""Single-process tests of geompi.comm.messages (the pickle-free state messages) and of their
transport helpers, which count every byte."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from mpi4py import MPI

from geompi.comm import messages
from geompi.comm.messages import MessageError, decode, encode
from geompi.comm.transport import WAN, LinkStats, Requests, isend_state, recv_state, send_state
from geompi.errors import ProtocolError


def state() -> dict:
    """A tree like a global server's snapshot, with every kind of leaf."""
    g = torch.Generator().manual_seed(0)
    return {
        "index": 1,
        "values": {0: torch.randn(7, generator=g), 3: torch.randn(2, 3, generator=g)},
        "state": {
            0: {
                "exp_avg": torch.randn(7, generator=g, dtype=torch.float64),
                "step": torch.tensor(5.0),
            },
            3: {"step": {"fc.weight": torch.tensor(3, dtype=torch.int64)}},
        },
        "outer": {},
        "mask": torch.tensor([True, False, True]),
        "ids": torch.arange(-3, 4, dtype=torch.int64),
        "empty": torch.empty(0, 4),
        "empty_int": torch.empty(0, dtype=torch.int64),
        "scalar64": torch.tensor(-2.5, dtype=torch.float64),
        "half": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "updates": 12,
        "big": 2**62,
        "lr": 0.1,
        "odd": [math.inf, -math.inf, -0.0, 1e-310],
        "name": "adamw ünïcode",
        "nothing": None,
        "flag": True,
        "cut": [3, 0, 2],
        "pair": (1, "a"),
    }


def same(a, b) -> None:
    assert type(a) is type(b) or (isinstance(a, tuple) and type(b) is list), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            same(x, y)
    elif isinstance(a, float):
        assert math.copysign(1, a) == math.copysign(1, b) and a == b
    else:
        assert a == b


def test_round_trip_keeps_every_leaf_exactly() -> None:
    s = state()
    out = decode(encode(s))
    same(s, out)
    assert isinstance(out["pair"], list)  # tuples come back as lists
    assert math.isnan(decode(encode({"x": math.nan}))["x"])
    t = decode(encode({"t": torch.tensor([math.nan])}))["t"]
    assert t.isnan().all()


def test_decoded_tensors_are_their_own_writable_memory() -> None:
    buf = encode({"a": torch.zeros(3)})
    t = decode(buf)["a"]
    t.add_(1)  # no warning about a read-only buffer, and the message is unchanged
    assert torch.equal(decode(buf)["a"], torch.zeros(3))


def test_a_non_contiguous_tensor_is_sent_as_its_values() -> None:
    x = torch.arange(12.0).reshape(3, 4).t()
    assert torch.equal(decode(encode([x]))[0], x)


def test_the_message_is_the_header_then_exactly_the_tensor_bytes() -> None:
    buf = encode({"a": torch.zeros(5), "b": torch.zeros((), dtype=torch.float64), "c": 1})
    magic, hlen = struct.unpack("<4sQ", buf[:12].tobytes())
    assert magic == b"GMS1"
    assert buf.nbytes == 12 + hlen + 5 * 4 + 8
    header = json.loads(buf[12 : 12 + hlen].tobytes())
    assert header["payload"] == 28


@pytest.mark.parametrize(
    "obj",
    [
        {"f": lambda: 0},
        {"s": {1, 2}},
        {(1, 2): 0},
        {True: 0},
        torch.zeros(2, dtype=torch.complex64),
    ],
)
def test_what_cannot_be_sent_is_refused_on_encoding(obj) -> None:
    with pytest.raises(MessageError, match="state message"):
        encode(obj)


def forge(header, payload: bytes = b"", magic: bytes = b"GMS1") -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<4sQ", magic, len(h)) + h + payload


def tensor_header(dtype="float32", shape=(2,), nbytes=8, payload=8) -> dict:
    return {"tree": {"d": [["x", {"t": [dtype, list(shape), nbytes]}]]}, "payload": payload}


@pytest.mark.parametrize(
    "message, error",
    [
        (forge(tensor_header(dtype="object"), bytes(8)), "dtype 'object', not one of float64"),
        (forge(tensor_header(dtype="torch.float32"), bytes(8)), "dtype 'torch.float32'"),
        (forge(tensor_header(nbytes=12, payload=12), bytes(12)), "needs 8 bytes but its header"),
        (forge(tensor_header(shape=(-1,)), bytes(8)), "is not a list of sizes"),
        (forge(tensor_header(), bytes(7)), "payload is 7 bytes but its header says 8"),
        (forge(tensor_header(), bytes(9)), "payload is 9 bytes but its header says 8"),
        (forge(tensor_header(payload=4), bytes(4)), "payload ends 4 bytes before"),
        (forge({"tree": {"i": 1}, "payload": 4}, bytes(4)), "4 bytes no tensor of its header"),
        (forge(b"\x80\x04\x95 not json"), "header is not JSON"),
        (forge(b'{"tree": '), "header is not JSON"),
        (forge(b"[1, 2]"), "is not {tree, payload}"),
        (forge({"tree": {"i": 1}}), "is not {tree, payload}"),
        (forge({"tree": {"i": 1}, "payload": True}), "header says True"),
        (forge({"tree": {"q": 1}, "payload": 0}), "of no known kind"),
        (forge({"tree": {"i": "1"}, "payload": 0}), "of no known kind"),
        (forge({"tree": {"i": 1, "s": "x"}, "payload": 0}), "not one tagged value"),
        (forge({"tree": {"f": "0x1.zp+1"}, "payload": 0}), "is not a float"),
        (forge({"tree": {"d": [[1.5, {"n": None}]]}, "payload": 0}), "key 1.5 is not a str"),
        (forge({"tree": {"d": [["a", {"i": 1}], ["a", {"i": 2}]]}, "payload": 0}), "appears twice"),
        (forge({"tree": {"d": [["a"]]}, "payload": 0}), "is not [key, node]"),
        (
            forge(tensor_header(dtype="bool", shape=(8,)), bytes([0, 1, 2, 0, 0, 0, 0, 0])),
            "0 and 1",
        ),
        (forge({"tree": {"i": 1}, "payload": 0}, magic=b"\x80\x04\x95\x00"), "not b'GMS1'"),
        (b"GMS1\x00", "shorter than its prefix"),
        (struct.pack("<4sQ", b"GMS1", 1000) + b"{}", "1000 bytes is longer than the 2 bytes"),
        (forge({"tree": {"l": [{"l": 1}]}, "payload": 0}), "of no known kind"),
        (forge(tensor_header())[:-3], "is longer than the"),
    ],
)
def test_a_malformed_message_is_refused_with_a_clear_error(message, error) -> None:
    with pytest.raises(MessageError, match="state message") as e:
        decode(message)
    assert error in str(e.value), str(e.value)
    assert isinstance(e.value, ProtocolError)


def test_a_header_nested_too_deep_is_refused() -> None:
    tree: dict = {"n": None}
    for _ in range(messages.MAX_DEPTH + 5):
        tree = {"l": [tree]}
    with pytest.raises(MessageError, match="deeper than"):
        decode(forge({"tree": tree, "payload": 0}))
    with pytest.raises(MessageError, match="header is not JSON"):  # deeper than json can go
        decode(forge(b'{"tree": ' + b"[" * 100_000 + b"]" * 100_000 + b', "payload": 0}'))


def test_a_pickle_is_not_a_message() -> None:
    import pickle

    with pytest.raises(MessageError, match="not b'GMS1'"):
        decode(pickle.dumps({"a": 1}))


def test_send_and_receive_count_every_byte_as_wan_control() -> None:
    comm = MPI.COMM_SELF
    sender, receiver = LinkStats(), LinkStats()
    s = state()
    n = encode(s).nbytes
    reqs = Requests(sender)
    isend_state(reqs, comm, s, 0, 77, sender)
    same(s, recv_state(comm, 0, 77, receiver, timeout=5.0, what="the test's state"))
    reqs.wait()
    assert sender.sent[WAN] == sender.control[WAN] == n and sender.messages[WAN] == 1
    assert receiver.received[WAN] == n and receiver.sent[WAN] == 0
    assert sender.as_dict()["wan_data_bytes"] == 0  # state is not training data
    # the blocking pair, without a timeout (a matched probe, then the receive)
    other = LinkStats()
    send_state(comm, {"k": torch.ones(3)}, 0, 78, other, timeout=5.0, what="the test's state")
    got = recv_state(comm, 0, 78, receiver, timeout=None)
    assert torch.equal(got["k"], torch.ones(3))
    assert other.sent[WAN] == other.control[WAN] > 12
    assert receiver.received[WAN] == n + other.sent[WAN]


def test_damaged_messages_decode_or_raise_message_error_only() -> None:
    """Bytes changed or cut anywhere: a MessageError (or, in the payload, other values), never
    another exception."""
    import random

    good = encode(state()).tobytes()
    rng = random.Random(0)
    for _ in range(400):
        b = bytearray(good)
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(min(len(b), 700))] = rng.randrange(256)  # mostly the header
        if rng.random() < 0.2:
            b = b[: rng.randrange(len(b))]
        try:
            decode(bytes(b))
        except MessageError:
            pass
