#!/usr/bin/env bash
# The README's first command. Installs what is missing, builds ctorchrun and ctorch-train, then trains
# the seeds' MNIST CNN on Fashion-MNIST (Debian's dataset-fashion-mnist) with 2 workers under
#   ctorchrun --standalone --nproc-per-node 2 ctorch-train ...
# showing progress and test accuracy. Everything it writes goes to ./demo-run/ (snapshot.pt, the
# epoch-boundary snapshot, model.pt, metrics.jsonl, metrics.png).
#
# Run it again to see resuming: an interrupted run (Ctrl-C, SIGTERM) continues exactly where its
# snapshot stopped; a finished one trains one more epoch from its snapshot. `rm -rf demo-run` starts
# over. Environment: CTORCH_DEMO_EPOCHS (default 3), CTORCH_DEMO_DIR (default ./demo-run), and any
# extra arguments are passed to ctorch-train (e.g. scripts/demo.sh --train-limit 6000).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${CTORCH_DEMO_DIR:-$PWD/demo-run}
epochs=${CTORCH_DEMO_EPOCHS:-3}
python=/usr/bin/python3  # Debian's python3-torch (the python3 on PATH may have no torch)

say() { printf '\n== %s\n' "$*"; }

say "setup and build (scripts/setup.sh, scripts/build.sh --target ctorchrun ctorch-train)"
"$root/scripts/setup.sh"
"$root/scripts/build.sh" --target ctorchrun ctorch-train
build=${CTORCH_BUILD_DIR:-$root/build}
ctorchrun=$build/launcher/agent/ctorchrun
train=$build/trainer/app/ctorch-train
mkdir -p "$run"
cd "$run"

has_torch=0
"$python" -c "import torch" 2>/dev/null && has_torch=1
snapshot_line="$python -c \"import torch; s = torch.load('$run/snapshot.pt'); print(s['EPOCHS_RUN'], s['GLOBAL_STEP'], list(s['MODEL_STATE']))\""

if [ -f snapshot.pt ]; then
  done_epochs=""
  if [ $has_torch = 1 ]; then
    done_epochs=$("$python" -c "import torch; print(torch.load('snapshot.pt')['EPOCHS_RUN'])" 2>/dev/null || true)
  fi
  if [ -n "$done_epochs" ] && [ "$done_epochs" -ge "$epochs" ]; then
    epochs=$((done_epochs + 1))
    say "$run/snapshot.pt holds $done_epochs finished epochs: resuming from it to train epoch $epochs (ctorch-train's default --resume auto loads the newest valid snapshot)"
  else
    say "$run/snapshot.pt found: this run resumes from it, exactly where it stopped (ctorch-train's default --resume auto)"
  fi
else
  say "no snapshot in $run yet: training from scratch ($epochs epochs); interrupt with Ctrl-C at any time and run scripts/demo.sh again to resume"
fi

say "ctorchrun --standalone --nproc-per-node 2 ctorch-train --epochs $epochs $*"
interrupted=0
trap 'interrupted=1' INT TERM  # a handler, not an ignore: the workers keep the default dispositions
status=0
"$ctorchrun" --standalone --nproc-per-node 2 "$train" --epochs "$epochs" "$@" || status=$?
trap - INT TERM

if [ $status -ne 0 ]; then
  if [ $interrupted = 1 ] || [ $status -eq 75 ] || [ $status -eq 130 ] || [ $status -eq 143 ]; then
    say "stopped (exit $status): the workers wrote $run/snapshot.pt; run scripts/demo.sh again to resume from it"
  else
    say "training failed (exit $status); see the summary above"
  fi
  exit $status
fi

say "outputs in $run: $(ls | tr '\n' ' ')"
say "the snapshot opens in Python:"
echo "$snapshot_line"
if [ $has_torch = 1 ]; then
  "$python" -c "import torch; s = torch.load('snapshot.pt'); print('EPOCHS_RUN', s['EPOCHS_RUN'], 'GLOBAL_STEP', s['GLOBAL_STEP'], 'MODEL_STATE', list(s['MODEL_STATE']))"
fi
if "$python" -c "import matplotlib" 2>/dev/null; then
  "$python" "$root/scripts/plot_metrics.py" metrics.jsonl -o metrics.png
fi
say "run scripts/demo.sh again to resume from the snapshot and train one more epoch; rm -rf $run to start over"
