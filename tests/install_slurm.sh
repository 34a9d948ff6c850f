#!/usr/bin/env bash
# Installs what tests/test_slurm.py needs: Debian's slurm-wlm (slurmctld, slurmd, clients) and munge.
# Needs root and apt; without them the test skips and says why. Nothing is configured or started
# here: the test runs its own daemons from a temporary folder.
set -euo pipefail
if command -v sbatch >/dev/null && command -v slurmctld >/dev/null && command -v munged >/dev/null; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "install_slurm.sh: needs root and apt-get; tests/test_slurm.py will skip" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq slurm-wlm munge >/dev/null
