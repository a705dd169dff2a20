#!/usr/bin/env bash
# CI's guard against tests that pass only on a quiet machine (issues 33, 40 and 57), everything with
# busy loops beside it (scripts/with-load.sh):
#  1. the multi-process tests (CTest labels ddp, sharding, parameter_server, resilience, trainer,
#     pipeline: real ranks, real TCPStore and Gloo on loopback) with one busy loop per core and the
#     port churner (loopback connections opened and closed as fast as it can: a port picked by
#     bind-and-close is taken before its server binds it). CI runs them here instead of in the quiet
#     pass (.ci/run: scripts/test.sh -LE "$CTORCH_MULTIPROCESS_LABELS"): each test once per lane.
#  2. the scheduling-sensitive rendezvous simulation (its virtual clock) 5 times, one busy loop per core;
#  3. in-place recovery's chaos suites with four busy loops per core — 2 and 3 ranks on one host, and 3
#     hosts in the network-namespace lab (skipped where the lab cannot be made): every job is kept and
#     ends bit-identical (other seeds than the quiet pass's chaos tests).
# Usage: scripts/load-guard.sh [build dir] [parts: multiprocess,simulation,chaos]
# CTORCH_LOAD_BUSY_AFTER=FILE: other work keeps the cores busy until FILE exists (CI: the modern
# lane's build and the fuzz targets); the busy loops of parts 1 and 2 only start then
# (scripts/with-load.sh --busy-after). Part 3's loops always run.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:-${CTORCH_BUILD_DIR:-$root/build}}" && pwd)
parts=${2:-multiprocess,simulation,chaos}
labels=${CTORCH_MULTIPROCESS_LABELS:-^(ddp|sharding|parameter_server|resilience|trainer|pipeline)$}
load=("$root/scripts/with-load.sh")
topped=()
[ -z "${CTORCH_LOAD_BUSY_AFTER:-}" ] || topped=(--busy-after "$CTORCH_LOAD_BUSY_AFTER")
cd "$build"

case ",$parts," in *,multiprocess,*)
  "${load[@]}" --busy-per-core 1 --churn "${topped[@]}" -- \
    ctest --output-on-failure --parallel "${CTORCH_TEST_JOBS:-$(( 3 * $(nproc) ))}" --timeout 600 -L "$labels"
esac

case ",$parts," in *,simulation,*)
  "${load[@]}" --busy-per-core 1 "${topped[@]}" -- \
    ctest --output-on-failure -R "rendezvous simulation" --repeat until-fail:5 --timeout 120
esac

case ",$parts," in *,chaos,*)
  python=/usr/bin/python3
  if ! { [ -x "$python" ] && "$python" -c 'import torch' 2>/dev/null && [ -x "$build/trainer/app/ctorch-train" ]; }; then
    echo "load-guard: in-place recovery under load skipped (needs Debian's python3-torch and ctorch-train)"
    exit 0
  fi
  chaos=("$python" "$root/scripts/chaos/chaos.py" --ctorchrun "$build/launcher/agent/ctorchrun"
         --trainer "$build/trainer/app/ctorch-train" --reference-cache "$build/chaos-references")
  "${load[@]}" --busy-per-core 4 -- "${chaos[@]}" --suite inplace --only synthetic --seed 3
  "${load[@]}" --busy-per-core 4 -- "${chaos[@]}" --suite nodes-inplace --seed 3
esac
