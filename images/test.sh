#!/usr/bin/env bash
# test.sh REPO TAG: the smoke test of the images `make images` built (`make image-test`, part of
# `make test`). Run in a network namespace of its own (`unshare --net`): the containers share it
# (`--network host`), so their ports are on this namespace's loopback and nowhere else.
#
# For each image it checks what production relies on:
#   - the file tree is exactly what images/rootfs.sh lays out for its binary, the config runs
#     as 65532:65532 with `/usr/local/bin/entrypoint`, and the OCI labels are set;
#   - under `podman run --read-only --user 65532 --ulimit nofile=N:N` the process is PID 1 of
#     its PID namespace, runs as uid 65532 on a read-only root, answers its health endpoint and
#     reports N as `process_max_fds` (the limit the operator's fd check reads);
#   - SIGTERM to PID 1 (which has no default signal actions) stops it with status 0, within the
#     grace that `podman stop` would give before SIGKILL.
# The operator needs a cluster to serve /healthz (it lists its policies first): here it shows its
# version and, without one, exits at once naming the missing configuration; the e2e tests run it
# on the real node (e2e/tests/cluster/node.rs).
# And the Dockerfile's last stage must be images/Containerfile, line for line.
set -euo pipefail
repo=${1:?usage: test.sh REPO TAG}
tag=${2:?usage: test.sh REPO TAG}
here=$(cd "$(dirname "$0")" && pwd)
ip link set lo up
fds=1024
failures=0
fail() { echo "FAIL: $*" >&2; failures=$((failures + 1)); }
ok() { echo "ok: $*"; }

# The Dockerfile's stage after its last FROM and images/Containerfile, without comments and with
# the one COPY that differs (from the build stage there, from the build context here) aligned.
stage() { sed -e 's/#.*//' -e '/^[[:space:]]*$/d' "$1" | awk '/^FROM /{buf=""} {buf=buf $0 "\n"} END{printf "%s", buf}'; }
if diff <(stage "$here/Containerfile") <(stage "$here/../Dockerfile" | sed 's|^COPY --from=build /rootfs/ /|COPY rootfs/ /|'); then
  ok "the Dockerfile's last stage is images/Containerfile"
else
  fail "the Dockerfile's last stage differs from images/Containerfile (above)"
fi

# The image's file tree against what rootfs.sh lays out for the binary the image carries.
tree_check() {
  local ref=$1 bin=$2 cid want got tmp
  tmp=$(mktemp -d)
  cid=$(podman create "$ref")
  podman cp "$cid:/usr/local/bin/$bin" "$tmp/$bin"
  podman export "$cid" | tar -t | sed -e 's|^\./||' -e 's|/$||' | grep -v '^$' | sort > "$tmp/got"
  podman rm "$cid" >/dev/null
  "$here/rootfs.sh" "$tmp/$bin" "$tmp/rootfs"
  (cd "$tmp/rootfs" && find . -mindepth 1 | sed 's|^\./||' | sort) > "$tmp/want"
  if diff "$tmp/want" "$tmp/got" >/dev/null; then
    ok "$ref: file tree = rootfs.sh's ($(wc -l < "$tmp/got") entries)"
  else
    diff "$tmp/want" "$tmp/got" || true
    fail "$ref: file tree differs from rootfs.sh's (above: < expected, > in the image)"
  fi
  rm -rf "$tmp"
}

config_check() {
  local ref=$1 bin=$2 user entry title rev
  user=$(podman image inspect -f '{{.Config.User}}' "$ref")
  entry=$(podman image inspect -f '{{join .Config.Entrypoint " "}}' "$ref")
  title=$(podman image inspect -f '{{index .Labels "org.opencontainers.image.title"}}' "$ref")
  rev=$(podman image inspect -f '{{index .Labels "org.opencontainers.image.revision"}}' "$ref")
  [ "$user" = 65532:65532 ] && [ "$entry" = /usr/local/bin/entrypoint ] && [ "$title" = "$bin" ] && [ -n "$rev" ] \
    && ok "$ref: user $user, entrypoint $entry, title $title, revision $rev" \
    || fail "$ref: user '$user', entrypoint '$entry', title '$title', revision '$rev'"
}

# Waits up to 20 s for URL to answer 200.
wait_http() {
  local url=$1
  for _ in $(seq 1 80); do
    curl -fsS -o /dev/null --max-time 1 "$url" 2>/dev/null && return 0
    sleep 0.25
  done
  return 1
}

# run_check REF HEALTH_URL METRICS_URL ARGS...: the container's process, health, fd limit, SIGTERM.
run_check() {
  local ref=$1 health=$2 metrics=$3 cid pid uid nspid root maxfds status t0 t1
  shift 3
  # podman sets the limits the command line does not name to its defaults (nproc 1048576 for
  # root), which a process without CAP_SYS_RESOURCE cannot raise to: nproc is set lower.
  cid=$(podman run -d --read-only --user 65532 --network host --ulimit nofile=$fds:$fds --ulimit nproc=4096:4096 "$@")
  pid=$(podman inspect -f '{{.State.Pid}}' "$cid")
  if [ -z "$pid" ] || [ "$pid" = 0 ]; then
    podman logs "$cid" >&2 || true
    fail "$ref: did not start"
    podman rm -f "$cid" >/dev/null
    return
  fi
  uid=$(awk '/^Uid:/ {print $2 ":" $3}' "/proc/$pid/status")
  nspid=$(awk '/^NSpid:/ {print $NF}' "/proc/$pid/status")
  root=$(awk '$5 == "/" {print $6}' "/proc/$pid/mountinfo" | cut -d, -f1)
  [ "$uid" = 65532:65532 ] && [ "$nspid" = 1 ] && [ "$root" = ro ] \
    && ok "$ref: PID 1 of its namespace, uid $uid, root fs $root" \
    || fail "$ref: uid '$uid' (want 65532:65532), pid in its namespace '$nspid' (want 1), root fs '$root' (want ro)"
  if wait_http "$health"; then
    ok "$ref: $health answers 200"
  else
    podman logs "$cid" >&2 || true
    fail "$ref: $health does not answer 200"
  fi
  maxfds=$(curl -fsS --max-time 2 "$metrics" | awk '$1 == "process_max_fds" {print $2}')
  [ "$maxfds" = "$fds" ] && ok "$ref: process_max_fds $maxfds" || fail "$ref: process_max_fds '$maxfds', want $fds"
  t0=$(date +%s%N)
  podman kill --signal TERM "$cid" >/dev/null
  status=$(timeout 30 podman wait "$cid" || echo timeout)
  t1=$(date +%s%N)
  [ "$status" = 0 ] && ok "$ref: SIGTERM → exit 0 in $(( (t1 - t0) / 1000000 )) ms" \
    || { podman logs "$cid" >&2 || true; fail "$ref: SIGTERM → '$status' (want exit 0 within 30 s)"; }
  podman rm -f "$cid" >/dev/null
}

conf=$(mktemp -d)
trap 'rm -rf "$conf"' EXIT
chmod 0755 "$conf"
cat > "$conf/gateway.yaml" <<'YAML'
listeners: {proxy: '127.0.0.1:18080', admin: '127.0.0.1:19901'}
adminTokenFile: /etc/poolpilot/token
limitsFile: /etc/poolpilot/limits.json
shutdownDelay: 200ms
drainGrace: 2s
YAML
echo 'image-test-admin-token-of-32-bytes-or-more' > "$conf/token"
echo '{}' > "$conf/limits.json"
chmod 0644 "$conf"/*

gateway=$repo/gateway:$tag
tree_check "$gateway" poolpilot-gateway
config_check "$gateway" poolpilot-gateway
run_check "$gateway" http://127.0.0.1:19901/healthz http://127.0.0.1:19901/metrics \
  -v "$conf:/etc/poolpilot:ro" "$gateway" --config=/etc/poolpilot/gateway.yaml
# The binary under its own name, as `kubectl exec ... -- poolpilot-gateway validate` runs it.
if podman run --rm --read-only --user 65532 --network none -v "$conf:/etc/poolpilot:ro" \
  --entrypoint /usr/local/bin/poolpilot-gateway "$gateway" validate --config=/etc/poolpilot/gateway.yaml >/dev/null; then
  ok "$gateway: poolpilot-gateway validate"
else
  fail "$gateway: poolpilot-gateway validate failed"
fi

modelsim=$repo/modelsim:$tag
tree_check "$modelsim" modelsim
config_check "$modelsim" modelsim
run_check "$modelsim" http://127.0.0.1:18001/health http://127.0.0.1:18001/metrics \
  "$modelsim" --listen=127.0.0.1:18000 --admin-listen=127.0.0.1:18001 --model=model-a

operator=$repo/operator:$tag
tree_check "$operator" poolpilot-operator
config_check "$operator" poolpilot-operator
version=$(podman run --rm --read-only --user 65532 --network none "$operator" --version)
[ -n "$version" ] && ok "$operator: --version: $version" || fail "$operator: --version printed nothing"
t0=$(date +%s)
if out=$(timeout 30 podman run --rm --read-only --user 65532 --network host "$operator" 2>&1); then
  fail "$operator: exited 0 without a cluster"
elif [ $(( $(date +%s) - t0 )) -ge 30 ]; then
  fail "$operator: still running after 30 s without a cluster"
else
  ok "$operator: without a cluster, exits at once: $(echo "$out" | grep -m1 -i error | cut -c1-160)"
fi

if [ "$failures" -gt 0 ]; then
  echo "image test: $failures failure(s)" >&2
  exit 1
fi
echo "image test: all checks passed"
