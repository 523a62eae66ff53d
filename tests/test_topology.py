"""Single-process tests of geompi.comm.topology: the plan, the layout, the roles and the errors."""

from __future__ import annotations

import pytest

from geompi.comm.topology import Role, Topology, dc_sizes_from_hosts
from geompi.errors import ConfigError, TopologyError

W, LS, GS = Role.WORKER, Role.LOCAL_SERVER, Role.GLOBAL_SERVER


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


# --- the default plan ---------------------------------------------------------------------------
def test_default_16_ranks_is_three_datacenters_of_five_and_one_global_server() -> None:
    topo = Topology.plan(16)
    assert topo.world_size == 16
    assert topo.dc_sizes == (5, 5, 5)
    assert topo.num_dcs == 3
    assert topo.num_global_servers == 1
    assert topo.global_servers == [15]
    assert topo.num_workers == 12
    assert [topo.workers(d) for d in range(3)] == [[0, 1, 2, 3], [5, 6, 7, 8], [10, 11, 12, 13]]
    assert [topo.local_server(d) for d in range(3)] == [4, 9, 14]
    assert [topo.dc_start(d) for d in range(3)] == [0, 5, 10]
    assert topo.all_workers == [0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13]
    assert topo.describe() == {
        "world_size": 16,
        "dc_sizes": [5, 5, 5],
        "global_servers": 1,
        "workers": 12,
    }


def test_default_16_ranks_role_and_datacenter_of_every_rank() -> None:
    topo = Topology.plan(16)
    roles = [W, W, W, W, LS, W, W, W, W, LS, W, W, W, W, LS, GS]
    dcs = [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, None]
    assert [topo.role(r) for r in range(16)] == roles
    assert [topo.dc_of(r) for r in range(16)] == dcs
    # rank 0 is the master worker: the first worker of datacenter 0
    assert topo.role(0) is Role.WORKER and topo.dc_of(0) == 0


def test_default_16_ranks_worker_index_is_the_position_among_all_workers() -> None:
    topo = Topology.plan(16)
    expected = {0: 0, 1: 1, 2: 2, 3: 3, 5: 4, 6: 5, 7: 6, 8: 7, 10: 8, 11: 9, 12: 10, 13: 11}
    assert {r: topo.worker_index(r) for r in expected} == expected


@pytest.mark.parametrize(
    "world, sizes",
    [
        (3, (2,)),  # 2 ranks left: one datacenter
        (4, (3,)),
        (5, (2, 2)),  # 4 ranks left: two datacenters
        (6, (3, 2)),  # the remainder goes to the first datacenters
        (7, (2, 2, 2)),  # 6 ranks left: three datacenters
        (9, (3, 3, 2)),
        (32, (11, 10, 10)),
    ],
)
def test_default_number_and_sizes_of_datacenters(world: int, sizes: tuple[int, ...]) -> None:
    topo = Topology.plan(world)
    assert topo.dc_sizes == sizes
    assert topo.global_servers == [world - 1]


def test_dcs_splits_evenly_with_the_remainder_first() -> None:
    topo = Topology.plan(16, dcs=2)
    assert topo.dc_sizes == (8, 7)
    assert topo.workers(0) == list(range(7))
    assert topo.local_server(0) == 7
    assert topo.workers(1) == list(range(8, 14))
    assert topo.local_server(1) == 14
    assert topo.global_servers == [15]


# --- uneven sizes and several global servers ----------------------------------------------------
def test_uneven_dc_sizes_layout_and_roles() -> None:
    topo = Topology.plan(12, dc_sizes=[3, 6, 2])
    assert topo.dc_sizes == (3, 6, 2)
    assert topo.workers(0) == [0, 1]
    assert topo.local_server(0) == 2
    assert topo.workers(1) == [3, 4, 5, 6, 7]
    assert topo.local_server(1) == 8
    assert topo.workers(2) == [9]
    assert topo.local_server(2) == 10
    assert topo.global_servers == [11]
    assert topo.num_workers == 8
    roles = [W, W, LS, W, W, W, W, W, LS, W, LS, GS]
    assert [topo.role(r) for r in range(12)] == roles
    assert [topo.dc_of(r) for r in range(12)] == [0, 0, 0, 1, 1, 1, 1, 1, 1, 2, 2, None]
    assert [topo.worker_index(r) for r in (0, 1, 3, 4, 5, 6, 7, 9)] == list(range(8))


def test_dcs_equal_to_the_length_of_dc_sizes_is_accepted() -> None:
    assert Topology.plan(12, dcs=3, dc_sizes=(3, 6, 2)).dc_sizes == (3, 6, 2)


def test_several_global_servers_take_the_last_ranks() -> None:
    topo = Topology.plan(16, global_servers=3)
    assert topo.num_global_servers == 3
    assert topo.dc_sizes == (5, 4, 4)  # 13 ranks left for three datacenters
    assert topo.global_servers == [13, 14, 15]
    assert [topo.local_server(d) for d in range(3)] == [4, 8, 12]
    assert topo.all_workers == [0, 1, 2, 3, 5, 6, 7, 9, 10, 11]
    roles = [W, W, W, W, LS, W, W, W, LS, W, W, W, LS, GS, GS, GS]
    assert [topo.role(r) for r in range(16)] == roles
    assert [topo.dc_of(r) for r in (13, 14, 15)] == [None, None, None]


def test_several_global_servers_with_dc_sizes() -> None:
    topo = Topology.plan(10, dc_sizes=[4, 4], global_servers=2)
    assert topo.global_servers == [8, 9]
    assert topo.workers(1) == [4, 5, 6]
    assert topo.local_server(1) == 7


# --- shard bounds -------------------------------------------------------------------------------
@pytest.mark.parametrize("g", [1, 2, 3, 4])
@pytest.mark.parametrize("numel", [0, 1, 2, 3, 4, 5, 7, 10, 100, 1001, 65537])
def test_shard_bounds_cover_the_key_disjointly(g: int, numel: int) -> None:
    topo = Topology.plan(4 + g, dc_sizes=[2, 2], global_servers=g)
    bounds = [topo.shard_bounds(numel, s) for s in range(g)]
    owner = [0] * numel  # how many servers own each element
    for lo, hi in bounds:
        assert 0 <= lo <= hi <= numel
        for i in range(lo, hi):
            owner[i] += 1
    assert owner == [1] * numel
    assert bounds[0][0] == 0 and bounds[-1][1] == numel
    assert all(bounds[s][1] == bounds[s + 1][0] for s in range(g - 1))  # in server order
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1  # balanced


def test_shard_bounds_exact_values() -> None:
    topo = Topology.plan(7, dc_sizes=[2, 2], global_servers=3)
    assert [topo.shard_bounds(10, s) for s in range(3)] == [(0, 3), (3, 6), (6, 10)]
    assert [topo.shard_bounds(2, s) for s in range(3)] == [(0, 0), (0, 1), (1, 2)]
    one = Topology.plan(3)
    assert one.shard_bounds(5, 0) == (0, 5)


# --- errors -------------------------------------------------------------------------------------
def test_errors_are_config_errors() -> None:
    assert issubclass(TopologyError, ConfigError)


def test_world_too_small() -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(2)
    message = one_line(exc)
    assert "2 rank(s)" in message and "mpirun -n 3" in message


def test_world_too_small_for_several_global_servers() -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(4, global_servers=3)
    assert "mpirun -n 5" in one_line(exc)


@pytest.mark.parametrize("sizes, dc", [([1, 14], 0), ([5, 9, 1], 2), ([16, -1], 1), ([15, 0], 1)])
def test_datacenter_without_a_worker(sizes: list[int], dc: int) -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dc_sizes=sizes)
    message = one_line(exc)
    assert f"datacenter {dc} has {sizes[dc]} rank(s)" in message
    assert "no worker" in message and "size >= 2" in message


def test_dc_sizes_not_adding_up() -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dc_sizes=[5, 5])
    message = one_line(exc)
    assert "--dc-sizes 5,5 adds up to 10" in message
    assert "make the sizes add up to 15" in message


def test_dc_sizes_counting_the_global_server_do_not_add_up() -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dc_sizes=[8, 8])
    assert "add up to 15" in one_line(exc)


def test_dcs_mismatch_with_dc_sizes() -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dcs=2, dc_sizes=[5, 5, 5])
    message = one_line(exc)
    assert "--dcs 2" in message and "3 datacenters" in message and "drop --dcs" in message


def test_too_many_datacenters() -> None:
    assert Topology.plan(16, dcs=7).dc_sizes == (3, 2, 2, 2, 2, 2, 2)  # 14 <= 15 still fits
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dcs=8)
    message = one_line(exc)
    assert "8 datacenters need at least 16 ranks" in message
    assert "mpirun -n 17" in message and "fewer --dcs" in message


@pytest.mark.parametrize("dcs", [0, -1])
def test_no_datacenter(dcs: int) -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, dcs=dcs)
    assert f"--dcs {dcs}" in one_line(exc)


@pytest.mark.parametrize("g", [0, -2])
def test_global_servers_zero(g: int) -> None:
    with pytest.raises(TopologyError) as exc:
        Topology.plan(16, global_servers=g)
    message = one_line(exc)
    assert f"--global-servers {g}" in message and "at least 1 global server" in message


# --- datacenters from host names ----------------------------------------------------------------
def test_dc_sizes_from_hosts_two_nodes_of_eight() -> None:
    hosts = ["node0"] * 8 + ["node1"] * 8
    sizes = dc_sizes_from_hosts(hosts, 1)
    assert sizes == [8, 7]
    topo = Topology.plan(16, dc_sizes=sizes)
    assert topo.local_server(0) == 7 and topo.local_server(1) == 14 and topo.global_servers == [15]


def test_dc_sizes_from_hosts_more_cases() -> None:
    assert dc_sizes_from_hosts(["a"] * 4 + ["b"] * 4 + ["c"] * 4, 2) == [4, 4, 2]
    # a node holding only the global server is no datacenter
    assert dc_sizes_from_hosts(["a"] * 5 + ["b"] * 5 + ["c"], 1) == [5, 5]
    assert dc_sizes_from_hosts(["a"] * 3 + ["b"] * 2, 1) == [3, 1]


# --- the table ----------------------------------------------------------------------------------
def test_table_lists_every_datacenter() -> None:
    topo = Topology.plan(12, dc_sizes=[3, 6, 2])
    lines = topo.table().splitlines()
    assert len(lines) == 2 + 3 + 1
    assert "12 ranks" in lines[0] and "3 datacenter(s)" in lines[0] and "8 workers" in lines[0]
    dc_lines = [line for line in lines if line.strip().startswith("DC ")]
    assert [line.split()[:3] for line in dc_lines] == [
        ["DC", "0", "2"],
        ["DC", "1", "8"],
        ["DC", "2", "10"],
    ]
    assert dc_lines[0].endswith("ranks 0-1 (2)")
    assert dc_lines[1].endswith("ranks 3-7 (5)")
    assert dc_lines[2].endswith("rank 9")
    assert lines[-1].split() == ["global", "servers", "rank", "11"]


def test_table_with_two_global_servers() -> None:
    text = Topology.plan(16, global_servers=2).table()
    for d in range(3):
        assert f"DC {d}" in text
    assert "servers ranks 14-15 (2)" in text


def test_start_up_refuses_settings_that_differ_between_ranks():
    """Issue #13: one datacenter mixing GPU and CPU workers, or one rank reading another
    GEOMPI_* value, must be one line at start-up instead of a hang."""
    from geompi.errors import ConfigError
    from geompi.runtime import check_same_device, check_same_env

    topo = Topology.plan(7, 2, None, 1)  # dc_sizes [3, 3]: workers 0, 1 and 3, 4
    rows = [{"env": {"GEOMPI_SYNC": "fsa"}, "device": "cpu"} for _ in range(7)]
    check_same_env(rows)
    check_same_device(rows, topo)
    rows[topo.global_servers[0]]["device"] = "cuda"  # a server's device does not matter
    check_same_device(rows, topo)
    w = topo.all_workers
    mixed = [dict(r) for r in rows]
    mixed[w[1]] = {**mixed[w[1]], "device": "cuda"}
    with pytest.raises(ConfigError, match=r"datacenter 0 mixes cpu and cuda workers"):
        check_same_device(mixed, topo)
    odd = [dict(r) for r in rows]
    odd[3] = {"env": {}, "device": "cpu"}
    with pytest.raises(
        ConfigError, match=r"GEOMPI_SYNC differs between ranks \(rank 0: 'fsa', rank 3: unset\)"
    ):
        check_same_env(odd)


def test_surviving_topology_drops_a_datacenter_that_lost_its_local_server() -> None:
    from geompi.comm.faults import surviving_topology

    t = Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2)  # local servers 2, 4, 7
    after, left = surviving_topology(t, {7})
    assert left == [2] and after.dc_sizes == (3, 2) and after.world_size == 7
    assert after.global_servers == [5, 6]
    after, left = surviving_topology(t, {5, 6})  # every worker of datacenter 2
    assert left == [2] and after.dc_sizes == (3, 2)


def test_surviving_topology_keeps_a_datacenter_with_workers_left() -> None:
    from geompi.comm.faults import surviving_topology

    t = Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2)
    after, left = surviving_topology(t, {6, 1})  # one worker of datacenters 2 and 0
    assert left == [] and after.dc_sizes == (2, 2, 2) and after.world_size == 8


def test_a_second_loss_is_named_as_the_job_was_launched() -> None:
    """After datacenter 1 left, the world and the datacenters are renumbered; the line and the
    failure record still name the ranks and datacenters by their numbers at the job's start."""
    from geompi.comm.faults import Loss, surviving_topology

    start = Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2)
    first, left = surviving_topology(start, {4})  # the local server of datacenter 1
    assert left == [1] and first.dc_sizes == (3, 3)
    second, _ = surviving_topology(first, {4})  # now rank 4: rank 6, a worker of datacenter 2
    names = [0, 1, 2, 5, 6, 7, 8, 9]  # the job-start rank of each rank of ``first``
    loss = Loss([4], [], second, first, rank_names=names, dc_names=[0, 2])
    line = loss.describe(8)
    assert line.startswith("geompi: lost rank(s) 6 (worker of datacenter 2) at step 8"), line
    assert "the data shard(s) of worker rank(s) 6 dropped" in line
    assert loss.lost_at_start == [6] and loss.left_at_start == []
    gone = Loss([4, 5], [1], surviving_topology(first, {4, 5})[0], first, -1, names, [0, 2])
    assert gone.left_at_start == [2] and "datacenter(s) 2 left the job" in gone.describe()
    plain = Loss([4], [1], first, start)  # the first loss: numbers as they are
    assert plain.lost_at_start == [4] and "4 (local server of datacenter 1)" in plain.describe()


@pytest.mark.parametrize("lost", [{8}, {0}, {2}, {0, 1}])
def test_surviving_topology_refuses_what_the_job_cannot_lose(lost: set[int]) -> None:
    """A global server (its shard) or datacenter 0 (rank 0, the master worker)."""
    from geompi.comm.faults import LostEssentialRank, surviving_topology

    t = Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2)
    with pytest.raises(LostEssentialRank, match="so .*stops; run it again"):
        surviving_topology(t, lost)


def test_the_abort_line_says_what_mpi_abort_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under --on-failure continue MPI_Abort ends only the calling rank until a recovery has
    happened (bench/ulfm_abort.py), every rank afterwards and without continue."""
    from geompi.comm import faults

    assert faults.abort_reach() == "aborting every rank"
    monkeypatch.setattr(faults, "_world", object())  # watch(): continue, no loss yet
    assert faults.abort_reach().startswith("ending this rank, as --on-failure continue")
    monkeypatch.setattr(faults, "_last_world", object())  # after a recovery
    assert faults.abort_reach() == "aborting every rank"


def test_replicas_mirror_each_shard_on_the_next_global_server_and_survive_a_recovery() -> None:
    from geompi.comm.faults import surviving_topology

    t = Topology.plan(11, dc_sizes=[3, 2, 3], global_servers=3, replicas=2)
    assert [t.replica_server(g) for g in range(3)] == [1, 2, 0]
    assert [t.mirrored_shard(g) for g in range(3)] == [2, 0, 1]
    assert all(t.mirrored_shard(t.replica_server(g)) == g for g in range(3))
    after, _ = surviving_topology(t, {7})  # a datacenter leaves; the global tier stays
    assert after.replicas == 2 and after.num_global_servers == 3
    assert Topology.plan(11, dc_sizes=[3, 2, 3], global_servers=3).replicas == 1


def test_replicas_need_a_second_global_server_and_say_so() -> None:
    with pytest.raises(TopologyError, match="--global-replicas 2 .* --global-servers 2 or more"):
        Topology.plan(8, global_servers=1, replicas=2)


@pytest.mark.parametrize("bad", ["3", "0"])
def test_global_replicas_is_one_or_two(bad: str) -> None:
    from geompi.config import make_config

    with pytest.raises(ConfigError, match=f"--global-replicas {bad}: choose 1 or 2"):
        make_config(["--global-replicas", bad]).validate()
    with pytest.raises(ConfigError, match=f"GEOMPI_GLOBAL_REPLICAS {bad}: choose 1 or 2"):
        make_config([], env={"GEOMPI_GLOBAL_REPLICAS": bad}).validate()
    assert make_config(["--global-replicas", "2"]).validate().global_replicas == 2


def test_a_lost_global_server_goes_on_from_its_mirror_unless_the_mirror_is_lost_too() -> None:
    from geompi.comm.faults import Loss, LostEssentialRank, surviving_topology

    t = Topology.plan(11, dc_sizes=[3, 2, 3], global_servers=3, replicas=2)  # servers 8, 9, 10
    after, left = surviving_topology(t, {9})
    assert left == [] and after.num_global_servers == 2 and after.replicas == 2
    assert after.dc_sizes == t.dc_sizes and after.global_servers == [8, 9]
    loss = Loss([9], [], after, t)
    assert loss.lost_global == [1] and loss.lost_workers == 0
    assert "the shard(s) of global server(s) 1 go on from their mirrors" in loss.describe(5)
    assert "dropped" not in loss.describe(5)
    for both in ({8, 10}, {8, 9}):  # in a ring of 3, any two include a shard and its mirror
        with pytest.raises(LostEssentialRank, match="their shard of the global model"):
            surviving_topology(t, both)
    two = Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2, replicas=2)
    after, _ = surviving_topology(two, {8})
    assert after.num_global_servers == 1 and after.replicas == 1  # no second server to mirror
    with pytest.raises(LostEssentialRank):
        surviving_topology(Topology.plan(10, dc_sizes=[3, 2, 3], global_servers=2), {8})
