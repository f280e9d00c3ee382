#!/usr/bin/env bash
# rootfs.sh BINARY OUT: lays out in OUT the whole file tree of a poolpilot image, the one both
# images/Containerfile (`make images`, offline) and the Dockerfile (registry hosts) copy onto
# `scratch`:
#   /usr/local/bin/NAME            the binary under its own name (NAME = the file's name)
#   /usr/local/bin/entrypoint      a link to it (an exec-form ENTRYPOINT cannot expand a build arg)
#   /etc/passwd, /etc/group        root and the non-root user and group 65532 "nonroot"
#   /etc/nsswitch.conf             hosts from /etc/hosts, then DNS
#   /etc/ssl/certs/ca-certificates.crt   the host's CA bundle (for HTTPS to a public Prometheus)
#   /tmp                           mode 1777 (empty; the binaries write nothing to disk)
#   and, for a dynamically linked binary, exactly the shared libraries `ldd` resolves, at the
#   paths its loader looks for them (a static binary gets none).
# Everything is owned by root and not writable by 65532; the timestamps are the build's
# (`buildah build --timestamp 0` and `SOURCE_DATE_EPOCH` make the layer reproducible).
set -euo pipefail
bin=${1:?usage: rootfs.sh BINARY OUT}
out=${2:?usage: rootfs.sh BINARY OUT}
name=$(basename "$bin")
rm -rf "$out"
mkdir -p "$out/usr/local/bin" "$out/etc/ssl/certs" "$out/tmp"
chmod 1777 "$out/tmp"
install -m 0755 "$bin" "$out/usr/local/bin/$name"
ln -s "$name" "$out/usr/local/bin/entrypoint"
printf 'root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532:nonroot:/home/nonroot:/sbin/nologin\n' > "$out/etc/passwd"
printf 'root:x:0:\nnonroot:x:65532:\n' > "$out/etc/group"
printf 'hosts: files dns\n' > "$out/etc/nsswitch.conf"
ca=/etc/ssl/certs/ca-certificates.crt
if [ -f "$ca" ]; then
  install -m 0644 "$ca" "$out/etc/ssl/certs/ca-certificates.crt"
else
  echo "rootfs.sh: no $ca (Debian: apt-get install ca-certificates; Alpine: apk add ca-certificates)" >&2
  exit 1
fi
# The loader and the libraries of a dynamic binary: `ldd` prints "lib => /path (addr)" and the
# loader as "/lib64/ld-linux-x86-64.so.2 (addr)"; each goes to the path printed, links resolved.
if ldd "$bin" >/dev/null 2>&1; then
  ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }' | sort -u |
    while read -r lib; do
      mkdir -p "$out$(dirname "$lib")"
      install -m 0755 "$(readlink -f "$lib")" "$out$lib"
    done
fi
