#!/usr/bin/env bash
# Container entry point: run the trainer under `spotckpt launch` (torch's elastic launcher,
# torchrun, with exit statuses a scheduler can act on; see spotckpt/launch.py) so that a stop
# signal reaches every worker, the workers get the time their emergency save needs, and the
# container's exit status tells the scheduler what to do:
#   0   training finished
#   75  preempted: a checkpoint was (or was being) saved; start the job again to resume
#   other  a crash (the failed worker's own status, 1 if it was killed): counts against the
#          scheduler's retry limit
#
# Signal path: docker stop / kubelet / systemd -> tini (PID 1) -> this script, which `exec`s the
# launcher, so the launcher *is* this process -> torchrun's agent (inside the launcher) forwards
# the signal to each worker's process group -> the trainer's PreemptionWatcher flags it, the
# training loop saves, and the worker exits 75. The launcher forwards SIGTERM, SIGINT, SIGHUP,
# SIGQUIT and SIGUSR1 (what SLURM and some schedulers send ahead of a stop) by default.
#
# Timing chain (every link must be longer than the one before it):
#   SPOTCKPT_SAVE_BUDGET_S                    seconds the trainer's emergency save may take
#   + LAUNCH_EXIT_MARGIN_S                    seconds for a worker to exit after its save
#   = --shutdown-timeout                      the launcher SIGKILLs workers this long after
#                                             forwarding (spotckpt launch's own default: the
#                                             budget + 5 s; torchrun's: 30 s whatever the save
#                                             needs); set here so that the margin can change
#   + a few seconds for the launcher to exit
#   <= the caller's stop timeout              Kubernetes terminationGracePeriodSeconds,
#                                             `docker run --stop-timeout`, systemd TimeoutStopSec
#
# Arguments: the training command, which is the image's CMD (or Kubernetes `args`):
#   SCRIPT [ARGS...]           run that Python script, e.g. /app/train.py --epochs 3
#   -m MODULE [ARGS...]        run a module, e.g. -m mytrainer.main --epochs 3 (on PYTHONPATH)
#   [ARGS...]                  only options, or nothing: the default script, with these arguments
# Environment (all optional). The entry point's own variables are LAUNCH_*, not SPOTCKPT_*:
# spotckpt's Config rejects SPOTCKPT_* names it does not know, and the workers inherit this
# environment.
#   SPOTCKPT_URI             checkpoint root, read by the trainer (s3://, gs://, file://, path)
#   SPOTCKPT_SAVE_BUDGET_S   emergency save budget in seconds (default 25, as the trainer's)
#   LAUNCH_EXIT_MARGIN_S     see above (default 5)
#   LAUNCH_NPROC_PER_NODE    worker processes (default: one per visible GPU, else 1)
#   LAUNCH_TORCHRUN_ARGS     rendezvous (torchrun) options for the launcher (default: --standalone);
#                            the multi-node JobSets build it from LAUNCH_NNODES, LAUNCH_RDZV_HOST
#                            and LAUNCH_RESTART_ATTEMPT, the SkyPilot task from SKYPILOT_* variables
#   LAUNCH_TRAIN_SCRIPT      the default script, when the arguments name none (default: train.py
#                            beside this file, else ../examples/train.py, as in the repository)
#   LAUNCH_PYTHON            the interpreter that runs the launcher, `python3 -m spotckpt.launch`,
#                            and the workers (default: python3)
#   LAUNCH_DRY_RUN=1         print the command, one argument per line, and exit 0
set -euo pipefail

die() {
	echo "entrypoint: $*" >&2
	exit 2
}

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# Whole seconds, rounded up, so "12.5" gives 13.
ceil_seconds() {
	local name="$1" value="$2"
	[[ $value =~ ^([0-9]+)(\.([0-9]+))?$ ]] || die "$name must be a number of seconds, got '$value'"
	local whole=$((10#${BASH_REMATCH[1]}))
	if [[ -n ${BASH_REMATCH[3]:-} && ${BASH_REMATCH[3]} =~ [1-9] ]]; then
		whole=$((whole + 1))
	fi
	echo "$whole"
}

export SPOTCKPT_SAVE_BUDGET_S="${SPOTCKPT_SAVE_BUDGET_S:-25}"
budget="$(ceil_seconds SPOTCKPT_SAVE_BUDGET_S "$SPOTCKPT_SAVE_BUDGET_S")"
margin="$(ceil_seconds LAUNCH_EXIT_MARGIN_S "${LAUNCH_EXIT_MARGIN_S:-5}")"
shutdown_timeout=$((budget + margin))

nproc="${LAUNCH_NPROC_PER_NODE:-}"
if [[ -z $nproc ]]; then
	nproc=0
	if command -v nvidia-smi >/dev/null 2>&1; then
		nproc="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
	fi
	[[ $nproc -gt 0 ]] || nproc=1
fi
[[ $nproc =~ ^[1-9][0-9]*$ ]] || die "LAUNCH_NPROC_PER_NODE must be a positive integer, got '$nproc'"

# The training program: a module (-m NAME), a script named by the first argument, or the default.
if [[ ${1:-} == -m ]]; then
	[[ -n ${2:-} ]] || die "-m needs a module name"
	program=(-m "$2")
	shift 2
else
	if [[ $# -gt 0 && $1 != -* ]]; then
		script="$1"
		shift
	else
		script="${LAUNCH_TRAIN_SCRIPT:-}"
		if [[ -z $script ]]; then
			if [[ -f $here/train.py ]]; then
				script="$here/train.py"
			else
				script="$here/../examples/train.py"
			fi
		fi
	fi
	[[ -f $script ]] || die "training script not found: $script"
	program=("$script")
fi

# Word splitting is intended: the variable holds several launcher (torchrun) options.
# shellcheck disable=SC2206
rdzv=(${LAUNCH_TORCHRUN_ARGS:---standalone})

cmd=(
	"${LAUNCH_PYTHON:-python3}" -m spotckpt.launch
	"${rdzv[@]}"
	--nproc-per-node="$nproc"
	--max-restarts=0
	--shutdown-timeout="$shutdown_timeout"
	"${program[@]}" "$@"
)

if [[ ${LAUNCH_DRY_RUN:-0} == 1 ]]; then
	printf '%s\n' "${cmd[@]}"
	exit 0
fi

echo "entrypoint: save budget ${budget}s, launcher shutdown timeout ${shutdown_timeout}s," \
	"$nproc worker(s), running ${program[*]}" >&2
# exec: no shell stays in between to swallow the stop signal.
exec "${cmd[@]}"
