#!/usr/bin/env bash
# One training run over several hosts: run this same line on every host, each with its own PROCESS_ID (0 first).
# Process 0 is the coordinator and writes the checkpoints, logs and the head; every host reads the same CONFIG and
# sees the same output_dir (a shared file system or bucket). On a Cloud TPU pod, SLURM or Kubernetes leave
# COORDINATOR empty: jax.distributed finds the coordinator, the process count and each index by itself.
#
# Usage: COORDINATOR=10.0.0.1:1234 NUM_PROCESSES=2 PROCESS_ID=0 train/launch_multihost.sh CONFIG [section.key=value ...]
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
DISTRIBUTED=()
if [[ -n "${COORDINATOR:-}" ]]; then
  DISTRIBUTED=(distributed.coordinator="$COORDINATOR" distributed.num_processes="${NUM_PROCESSES:?}"
               distributed.process_id="${PROCESS_ID:?}")
fi
exec specjax-train --config "$CONFIG" "${DISTRIBUTED[@]}" "$@"
