"""The public API in one process: names, lazy submodules, algorithm settings, checkpoint tables."""

import subprocess
import sys

import pytest
import torch

import geompi
from geompi.errors import ConfigError
from geompi.ps.optim import DCASGD, SGD, Adam, AdamW, spec_to_dict
from geompi.sync import FSA, HFA, MixedSync, resolve
from geompi.sync.fsa import server_spec


def test_plain_import_gives_kv_and_optim_like_mxnet():
    """After `import geompi`, geompi.kv.create and geompi.optim.Adam work (as mx.kv does)."""
    code = "import geompi; print(geompi.kv.create.__name__, geompi.optim.Adam(lr=0.1).lr)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["create", "0.1"]


def test_import_geompi_stays_light():
    """A plain import loads neither MPI nor h5py: a login node can import it."""
    code = "import sys, geompi; print('mpi4py.MPI' in sys.modules, 'h5py' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_public_names():
    for name in geompi.__all__:
        assert getattr(geompi, name) is not None, name
    with pytest.raises(AttributeError):
        geompi.no_such_name  # noqa: B018


def test_api_before_init_is_a_clear_error():
    with pytest.raises(ConfigError, match=r"geompi.init\(\) was not called"):
        geompi.worker_rank()


@pytest.mark.parametrize(
    "sync, cls", [("fsa", FSA), ("HFA", HFA), ("mixed", MixedSync), (HFA(k1=2, k2=5), HFA)]
)
def test_resolve(sync, cls):
    assert isinstance(resolve(sync), cls)


@pytest.mark.parametrize(
    "bad, words",
    [
        ("dilo", "unknown sync 'dilo'"),
        (HFA(k1=0), "k1=0"),
        (HFA(k2=1.5), "k2=1.5"),
        (HFA(weighting="dc"), "weighting='dc'"),
        (HFA(outer_optimizer="lamb"), "outer_optimizer='lamb'"),
        (HFA(outer_optimizer=torch.optim.RMSprop), "outer_optimizer=<class"),
        (HFA(outer_optimizer="adam", outer_kwargs={"momentum": 0.9}), "unknown setting momentum"),
        (HFA(outer_optimizer="nesterov", outer_kwargs={"momentum": 0}), "Nesterov needs"),
        (HFA(outer_optimizer="adam", outer_kwargs={"betas": (0.9, 1.5)}), "betas below 1"),
        (HFA(outer_lr=float("nan")), "outer_lr=nan"),
        (HFA(outer_lr="1"), "outer_lr='1'"),  # a string: one line, not a TypeError
        (HFA(fragments=2, mix=0.5), r"HFA\(mix\) 0.5 mixes an overlapped .* add HFA\(overlap\)"),
        (MixedSync(dcasgd_lambda=-0.1), "dcasgd_lambda=-0.1"),
        (MixedSync(dcasgd_lambda="0.1"), "dcasgd_lambda='0.1'"),
        (MixedSync(max_staleness=0), "max_staleness=0"),
        (42, "sync=42"),
        (HFA(k2=8, adaptive=True, k2_max=4), "starting k2 must lie within"),
        (HFA(adaptive=True, k2_min=0), "k2_min=0"),
        (HFA(adaptive=True, wan_share=1.0), "wan_share=1.0"),
        (HFA(k2=2, adaptive=True, overlap=True), r"overlap with HFA\(adaptive=True\) needs k2_min"),
    ],
)
def test_resolve_refuses(bad, words):
    with pytest.raises(ConfigError, match=words):
        resolve(bad)


def test_adaptive_k2_keeps_the_exchange_at_its_share_of_the_wall_time():
    """K2 = ceil(exchange / (wan_share * round compute)), within [k2_min, k2_max]."""
    algo = HFA(k1=8, k2=4, adaptive=True, k2_min=2, k2_max=40, wan_share=0.1)
    assert algo.next_k2(exchange_s=1.0, round_compute_s=0.5) == 20  # 1 / (0.1 * 0.5)
    assert algo.next_k2(exchange_s=1.01, round_compute_s=0.5) == 21  # rounded up
    assert algo.next_k2(exchange_s=0.01, round_compute_s=0.5) == 2  # k2_min
    assert algo.next_k2(exchange_s=0.0, round_compute_s=0.5) == 2
    assert algo.next_k2(exchange_s=100.0, round_compute_s=0.5) == 40  # k2_max
    assert algo.next_k2(exchange_s=1.0, round_compute_s=0.0) == 40  # no compute measured


class _MinOver:
    """A stand-in for the workers' communicator (a second rank cannot exist in a unit test):
    its Allreduce is a MIN of this worker's value and ``others``, and it counts the calls."""

    def __init__(self, *others: int) -> None:
        self.others, self.calls = others, 0

    def Allreduce(self, _in_place, buf, op) -> None:  # noqa: N802 - mpi4py's name
        self.calls += 1
        buf[0] = min([int(buf[0]), *self.others])


def test_adaptive_cadence_makes_its_collective_before_any_exchange_came_back():
    """With overlap a worker may reach a cycle's end before any timed exchange came back to it,
    while another datacenter's workers have one: it must still make the Allreduce (a rank that
    skips it hangs the others), asking for nothing, and take the others' K2; with no worker
    asking, K2 stays."""
    from geompi.sync.hfa import Cadence

    algo = HFA(k1=2, k2=2, adaptive=True, k2_min=2, k2_max=8, overlap=True, fragments=2)
    for others, want in [((5,), 5), ((2**63 - 1,), 2)]:  # another worker asks 5; nobody asks
        comm = _MinOver(*others)
        cadence = Cadence(algo, comm)
        cadence.start()
        for _ in range(2):  # a cycle of K2=2 rounds; nothing timed came back (count 0)
            cadence.begin()
            cadence.end(cadence.next_is_global(), step=4)
        assert comm.calls == 1 and cadence.k2 == want, (others, comm.calls, cadence.k2)


def test_server_spec_reads_the_users_optimizer():
    p = [torch.nn.Parameter(torch.zeros(3))]
    spec = server_spec(torch.optim.SGD(p, lr=0.2, momentum=0.5, nesterov=True), "X")
    assert spec == SGD(lr=0.2, momentum=0.5, nesterov=True)
    assert server_spec(torch.optim.Adam(p, lr=1e-3, betas=(0.8, 0.9)), "X") == Adam(
        lr=1e-3, betas=(0.8, 0.9)
    )
    assert isinstance(server_spec(torch.optim.AdamW(p), "X"), AdamW)
    d = MixedSync(dcasgd=True, dcasgd_lambda=0.1).server_spec(torch.optim.SGD(p, lr=0.3))
    assert d == {"optimizer": spec_to_dict(DCASGD(lr=0.3, lam=0.1))}
    with pytest.raises(ConfigError, match="got RMSprop"):
        server_spec(torch.optim.RMSprop(p), "MixedSync")
    with pytest.raises(ConfigError, match="amsgrad|got Adam"):
        server_spec(torch.optim.Adam(p, amsgrad=True), "MixedSync")
    two = torch.optim.SGD([{"params": p}, {"params": [torch.zeros(1)], "lr": 0.5}], lr=1)
    with pytest.raises(ConfigError, match="one param group"):  # DCASGD's case
        server_spec(two, "M")
    msg = FSA(optimizer="servers").server_spec(two)  # every group's spec, in order
    assert [g["lr"] for g in msg["groups"]] == [1.0, 0.5] and msg["optimizer"]["lr"] == 1.0
    with pytest.raises(ConfigError, match="one param group"):
        MixedSync(dcasgd=True).server_spec(two)
    with pytest.raises(ConfigError, match="without momentum"):
        MixedSync(dcasgd=True).server_spec(torch.optim.SGD(p, lr=0.3, momentum=0.9))


def test_server_spec_carries_maximize_and_decoupled_weight_decay():
    """Issue 34 item 6: the servers' spec carries the flags their torch step implements."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert server_spec(torch.optim.SGD(p, lr=0.1, maximize=True), "X").maximize
    assert server_spec(torch.optim.AdamW(p, maximize=True), "X").maximize
    adam = server_spec(torch.optim.Adam(p, decoupled_weight_decay=True, weight_decay=0.1), "X")
    assert adam.decoupled_weight_decay and adam.weight_decay == 0.1
    assert server_spec(torch.optim.AdamW(p), "X").decoupled_weight_decay
    assert not server_spec(torch.optim.Adam(p), "X").decoupled_weight_decay
    # how torch computes a step, not what: the servers run the single-tensor step anyway
    for flags in ({"foreach": True}, {"foreach": False}, {"fused": True}, {"capturable": True}):
        assert server_spec(torch.optim.Adam(p, **flags), "X") == Adam()
    sched = torch.optim.SGD(p, lr=0.1)  # a scheduler's keys, and the user's own, are no options
    torch.optim.lr_scheduler.OneCycleLR(sched, max_lr=0.1, total_steps=10)
    sched.param_groups[0]["name"] = "body"
    assert isinstance(server_spec(sched, "X"), SGD)


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: torch.optim.Adam(p, amsgrad=True), "Adam's amsgrad=True"),
        (lambda p: torch.optim.AdamW(p, amsgrad=True), "AdamW's amsgrad=True"),
        (lambda p: torch.optim.SGD(p, lr=0.1, differentiable=True), "differentiable=True"),
        (lambda p: torch.optim.Adam(p, differentiable=True), "differentiable=True"),
    ],
)
def test_server_spec_refuses_every_option_the_servers_would_drop(make, words):
    """Every key of every param group is compared with what the servers implement; an option
    they do not is one line naming it and its value."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = make(p)
    for algo in (FSA(optimizer="servers"), MixedSync()):
        with pytest.raises(ConfigError) as exc:
            algo.server_spec(opt)
        assert words in str(exc.value) and "\n" not in str(exc.value), exc.value
    # in a second param group only, too
    two = type(opt)([{"params": p}, {"params": [torch.nn.Parameter(torch.zeros(1))]}])
    two.param_groups[1].update({k: v for k, v in opt.param_groups[0].items() if k != "params"})
    with pytest.raises(ConfigError, match=words.split("'s ")[-1]):
        FSA(optimizer="servers").server_spec(two)


def test_an_option_the_servers_do_not_carry_passes_at_its_default_only(monkeypatch):
    """The rule for any option outside CARRIED (one a later torch adds): refused unless it
    holds the constructor's default. Shown on dampening, taken out of CARRIED here."""
    from geompi.sync import fsa

    sgd = torch.optim.SGD
    monkeypatch.setitem(fsa.CARRIED, sgd, fsa.CARRIED[sgd] - {"dampening"})
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(server_spec(sgd(p, lr=0.1, momentum=0.9), "X"), SGD)
    with pytest.raises(ConfigError, match="SGD's dampening=0.5"):
        server_spec(sgd(p, lr=0.1, momentum=0.9, dampening=0.5), "X")


def test_dcasgd_refuses_maximize():
    p = [torch.nn.Parameter(torch.zeros(3))]
    with pytest.raises(ConfigError, match="maximize=True"):
        MixedSync(dcasgd=True).server_spec(torch.optim.SGD(p, lr=0.1, maximize=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        lambda ps: torch.optim.SGD(ps, lr=0.1),  # momentum_buffer None
        lambda ps: torch.optim.Adam([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.5}]),
        lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01)),  # a tensor lr
        lambda ps: torch.optim.Adagrad(ps),
        lambda ps: torch.optim.RMSprop(ps, momentum=0.3, centered=True),
    ],
)
def test_save_load_round_trip_without_mpi(tmp_path, make):
    """geompi.save/load work outside a job too: torch's own state, bit for bit."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt = make(list(net.parameters()))
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(5, 4)).square().sum().backward()
        opt.step()
    geompi.save(tmp_path / "a.h5", model=net, optimizer=opt, step=3, epoch=1)
    net2 = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    opt2 = make(list(net2.parameters()))
    info = geompi.load(tmp_path / "a.h5", model=net2, optimizer=opt2)
    assert (info["step"], info["epoch"]) == (3, 1)
    for k, v in net.state_dict().items():
        assert torch.equal(v, net2.state_dict()[k]), k
    a, b = opt.state_dict(), opt2.state_dict()
    assert [{k: v for k, v in g.items() if k != "lr"} for g in a["param_groups"]] == [
        {k: v for k, v in g.items() if k != "lr"} for g in b["param_groups"]
    ]
    for i, st in a["state"].items():
        for k, v in st.items():
            w = b["state"][i][k]
            if v is None:
                assert w is None
            else:
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(w)), (i, k)


def test_load_refuses_another_optimizer_class(tmp_path):
    from geompi.errors import CheckpointError

    net = torch.nn.Linear(2, 2)
    geompi.save(tmp_path / "a.h5", model=net, optimizer=torch.optim.SGD(net.parameters(), lr=1))
    with pytest.raises(CheckpointError, match="holds 'SGD' optimizer state"):
        geompi.load(tmp_path / "a.h5", model=net, optimizer=torch.optim.Adam(net.parameters()))


def test_callwatch_names_only_places_that_can_never_meet():
    """Issue 35 item 2: workers waiting in different collective calls, or one in a call while
    another waits in a round beyond those the first began, are a mismatch; a worker still in
    the round the others already pushed, or the same call, is not (however long it takes)."""
    from geompi.comm.callwatch import LABELS, Place, conflict

    save, finish = LABELS.index("geompi.save"), LABELS.index("geompi.finish")
    assert conflict(Place(save, 2, 4), Place(finish, 2, 4))  # save alone, the rest finish
    assert conflict(Place(save, 2, 4), Place(0, 1, 5))  # save alone, the rest train on
    assert conflict(Place(0, 1, 6), Place(finish, 2, 5))  # one worker stopped a step early
    assert not conflict(Place(save, 2, 4), Place(save, 2, 4))  # the master writes a big file
    assert not conflict(Place(save, 2, 4), Place(0, 1, 4))  # a slow pull of the last round
    assert not conflict(Place(save, 3, 4), Place(finish, 2, 4))  # one call apart: passing
    assert not conflict(Place(0, 1, 4), Place(0, 1, 5))  # rounds: the servers match those


def test_callwatch_patience_is_shortened_only_under_the_test_hooks():
    from geompi.comm.callwatch import PATIENCE, patience

    short = {"GEOMPI_TEST_CALLWATCH_PATIENCE": "2"}
    assert patience({}) == PATIENCE == 10.0
    assert patience(short) == PATIENCE  # a variable left over in production changes nothing
    assert patience({**short, "GEOMPI_TEST_HOOKS": "1"}) == 2.0


def test_agree_names_the_first_setting_a_worker_differs_in():
    from geompi.session import _first_difference

    a = {"bucket_mb": 1.0, "model": [["w", [2, 3], "torch.float32", True, 0]]}
    b = {"bucket_mb": 1.0, "model": [["w", [3, 3], "torch.float32", True, 0]]}
    msg = _first_difference("DistributedOptimizer", [a, a, b])
    assert msg.startswith("DistributedOptimizer: worker 2's model differs from worker 0's")
    assert "[3, 3]" in msg and "[2, 3]" in msg and "\n" not in msg
    msg = _first_difference("X", [a, {**a, "bucket_mb": 0.5}])
    assert "worker 1's bucket_mb differs from worker 0's (0.5 vs 1.0)" in msg


@pytest.mark.parametrize("kind, refused", [("dist_async", True), ("dist_sync", False)])
def test_the_kvstore_honours_or_refuses_global_replicas(kind, refused):
    """GEOMPI_GLOBAL_REPLICAS=2 reaches the KVStore's topology; the one-sided type refuses it in
    one line (exit 2) before MPI starts anything, the synchronous one takes it (and then needs
    2 global servers: its topology's one line, in a world of one process)."""
    import os

    code = f"import geompi.kv as kv; kv.create({kind!r})"
    env = {**os.environ, "GEOMPI_GLOBAL_REPLICAS": "2"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("geompi: error:")]
    assert out.returncode != 0 and len(lines) == 1, out.stderr
    if refused:
        assert "global_replicas=2 with mixed is not supported yet" in lines[0]
    else:
        assert "--global-replicas 2 keeps each shard's copy on another global server" in lines[0]
