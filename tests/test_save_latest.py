"""geompi.save into a directory (files named by step, ``keep``) and geompi.latest, in one process
(tests/test_api_resume_mpi.py has both under mpirun, every worker getting the same answer)."""

import pytest
import torch

import geompi
from geompi.errors import CheckpointError, ConfigError


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def _train(net, opt, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(net(x), y).backward()
    opt.step()


def _names(d) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_a_directory_gets_files_named_by_step_and_keep_leaves_the_newest(tmp_path):
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    d = tmp_path / "ck"  # created by the first save
    at = {}
    for step in range(1, 5):
        _train(net, opt, step)
        written = geompi.save(d, model=net, optimizer=opt, step=step, keep=2)
        assert written == d / f"ckpt-{step:08d}.h5"
        at[step] = {k: v.clone() for k, v in net.state_dict().items()}
    assert _names(d) == ["ckpt-00000003.h5", "ckpt-00000004.h5"]
    assert geompi.latest(d) == d / "ckpt-00000004.h5"
    again = _net(seed=1)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    info = geompi.load(geompi.latest(d), model=again, optimizer=again_opt)
    assert info["step"] == 4
    for k, v in again.state_dict().items():
        assert torch.equal(v, at[4][k]), k
    # an existing directory without keep: named by step, nothing deleted
    geompi.save(d, model=net, step=7)
    assert _names(d) == ["ckpt-00000003.h5", "ckpt-00000004.h5", "ckpt-00000007.h5"]


def test_a_run_resumed_from_an_older_file_keeps_its_own_past(tmp_path):
    """Steps 1, 2, 4 written, then a run resumed from step 2 writes step 3: 3 is the latest
    (written last, though 4 has the higher step), and keep=3 keeps 3, the file it resumed
    from and the one before that, not the abandoned 4 (as the command line's --keep)."""
    net = _net()
    for step in (1, 2, 4):
        geompi.save(tmp_path, model=net, step=step)
    assert geompi.latest(tmp_path) == tmp_path / "ckpt-00000004.h5"
    geompi.load(tmp_path / "ckpt-00000002.h5", model=net)
    geompi.save(tmp_path, model=net, step=3, keep=3)
    assert geompi.latest(tmp_path) == tmp_path / "ckpt-00000003.h5"
    assert _names(tmp_path) == ["ckpt-00000001.h5", "ckpt-00000002.h5", "ckpt-00000003.h5"]
    geompi.save(tmp_path, model=net, step=5, keep=2)  # this run's own files come first
    assert _names(tmp_path) == ["ckpt-00000003.h5", "ckpt-00000005.h5"]


def test_latest_skips_a_torn_file_in_one_line_and_none_readable_is_an_error(tmp_path, capfd):
    assert geompi.latest(tmp_path / "nothing") is None  # a first run
    assert geompi.latest(tmp_path) is None
    net = _net()
    geompi.save(tmp_path, model=net, step=5)
    torn = tmp_path / "ckpt-00000006.h5"
    good = (tmp_path / "ckpt-00000005.h5").read_bytes()
    torn.write_bytes(good[: len(good) // 2])  # cut off mid-write (not a temporary name)
    assert geompi.latest(tmp_path) == tmp_path / "ckpt-00000005.h5"
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        "geompi: geompi.latest: skipped 1 unusable checkpoint(s), newest ckpt-00000006.h5 ("
    ), err
    assert err[0].endswith("resuming from ckpt-00000005.h5 instead")
    (tmp_path / "ckpt-00000005.h5").write_bytes(good[:100])
    with pytest.raises(CheckpointError, match="ckpt-0000000[56].h5"):
        geompi.latest(tmp_path)


@pytest.mark.parametrize(
    "keep, step, message",
    [
        (0, 1, r"geompi.save\(keep=0\): give a whole number >= 1 or None"),
        (True, 1, r"geompi.save\(keep=True\)"),
        (2, -1, r"names the file by its step: give step= a whole number >= 0, not -1"),
        (2, 1.5, r"not 1.5"),
        (None, 1.5, r"into a directory names the file by its step: .* not 1.5"),  # no keep
    ],
)
def test_a_bad_keep_is_one_line_and_nothing_is_written(tmp_path, keep, step, message):
    with pytest.raises(ConfigError, match=message):
        geompi.save(tmp_path, model=_net(), step=step, keep=keep)
    assert _names(tmp_path) == []
