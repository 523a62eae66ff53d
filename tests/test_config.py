"""Single-process tests of geompi.config: flags, environment, GeoMX aliases and validate()."""

from __future__ import annotations

import json
import re

import pytest

from geompi.config import RunConfig, from_env, make_config
from geompi.errors import ConfigError


def one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert message and "\n" not in message
    return message


def cfg(*argv: str, env: dict[str, str] | None = None, **kwargs) -> RunConfig:
    """make_config isolated from the real environment."""
    return make_config(list(argv), env={} if env is None else env, **kwargs)


# --- defaults and flags -------------------------------------------------------------------------
def test_defaults_without_flags_or_environment() -> None:
    c = cfg().validate()
    assert c == RunConfig()
    assert (c.sync, c.optimizer, c.k1, c.k2, c.batch_size) == ("fsa", "sgd", 4, 2, 16)
    assert (c.dcs, c.dc_sizes, c.global_servers) == (None, None, None)
    assert c.effective_lr == 0.05
    assert c.sources == {}


def test_make_config_from_argv() -> None:
    c = cfg(
        "--sync", "hfa", "--k1", "4", "--k2", "3", "--dcs", "3", "--dc-sizes", "6,5,4",
        "--global-servers", "2", "--model", "mlp", "--dataset", "synthetic", "--batch-size", "8",
        "--lr", "0.25", "--optimizer", "adam", "--nesterov", "--steps", "7", "--seed", "0",
        "--dc-slowdown", "1:3,2:1.5", "--checkpoint-dir", "/tmp/ck", "--checkpoint-every", "24",
    )  # fmt: skip
    c.validate()
    assert c.sync == "hfa"
    assert (c.k1, c.k2) == (4, 3)
    assert c.dcs == 3 and c.dc_sizes == (6, 5, 4) and c.global_servers == 2
    assert (c.model, c.dataset, c.batch_size) == ("mlp", "synthetic", 8)
    assert c.lr == 0.25 and c.effective_lr == 0.25 and c.optimizer == "adam"
    assert c.nesterov is True and c.steps == 7 and c.seed == 0
    assert c.dc_slowdown == {1: 3.0, 2: 1.5}
    assert c.checkpoint_dir == "/tmp/ck" and c.checkpoint_every == 24
    assert c.sources["k1"] == "--k1" and c.sources["dc_sizes"] == "--dc-sizes"
    assert json.loads(c.to_json())["dc_slowdown"] == {"1": 3.0, "2": 1.5}


def test_dc_sizes_flag_tolerates_spaces() -> None:
    assert cfg("--dc-sizes", "5, 5,5").dc_sizes == (5, 5, 5)


def test_effective_lr_defaults_by_optimizer() -> None:
    assert cfg("--optimizer", "adam").effective_lr == 1e-3
    assert cfg("--optimizer", "adamw").effective_lr == 1e-3
    assert cfg("--optimizer", "dcasgd").effective_lr == 0.1


def test_keyword_arguments_override_flags() -> None:
    c = cfg("--k1", "4", k1=9, dc_sizes=[3, 3])
    assert c.k1 == 9 and c.sources["k1"] == "k1"
    assert c.dc_sizes == (3, 3)


def test_unknown_keyword_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(no_such_setting=1)
    assert "no_such_setting" in one_line(exc)


# --- environment --------------------------------------------------------------------------------
def test_geompi_environment_variables() -> None:
    env = {
        "GEOMPI_DCS": "2",
        "GEOMPI_DC_SIZES": "8,7",
        "GEOMPI_GLOBAL_SERVERS": "1",
        "GEOMPI_HFA_K1": "4",
        "GEOMPI_HFA_K2": "3",
        "GEOMPI_SYNC": "hfa",
    }
    c = cfg(env=env).validate()
    assert c.dcs == 2 and c.dc_sizes == (8, 7) and c.global_servers == 1
    assert (c.k1, c.k2, c.sync) == (4, 3, "hfa")
    assert c.sources == {
        "dcs": "GEOMPI_DCS",
        "dc_sizes": "GEOMPI_DC_SIZES",
        "global_servers": "GEOMPI_GLOBAL_SERVERS",
        "k1": "GEOMPI_HFA_K1",
        "k2": "GEOMPI_HFA_K2",
        "sync": "GEOMPI_SYNC",
    }


def test_blank_environment_variables_are_ignored() -> None:
    assert cfg(env={"GEOMPI_HFA_K1": "  ", "GEOMPI_DCS": ""}).k1 == 4


def test_env_none_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEOMPI_HFA_K2", "6")
    monkeypatch.delenv("GEOMPI_HFA_K1", raising=False)
    monkeypatch.delenv("MXNET_KVSTORE_HFA_K2", raising=False)
    assert make_config([]).k2 == 6


@pytest.mark.parametrize("var", ["GEOMPI_DCS", "GEOMPI_HFA_K1", "MXNET_KVSTORE_HFA_K2"])
def test_non_integer_environment_variable(var: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(env={var: "2.5"})
    assert var in one_line(exc) and "whole number" in str(exc.value)


def test_dc_sizes_environment_variable_not_numbers() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(env={"GEOMPI_DC_SIZES": "5,five"})
    assert "GEOMPI_DC_SIZES" in one_line(exc)


def test_environment_value_checked_by_validate_names_the_variable() -> None:
    c = cfg(env={"GEOMPI_HFA_K1": "0"})
    with pytest.raises(ConfigError) as exc:
        c.validate()
    assert "GEOMPI_HFA_K1" in one_line(exc)


# --- GeoMX aliases ------------------------------------------------------------------------------
def test_mxnet_use_hfa_selects_hfa() -> None:
    c = cfg(env={"MXNET_KVSTORE_USE_HFA": "1"})
    assert c.sync == "hfa" and c.sources["sync"] == "MXNET_KVSTORE_USE_HFA"
    assert cfg(env={"MXNET_KVSTORE_USE_HFA": "0"}).sync == "fsa"


def test_mxnet_use_hfa_agreeing_with_geompi_sync() -> None:
    assert cfg(env={"MXNET_KVSTORE_USE_HFA": "1", "GEOMPI_SYNC": "hfa"}).sync == "hfa"


def test_mxnet_use_hfa_disagreeing_with_geompi_sync() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(env={"MXNET_KVSTORE_USE_HFA": "1", "GEOMPI_SYNC": "fsa"})
    message = one_line(exc)
    assert "GEOMPI_SYNC" in message and "MXNET_KVSTORE_USE_HFA" in message


def test_mxnet_use_hfa_bad_value() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(env={"MXNET_KVSTORE_USE_HFA": "yes"})
    assert "MXNET_KVSTORE_USE_HFA" in one_line(exc)


def test_mxnet_k1_alone() -> None:
    c = cfg(env={"MXNET_KVSTORE_HFA_K1": "5"})
    assert c.k1 == 5 and c.k2 == 2
    assert c.sources == {"k1": "MXNET_KVSTORE_HFA_K1"}
    c = cfg(env={"MXNET_KVSTORE_HFA_K2": "7"})
    assert c.k2 == 7 and c.k1 == 4


def test_mxnet_and_geompi_spelling_equal_is_fine() -> None:
    env = {"GEOMPI_HFA_K1": "4", "MXNET_KVSTORE_HFA_K1": "4"}
    env |= {"GEOMPI_HFA_K2": "2", "MXNET_KVSTORE_HFA_K2": "2"}
    c = cfg(env=env)
    assert (c.k1, c.k2) == (4, 2)
    assert c.sources["k1"] == "GEOMPI_HFA_K1"


@pytest.mark.parametrize("k", ["1", "2"])
def test_mxnet_and_geompi_spelling_disagree(k: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(env={f"GEOMPI_HFA_K{k}": "4", f"MXNET_KVSTORE_HFA_K{k}": "5"})
    message = one_line(exc)
    assert f"GEOMPI_HFA_K{k}=4" in message and f"MXNET_KVSTORE_HFA_K{k}=5" in message


def test_geompi_variables_together_with_geomx_aliases() -> None:
    env = {"MXNET_KVSTORE_USE_HFA": "1", "MXNET_KVSTORE_HFA_K1": "3", "GEOMPI_HFA_K2": "2"}
    c = cfg(env=env).validate()
    assert (c.sync, c.k1, c.k2) == ("hfa", 3, 2)


def test_from_env_returns_sources() -> None:
    assert from_env({}) == {"sources": {}}
    assert from_env({"MXNET_KVSTORE_HFA_K2": "3"}) == {
        "k2": 3,
        "sources": {"k2": "MXNET_KVSTORE_HFA_K2"},
    }


# --- a flag overrides the environment -----------------------------------------------------------
def test_flag_overrides_environment() -> None:
    env = {"GEOMPI_HFA_K1": "3", "GEOMPI_DC_SIZES": "5,5,5", "GEOMPI_SYNC": "hfa"}
    c = cfg("--k1", "7", "--dc-sizes", "8,7", "--sync", "fsa", env=env)
    assert (c.k1, c.dc_sizes, c.sync) == (7, (8, 7), "fsa")
    assert c.sources["k1"] == "--k1" and c.sources["sync"] == "--sync"


def test_flag_overrides_geomx_alias() -> None:
    env = {"MXNET_KVSTORE_USE_HFA": "1", "MXNET_KVSTORE_HFA_K1": "3"}
    c = cfg("--mixed-sync", "--k1", "2", env=env)
    assert (c.sync, c.k1) == ("mixed", 2)
    # without the flags the environment wins over the defaults
    assert (cfg(env=env).sync, cfg(env=env).k1) == ("hfa", 3)


# --- --mixed-sync and --dcasgd ------------------------------------------------------------------
def test_mixed_sync_alias() -> None:
    c = cfg("--mixed-sync").validate()
    assert c.sync == "mixed" and c.optimizer == "sgd"
    assert cfg("--mixed-sync", "--sync", "mixed").sync == "mixed"


def test_dcasgd_alias() -> None:
    c = cfg("--dcasgd").validate()
    assert c.optimizer == "dcasgd" and c.sync == "fsa"


def test_mixed_sync_and_dcasgd_together() -> None:
    c = cfg("--mixed-sync", "--dcasgd").validate()
    assert c.sync == "mixed"
    assert c.optimizer == "dcasgd"
    assert c.optimizer != "adam"
    assert c.effective_lr == 0.1


def test_mixed_sync_conflicts_with_another_sync() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg("--mixed-sync", "--sync", "hfa")
    assert "--mixed-sync" in one_line(exc) and "--sync hfa" in str(exc.value)


def test_dcasgd_conflicts_with_another_optimizer() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg("--dcasgd", "--optimizer", "adam")
    assert "--dcasgd" in one_line(exc) and "--optimizer adam" in str(exc.value)


def test_dcasgd_with_hfa_is_rejected() -> None:
    with pytest.raises(ConfigError) as exc:
        cfg("--dcasgd", env={"MXNET_KVSTORE_USE_HFA": "1"}).validate()
    assert "--sync mixed" in one_line(exc)


# --- validate() ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--sync", "async"], "--sync 'async'"),
        (["--model", "resnet50"], "--model 'resnet50'"),
        (["--dataset", "cifar10"], "--dataset 'cifar10'"),
        (["--optimizer", "rmsprop"], "--optimizer 'rmsprop'"),
        (["--sync", "hfa", "--k1", "0"], "--k1 0"),
        (["--sync", "hfa", "--k1=-3"], "--k1 -3"),
        (["--sync", "hfa", "--k2", "0"], "--k2 0"),
        (["--sync", "hfa", "--k2=-1"], "--k2 -1"),
        (["--batch-size", "0"], "--batch-size 0"),
        (["--batch-size=-16"], "--batch-size -16"),
        (["--lr", "nan"], "--lr nan"),
        (["--lr", "inf"], "--lr inf"),
        (["--lr", "0"], "--lr 0"),
        (["--lr=-0.1"], "--lr -0.1"),
        (["--outer-lr", "nan"], "--outer-lr"),
        (["--momentum=-0.5"], "--momentum"),
        (["--weight-decay", "nan"], "--weight-decay"),
        (["--dcasgd-lambda=-1"], "--dcasgd-lambda"),
        (["--steps", "10", "--epochs", "1"], "--steps and --epochs"),
        (["--steps", "0"], "--steps 0"),
        (["--epochs", "0"], "--epochs 0"),
        (["--epochs", "nan"], "--epochs nan"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--resume", "latest"], "--resume latest needs --checkpoint-dir"),
        (["--checkpoint-every=-1", "--checkpoint-dir", "d"], "--checkpoint-every -1"),
        (["--keep", "0"], "--keep 0"),
        (["--dc-slowdown", "1:0.5"], "--dc-slowdown 1:0.5"),
        (["--dc-slowdown", "1:nan"], "--dc-slowdown 1:nan"),
        (["--hfa-weighting", "size"], "--hfa-weighting"),
        (["--outer-optimizer", "adam"], "--outer-optimizer is for --sync hfa"),
        (["--sync", "hfa", "--outer-optimizer", "lamb"], "unknown --outer-optimizer 'lamb'"),
        (["--sync", "hfa", "--outer-momentum", "1.5"], "--outer-momentum 1.5"),
        (
            ["--sync", "hfa", "--outer-optimizer", "adam", "--outer-momentum", "0.5"],
            "--outer-momentum is for --outer-optimizer sgd or nesterov, not adam",
        ),
        (["--sync", "pkg:"], "--sync pkg:: write MODULE:CLASS"),
        (["--on-nonfinite", "ignore"], "--on-nonfinite"),
        (["--dc-map", "racks"], "--dc-map"),
        (["--sync", "mixed", "--max-staleness", "0"], "--max-staleness 0"),
        (["--bucket-mb", "0"], "--bucket-mb 0"),
        (["--comm-timeout", "0"], "--comm-timeout 0"),
        (["--comm-timeout", "nan"], "--comm-timeout nan"),  # NaN > 0 is False, so was NaN <= 0
        (["--comm-timeout", "inf"], "--comm-timeout inf"),
        (["--bucket-mb", "nan"], "--bucket-mb nan"),
        (["--sync", "hfa", "--optimizer", "dcasgd"], "--optimizer dcasgd"),
        (["--lan-reduce", "ring"], "unknown --lan-reduce 'ring': choose one of auto"),
        (["--sync", "hfa", "--k2-max", "8"], "--k2-max set --adaptive-sync's bounds: add"),
        (["--sync", "hfa", "--k2-min", "2", "--wan-share", "0.2"], "--k2-min/--wan-share set"),
        (["--adaptive-sync"], "--adaptive-sync is for --sync hfa, not --sync fsa"),
        (["--sync", "hfa", "--adaptive-sync", "--k2-min", "0"], "--k2-min 0"),
        (["--sync", "hfa", "--adaptive-sync", "--k2-min", "5", "--k2-max", "2"], "--k2-min 5 is"),
        (["--sync", "hfa", "--adaptive-sync", "--k2", "8", "--k2-max", "4"], "--k2 8: the start"),
        (["--sync", "hfa", "--adaptive-sync", "--wan-share", "1"], "--wan-share 1"),
        (["--sync", "hfa", "--adaptive-sync", "--wan-share", "nan"], "--wan-share nan"),
        (
            ["--sync", "hfa", "--adaptive-sync", "--k2", "2", "--hfa-overlap"],
            "--hfa-overlap with --adaptive-sync needs --k2-min >= 2",
        ),
        (
            ["--sync", "hfa", "--adaptive-sync", "--k1", "4", "--checkpoint-every", "6"]
            + ["--checkpoint-dir", "d"],
            "not a multiple of K1 = 4",
        ),
    ],
)
def test_validate_errors(argv: list[str], needle: str) -> None:
    c = cfg(*argv)
    with pytest.raises(ConfigError) as exc:
        c.validate()
    assert needle in one_line(exc)


@pytest.mark.parametrize(
    "argv",
    [
        ["--sync", "hfa", "--k1", "1", "--k2", "1"],
        ["--lr", "1e-4"],
        ["--lr", "1e4", "--seed", str(2**64 - 1), "--steps", str(10**9)],
        ["--epochs", "1e6", "--comm-timeout", "1"],
        ["--sync", "hfa", "--k1", "1000", "--k2", str(10**6)],
        ["--sync", "mixed", "--max-staleness", "3"],
        ["--nesterov", "--momentum", "0.5"],
        ["--nesterov"],  # the default momentum is 0.9
        ["--steps", "1"],
        ["--epochs", "0.5"],
        ["--checkpoint-every", "5", "--checkpoint-dir", "d"],
        ["--dc-slowdown", "1:1"],
        ["--sync", "hfa", "--optimizer", "adamw", "--outer-optimizer", "nesterov"],
        ["--momentum", "0", "--dcasgd-lambda", "0"],
    ],
)
def test_validate_accepts_edge_values(argv: list[str]) -> None:
    assert isinstance(cfg(*argv).validate(), RunConfig)


def test_adaptive_sync_flags_make_the_algorithm() -> None:
    """--adaptive-sync's flags reach HFA; without --k2 it starts at its default clamped into
    [--k2-min, --k2-max], and with it
    checkpoints need only whole datacenter rounds (it makes those rounds global)."""
    c = cfg(
        "--sync", "hfa", "--adaptive-sync", "--k1", "4", "--k2-min", "3", "--k2-max", "9",
        "--wan-share", "0.2", "--checkpoint-every", "8", "--checkpoint-dir", "d",
    ).validate()  # fmt: skip
    algo = c.algorithm
    assert (algo.adaptive, algo.k2, algo.k2_min, algo.k2_max, algo.wan_share) == (
        True, 3, 3, 9, 0.2,
    )  # fmt: skip
    assert algo.period() == 4
    assert cfg("--sync", "hfa", "--adaptive-sync", "--k2", "5").validate().algorithm.k2 == 5
    assert not cfg("--sync", "hfa", "--k2", "5").validate().algorithm.adaptive


@pytest.mark.parametrize("k1", [1.5, "2", True, 0])
def test_validate_rejects_non_integer_k1_keyword(k1) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(k1=k1, sync="hfa").validate()
    assert "whole number" in one_line(exc)


@pytest.mark.parametrize("value", ["5,x,5", "five", "5;5;5", "5.5,5"])
def test_dc_sizes_not_numbers(value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg("--dc-sizes", value)
    message = one_line(exc)
    assert "--dc-sizes" in message and repr(value) in message


@pytest.mark.parametrize("value", ["1", "a:2", "1:fast", "1:2:3", "1-3", "1:3;2:2"])
def test_bad_dc_slowdown_syntax(value: str) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg("--dc-slowdown", value)
    message = one_line(exc)
    assert "--dc-slowdown" in message and "DC:FACTOR" in message


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--k1", "1.5"], "--k1"),
        (["--k2", "two"], "--k2"),
        (["--batch-size", "2.5"], "--batch-size"),
        (["--lr", "fast"], "--lr"),
    ],
)
def test_non_integer_flag_is_a_config_error(argv: list[str], flag: str) -> None:
    with pytest.raises(ConfigError) as exc:
        try:
            cfg(*argv)
        except SystemExit as e:  # argparse's default: a plain failure here, not an exit
            raise AssertionError(f"make_config called sys.exit({e.code})") from e
    message = one_line(exc)
    assert flag in message and "--help" in message


def test_unknown_flag_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as exc:
        try:
            cfg("--k3", "2")
        except SystemExit as e:
            raise AssertionError(f"make_config called sys.exit({e.code})") from e
    assert "--k3" in one_line(exc)


def test_help_lists_choices_and_defaults():
    """#17: `--help` names the choices and the default of every flag; defaults that depend on
    the algorithm or optimizer say so."""
    from geompi.config import build_parser

    parser = build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.dest in ("help", "mixed_sync", "dcasgd"):  # help, and the GeoMX aliases
            continue
        assert action.help and "default" in action.help, f"{action.option_strings}: {action.help}"
    for flag, shown in {
        "--model": "{linear,mlp,cnn}|MODULE:FACTORY a built-in, or your own: FACTORY("
        "input_shape, num_classes) in MODULE returns a torch.nn.Module; MODULE must be "
        "importable on every worker, e.g. on PYTHONPATH (default cnn)",
        "--dataset": "{digits,mnist,fashion-mnist,hdf5,synthetic}|MODULE:FACTORY a built-in, "
        "or your own: FACTORY(data_dir) returns (x_train, y_train, x_test, y_test[, "
        "num_classes]) tensors or arrays (default digits)",
        "--optimizer": "{sgd,adam,adamw,dcasgd} (default sgd)",
        "--sync": "{fsa,mixed,hfa}|MODULE:CLASS algorithm, or pkg.module:Class for one of "
        "your own (default fsa)",
        "--on-nonfinite": "{abort,skip} on a NaN/Inf gradient (default abort)",
        "--keep": "KEEP checkpoints to keep (default 3)",
        "--batch-size": "BATCH_SIZE per worker (default 16)",
    }.items():
        assert f"{flag} {shown}" in text, (flag, text)
    assert "default depends on --optimizer: sgd 0.05, dcasgd 0.1" in text, text
    assert "default depends on --sync: 0.9, but 0.5 for --sync mixed" in text, text
    assert "GeoMX alias for --sync mixed" in text


ULFM_LAUNCH = {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_btl": "self,tcp"}


@pytest.mark.parametrize(
    "argv,launch,says",
    [
        (["--on-failure", "retry"], ULFM_LAUNCH, "unknown --on-failure 'retry'"),
        (["--on-failure", "continue"], {}, "needs MPI fault tolerance: launch with mpirun"),
        (
            ["--on-failure", "continue"],
            {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_MCA_btl": "self,sm,tcp"},
            "shared-memory transport",
        ),
        (
            ["--on-failure", "continue"],
            {"OMPI_MCA_mpi_ft_enable": "1"},
            "shared-memory transport (Open MPI's default transports)",
        ),
        (
            ["--on-failure", "continue", "--comm-timeout", "5"],
            ULFM_LAUNCH,
            "--comm-timeout: ULFM detects lost ranks itself",
        ),
        (
            ["--on-failure", "continue", "--wan-compression", "int8"],
            ULFM_LAUNCH,
            "drop --wan-compression",
        ),
        (["--on-failure", "continue", "--hfa-fragments", "2"], ULFM_LAUNCH, "drop --hfa-frag"),
        (
            ["--on-failure", "continue", "--lan-reduce", "scatter"],
            ULFM_LAUNCH,
            "--lan-reduce scatter: a datacenter sums through its local server under continue",
        ),
    ],
)
def test_on_failure_continue_needs_hfa_and_a_ulfm_launch(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], launch: dict, says: str
) -> None:
    """Refused in one line where the launch or the settings cannot survive a lost rank."""
    for var in ("OMPI_MCA_mpi_ft_enable", "OMPI_MCA_btl"):
        monkeypatch.delenv(var, raising=False)
    for var, value in launch.items():
        monkeypatch.setenv(var, value)
    sync = [] if "--sync" in argv else ["--sync", "hfa"]
    with pytest.raises(ConfigError, match=re.escape(says)):
        cfg(*argv, *sync).validate()


def test_on_failure_continue_takes_checkpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checkpoints go on through a recovery (written in the surviving topology)."""
    for var, value in ULFM_LAUNCH.items():
        monkeypatch.setenv(var, value)
    c = cfg("--on-failure", "continue", "--sync", "hfa", "--checkpoint-dir", "ck")
    c.validate()
    assert c.on_failure == "continue" and c.checkpoint_dir == "ck"


def test_on_failure_continue_under_ulfm_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    for var, value in ULFM_LAUNCH.items():
        monkeypatch.setenv(var, value)
    assert cfg("--on-failure", "continue", "--sync", "hfa").validate().on_failure == "continue"


def test_on_failure_continue_through_init_checks_the_algorithm_later(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """geompi.init(on_failure="continue") names no algorithm: DistributedOptimizer checks it
    (Algorithm.check_survivable), refusing streaming and adaptive HFA in one line."""
    import geompi

    for var, value in ULFM_LAUNCH.items():
        monkeypatch.setenv(var, value)
    make_config(env={}, on_failure="continue").validate()
    make_config(env={}, sync="mixed", on_failure="continue").validate()
    geompi.HFA(k1=2, k2=2, outer_optimizer="nesterov").check_survivable()
    geompi.FSA().check_survivable()
    geompi.FSA(optimizer="servers").check_survivable()
    geompi.MixedSync(dcasgd=True).check_survivable()
    for algo in (geompi.HFA(fragments=2), geompi.HFA(k2=2, adaptive=True)):
        with pytest.raises(ConfigError, match="not supported together yet"):
            algo.check_survivable()


# --- issue 35 item 8: absurd values and flags that do not apply, one line each ------------------
@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--seed", str(2**64)], "--seed 18446744073709551616: must be a whole number from 0"),
        (["--seed=-1"], "--seed -1"),
        (["--epochs", "1e308"], "--epochs 1e+308: must be at most"),
        (["--lr", "1e308"], "--lr 1e+308: the learning rate must be at most"),
        (["--sync", "hfa", "--outer-lr", "1e300"], "--outer-lr 1e+300: must be at most"),
        (["--wan-bandwidth", "1e-300bit"], "--wan-bandwidth '1e-300bit': emulate a rate from"),
        (["--lan-bandwidth", "1e400Gbit"], "--lan-bandwidth '1e400Gbit': emulate a rate from"),
        (["--wan-latency", "1e12s"], "--wan-latency '1e12s': emulate at most 60s"),
        (["--sync", "hfa", "--hfa-fragments", "1000000"], "--hfa-fragments 1000000: at most 64"),
        (["--sync", "hfa", "--k1", str(2**62)], "--k1 4611686018427387904: must be at most"),
        (["--sync", "hfa", "--k2", str(2**40)], "--k2 1099511627776: must be at most"),
        (["--sync", "hfa", "--k1", "100000", "--k2", "100000"], "--k1 100000 x --k2 100000"),
        (["--steps", str(2**62)], "--steps 4611686018427387904: must be at most"),
        (["--k1", "2"], "--k1 is for --sync hfa, not --sync fsa: drop --k1"),
        (["--sync", "mixed", "--k2", "2"], "--k2 is for --sync hfa, not --sync mixed"),
        (["--outer-lr", "0.5"], "--outer-lr is for --sync hfa"),
        (["--hfa-weighting", "uniform"], "--hfa-weighting is for --sync hfa"),
        (["--max-staleness", "3"], "--max-staleness is for --sync mixed, not --sync fsa"),
        (["--sync", "hfa", "--max-staleness", "3"], "--max-staleness is for --sync mixed"),
        (["--nesterov", "--momentum", "0"], "--nesterov with --momentum 0"),
        (["--comm-timeout", "1e-9"], "--comm-timeout 1e-09: at least 1 s"),
        (["--comm-timeout", "0.5"], "--comm-timeout 0.5: at least 1 s"),
    ],
)
def test_absurd_values_and_flags_of_another_algorithm_are_one_line(
    argv: list[str], needle: str
) -> None:
    with pytest.raises(ConfigError) as exc:
        cfg(*argv).validate()
    assert needle in one_line(exc)


def test_a_geomx_style_variable_under_another_sync_is_still_accepted() -> None:
    """Only flags given on the command line are refused under another --sync: a job script's
    environment may set HFA's K1 for every algorithm it launches."""
    assert cfg(env={"GEOMPI_HFA_K1": "4"}).validate().k1 == 4


def test_dc_slowdown_of_a_datacenter_that_does_not_exist() -> None:
    c = cfg("--dc-slowdown", "1:3,7:2").validate()  # known once the topology is planned
    c.check_topology(8)
    with pytest.raises(ConfigError) as exc:
        c.check_topology(3)
    assert one_line(exc) == (
        "--dc-slowdown 7:2: there is no datacenter 7; this job has 3, numbered 0 to 2"
    )


def test_plan_topology_refuses_a_slowdown_of_a_missing_datacenter() -> None:
    from types import SimpleNamespace

    from geompi.runtime import plan_topology

    comm = SimpleNamespace(Get_size=lambda: 9)
    assert plan_topology(cfg("--dcs", "2").validate(), comm).num_dcs == 2
    with pytest.raises(ConfigError) as exc:
        plan_topology(cfg("--dcs", "2", "--dc-slowdown", "2:3").validate(), comm)
    assert "no datacenter 2; this job has 2" in one_line(exc)


def test_geompi_max_staleness_is_not_read_so_it_is_refused() -> None:
    """The docs document --max-staleness and geompi.init(max_staleness=...), never this
    variable: a run went ahead unbounded while its user believed the bound was on."""
    with pytest.raises(ConfigError) as exc:
        from_env({"GEOMPI_MAX_STALENESS": "4"})
    assert one_line(exc).startswith("GEOMPI_MAX_STALENESS is not read by geompi: unset it")
    assert "--max-staleness" in str(exc.value)
    assert from_env({"GEOMPI_MAX_STALENESS": ""}) == {"sources": {}}


def test_fault_hooks_are_read_only_in_test_mode() -> None:
    """Issue 35 item 8: GEOMPI_FAULT_KILL_AT and the other test hooks were read in production:
    a variable left in a job's environment killed one of its ranks."""
    from geompi.comm.faults import fault_step

    env = {"GEOMPI_FAULT_KILL_AT": "5:0,3", "GEOMPI_FAULT_NAN_AT": "4"}
    assert fault_step("GEOMPI_FAULT_KILL_AT", 3, env) == -1
    assert fault_step("GEOMPI_FAULT_NAN_AT", 0, env) == -1
    for off in ("0", "", "yes"):
        assert fault_step("GEOMPI_FAULT_KILL_AT", 3, {**env, "GEOMPI_TEST_HOOKS": off}) == -1
    on = {**env, "GEOMPI_TEST_HOOKS": "1"}
    assert fault_step("GEOMPI_FAULT_KILL_AT", 3, on) == 5
    assert fault_step("GEOMPI_FAULT_NAN_AT", 0, on) == 4
    assert fault_step("GEOMPI_FAULT_KILL_AT", 1, on) == -1


def test_epochs_that_come_to_more_steps_than_the_bound_are_refused() -> None:
    """--epochs within its own bound can still make over MAX_STEPS steps of a large dataset."""
    from types import SimpleNamespace

    from geompi.train import Worker

    def worker(epochs: float) -> SimpleNamespace:
        loader = SimpleNamespace(steps_per_epoch=10**4)
        return SimpleNamespace(
            cfg=cfg("--epochs", str(epochs)).validate(),
            loader=loader,
            algo=SimpleNamespace(period=lambda: 1),
        )

    assert Worker._total_steps(worker(1e5)) == 10**9
    with pytest.raises(ConfigError) as exc:
        Worker._total_steps(worker(1e6))
    assert one_line(exc).startswith("--epochs 1e+06 is 10000000000 steps of 10000 per epoch")


def test_torchrun_is_named_as_the_launcher_to_replace():
    """Under torchrun every process is a world of one to MPI: the line says torchrun is the
    problem (it said only that the world was too small for the topology)."""
    from geompi.errors import TopologyError
    from geompi.runtime import check_launcher

    env = {"TORCHELASTIC_RUN_ID": "x", "LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}
    with pytest.raises(TopologyError, match=r"started by torchrun \(WORLD_SIZE=4\).*mpirun -n N"):
        check_launcher(1, env)
    check_launcher(8, env)  # a real MPI world, whatever the variables say
    check_launcher(1, {})  # python script.py alone: the topology's own line follows
