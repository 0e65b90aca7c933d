#!/usr/bin/env bash
# A container engine for the image test (tests/tests/containers.rs) on a machine that has none, as CI:
# podman with runc from Debian's packages, and debootstrap for the image's base (CI reaches Debian's
# archive but no image registry). Its configuration is the project's own, under target/podman/ (vfs
# storage, cgroupfs, and resource limits at or below the host's: a machine that is itself a container
# may not raise them); nothing under /etc is changed. Source it: it exports
# CONTAINERS_CONF and CONTAINERS_STORAGE_CONF, which podman reads instead of the system's.
#   source scripts/install-podman.sh
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
need=()
for c in podman runc debootstrap; do command -v $c >/dev/null || need+=($c); done
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        "${need[@]}" uidmap >&2 || return 1
fi
conf="$repo/target/podman"
mkdir -p "$conf"
nofile=$(ulimit -Hn); [ "$nofile" = unlimited ] || [ "$nofile" -gt 65536 ] && nofile=65536
nproc=$(ulimit -Hu); [ "$nproc" = unlimited ] || [ "$nproc" -gt 16384 ] && nproc=16384
cat > "$conf/containers.conf" <<CONF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=$nproc:$nproc"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
CONF
cat > "$conf/storage.conf" <<CONF
[storage]
driver = "vfs"
runroot = "$conf/run"
graphroot = "$conf/storage"
CONF
export CONTAINERS_CONF="$conf/containers.conf" CONTAINERS_STORAGE_CONF="$conf/storage.conf"
