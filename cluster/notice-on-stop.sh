#!/bin/bash
# This node is going (a Kubernetes pod's preStop hook; an instance shutting down, through the
# systemd unit aws.yaml and gcp.yaml install): tell the node's rayllm interruption watcher
# (rayllm/runtime/interruption.py reads RAYLLM_INTERRUPTION_FILE), then wait until the node's
# training workers have checkpointed and left, at most RAYLLM_STOP_WAIT_S seconds. Only then
# may the node's own stop go on: Ray's processes never see the container's SIGTERM in time.
#   notice-on-stop.sh [WHY]
file="${RAYLLM_INTERRUPTION_FILE:-/tmp/rayllm/interruption-notice}"
mkdir -p "$(dirname "$file")"
echo "${1:-this node is being stopped} ($(hostname), $(date -u +%Y-%m-%dT%H:%M:%SZ))" > "$file.tmp"
mv "$file.tmp" "$file"  # whole or absent: the watcher never reads half a notice
deadline=$((SECONDS + ${RAYLLM_STOP_WAIT_S:-280}))
while pgrep -f RayTrainWorker > /dev/null && [ "$SECONDS" -lt "$deadline" ]; do
  sleep 1
done
if pgrep -f RayTrainWorker > /dev/null; then
  echo "rayllm: training workers still on this node after ${RAYLLM_STOP_WAIT_S:-280} s; stopping anyway" >&2
fi
exit 0
