#!/usr/bin/env bash
# Makes a development CA, a server certificate, worker and admin client certificates and two
# bearer tokens for a TLS / mutual-TLS parameter-server job (docs/security.md). Needs openssl.
#
#   deploy/tls/make-dev-certs.sh [-o DIR] [-s SAN]... [-d DAYS] [-f]
#
#   -o DIR    where to write the files (default: ./certs); created if missing
#   -s SAN    another subjectAltName of the server certificate, openssl syntax, repeatable:
#             -s DNS:ps-0.ps.default.svc -s 'DNS:*.ps.default.svc.cluster.local' -s IP:10.0.0.5
#             (always included: DNS:localhost, IP:127.0.0.1, IP:::1)
#   -d DAYS   validity of every certificate (default: 365)
#   -f        overwrite files that already exist (default: refuse)
#
# Writes, in DIR:
#   ca.crt                      the CA: give it to servers (--tls-client-ca) and workers (--tls-ca)
#   ca.key                      the CA's key: only needed to sign more certificates; keep it away from pods
#   server.crt, server.key      the shards' certificate (--tls-cert, --tls-key); CN/OU ps-server
#   worker.crt, worker.key      a client certificate with OU=ps-worker: the worker role under mTLS
#   admin.crt, admin.key        a client certificate with OU=ps-admin: the admin role under mTLS
#   worker.token, admin.token   random bearer tokens (--auth-token-file, --admin-token-file)
# Keys and tokens are written mode 0600. These are for development and tests: EC P-256 keys
# without a passphrase, one CA for everything. Use your own PKI in production.
set -euo pipefail

out=certs
days=365
force=0
sans=("DNS:localhost" "IP:127.0.0.1" "IP:::1")

usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//'; }

while getopts "o:s:d:fh" opt; do
  case "$opt" in
    o) out=$OPTARG ;;
    s) sans+=("$OPTARG") ;;
    d) days=$OPTARG ;;
    f) force=1 ;;
    h) usage; exit 0 ;;
    *) usage >&2; exit 2 ;;
  esac
done
shift $((OPTIND - 1))
if [ $# -gt 0 ]; then
  echo "make-dev-certs.sh: unexpected argument: $1" >&2; usage >&2; exit 2
fi
if ! [[ "$days" =~ ^[1-9][0-9]*$ ]]; then
  echo "make-dev-certs.sh: invalid -d $days (a whole number of days >= 1)" >&2; exit 2
fi
command -v openssl >/dev/null || { echo "make-dev-certs.sh: openssl not found on PATH" >&2; exit 1; }

files=(ca.crt ca.key server.crt server.key worker.crt worker.key admin.crt admin.key worker.token admin.token)
mkdir -p "$out"
if [ "$force" -eq 0 ]; then
  for f in "${files[@]}"; do
    if [ -e "$out/$f" ]; then
      echo "make-dev-certs.sh: $out/$f exists; pass -f to overwrite" >&2; exit 1
    fi
  done
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
umask 077

newkey() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

# sign NAME OU EXTENDED_KEY_USAGE [SAN]: NAME.key and NAME.crt signed by the CA
sign() {
  local name=$1 ou=$2 eku=$3 san=${4:-}
  newkey "$work/$name.key"
  openssl req -new -key "$work/$name.key" -subj "/O=onnx-ps dev/OU=$ou/CN=$ou" -out "$work/$name.csr"
  {
    echo "basicConstraints = critical, CA:FALSE"
    echo "keyUsage = critical, digitalSignature, keyEncipherment"
    echo "extendedKeyUsage = $eku"
    echo "subjectKeyIdentifier = hash"
    echo "authorityKeyIdentifier = keyid"
    if [ -n "$san" ]; then echo "subjectAltName = $san"; fi
  } >"$work/$name.ext"
  openssl x509 -req -in "$work/$name.csr" -CA "$work/ca.crt" -CAkey "$work/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -sha256 -extfile "$work/$name.ext" \
    -out "$work/$name.crt" 2>/dev/null
}

newkey "$work/ca.key"
openssl req -x509 -new -key "$work/ca.key" -sha256 -days "$days" \
  -subj "/O=onnx-ps dev/CN=onnx-ps development CA" \
  -addext "basicConstraints = critical, CA:TRUE, pathlen:0" \
  -addext "keyUsage = critical, keyCertSign, cRLSign" \
  -addext "subjectKeyIdentifier = hash" \
  -out "$work/ca.crt"

san_list=$(IFS=,; echo "${sans[*]}")
sign server ps-server serverAuth "$san_list"
sign worker ps-worker clientAuth
sign admin ps-admin clientAuth

openssl rand -hex 32 >"$work/worker.token"
openssl rand -hex 32 >"$work/admin.token"

for f in server worker admin; do
  openssl verify -CAfile "$work/ca.crt" "$work/$f.crt" >/dev/null
done

for f in "${files[@]}"; do
  cp "$work/$f" "$out/$f"
  case "$f" in *.crt) chmod 0644 "$out/$f" ;; *) chmod 0600 "$out/$f" ;; esac
done
echo "make-dev-certs.sh: wrote ${files[*]} to $out (server names: $san_list; valid $days days)"
