#!/bin/sh
# Installs the Debian packages ember needs to build and test, if any are
# missing. As root it installs them with apt-get; otherwise it prints the
# command to run and fails.
set -e
packages="build-essential cmake pkg-config libcmocka-dev libpcre2-dev libcjson-dev libmicrohttpd-dev libssl-dev libxxhash-dev libyaml-dev prometheus groff-base man-db chromium libedit-dev libzmq3-dev libmsgpack-dev libhiredis-dev redis-server"
missing=""
for p in $packages; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
# The npm client test needs node and npm; any install of them will do (the
# machine may carry a newer Node.js than Debian's), so only check commands.
command -v npm >/dev/null 2>&1 || missing="$missing nodejs npm"
[ -z "$missing" ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
    echo "ember: missing Debian packages:$missing" >&2
    echo "ember: run as root: apt-get install -y$missing" >&2
    exit 1
fi
echo "ember: installing$missing" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq $missing >/dev/null
