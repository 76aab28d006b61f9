#!/usr/bin/env bash
# Makes what docker/compose.yaml mounts as secrets, in DIR (default docker/secrets):
#   cluster-ca.pem (+ cluster-ca.key, kept here to sign more)  the cluster CA
#   cluster.pem cluster.key   a certificate for the name meshd-cluster (client and
#                             server use) that the server and the agents share
#   join-token                a random token agents present to register
# Valid 365 days. Needs the openssl CLI. Keeps existing files unless --force.
# Compose (without swarm) mounts these files with their host modes, and the
# containers run as uid 10001: the certificate, key and token are made readable
# to all on this host (mode 0644). For anything beyond one machine, use your
# orchestrator's secrets (docs/operations.md "Cluster security").
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$here/secrets
force=0
for a in "$@"; do
  case $a in
    --force) force=1 ;;
    *) dir=$a ;;
  esac
done
mkdir -p "$dir"
cd "$dir"
if [[ -e join-token && $force == 0 ]]; then
  echo "$dir already holds secrets (--force to replace them)"
  exit 0
fi
umask 077
openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 365 \
  -subj "/CN=meshd cluster CA" -keyout cluster-ca.key -out cluster-ca.pem \
  -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
  2>/dev/null
openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=meshd-cluster" \
  -keyout cluster.key -out cluster.csr 2>/dev/null
printf 'subjectAltName=DNS:meshd-cluster\nextendedKeyUsage=serverAuth,clientAuth\nbasicConstraints=CA:FALSE\n' \
  > cluster.ext
openssl x509 -req -in cluster.csr -CA cluster-ca.pem -CAkey cluster-ca.key -CAcreateserial \
  -days 365 -extfile cluster.ext -out cluster.pem 2>/dev/null
rm -f cluster.csr cluster.ext cluster-ca.srl
openssl rand -hex 32 > join-token
chmod 644 cluster-ca.pem cluster.pem cluster.key join-token
echo "$dir"
