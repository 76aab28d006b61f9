#!/usr/bin/env bash
# Makes a throwaway PKI for the TLS tests in DIR (default: a new temp dir, printed):
#   ca.pem ca.key                     the client-facing CA
#   server.pem server.key             server cert: localhost, 127.0.0.1, ::1
#   client.pem client.key             a client cert signed by ca (CN=alice)
#   cluster-ca.pem                    the cluster CA (server <-> agents)
#   cluster.pem cluster.key           a cluster cert: SAN meshd-cluster, localhost, 127.0.0.1
#   rogue-ca.pem rogue.pem rogue.key  a CA nobody trusts and a cert it signed (same names)
#   stranger.pem stranger.key         a cert the cluster CA signed for another name (alice)
# EC P-256 keys, valid for 2 days. Needs the openssl CLI.
set -euo pipefail
dir=${1:-$(mktemp -d)}
mkdir -p "$dir"
cd "$dir"
umask 077

ca() { # name subject
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 \
    -subj "/CN=$2" -keyout "$1.key" -out "$1.pem" \
    -addext basicConstraints=critical,CA:TRUE -addext keyUsage=critical,keyCertSign,cRLSign \
    2>/dev/null
}
leaf() { # name ca cn san usage
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$3" \
    -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$4" "$5" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA "$2.pem" -CAkey "$2.key" -CAcreateserial -days 2 \
    -extfile "$1.ext" -out "$1.pem" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

ca ca "meshd test CA"
ca cluster-ca "meshd test cluster CA"
ca rogue-ca "rogue CA"
leaf server ca "meshd server" "DNS:localhost,IP:127.0.0.1,IP:::1" serverAuth
leaf client ca "alice" "DNS:alice" clientAuth
leaf cluster cluster-ca "meshd-cluster" "DNS:meshd-cluster,DNS:localhost,IP:127.0.0.1" \
  serverAuth,clientAuth
leaf rogue rogue-ca "meshd-cluster" "DNS:meshd-cluster,DNS:localhost,IP:127.0.0.1" \
  serverAuth,clientAuth
leaf stranger cluster-ca "alice" "DNS:alice" serverAuth,clientAuth
rm -f ./*.srl
chmod 644 ./*.pem
echo "$dir"
