#!/usr/bin/env bash
# Builds the gateway's container image (Dockerfile) without a Docker daemon or a registry, then runs
# it and checks that it answers: Debian's buildah (vfs storage, chroot isolation) over a base image
# made here with mmdebstrap (Debian bookworm minbase + Python 3.11), so only a Debian mirror and
# PyPI need to be reachable. Run as root: sudo scripts/build-image.sh
#
# Steps: 1. install buildah and mmdebstrap with apt-get if missing; 2. make the base image (once;
# --rebuild-base makes it again); 3. stage a clean build context (the files git tracks or would
# track, never .venv) and, unless --no-seed, seed it with this host's setup cache ($GATEWAY_CACHE,
# filled by scripts/setup.sh on the same Debian bookworm + Python 3.11): the llama.cpp libraries,
# llama-server and the Python-only llama-cpp-python wheel built for this CPU's flags and the
# verified model files, so the image build compiles nothing again (without a usable cache it
# compiles llama.cpp once from the pinned sdist: about 7 minutes on 2 cores); 4. buildah bud;
# 5. unless --no-check, run the image as its user, wait for its health check, send one chat
# completion (demo key, alias smollm2-routed, every step routed to the embedded llama-server
# upstream) and stop it.
#
# The last lines are machine-readable: "RESULT key=value" for build_s, size_bytes, health, chat.
# The Debian mirror is the one this machine's apt uses (its sources.list and sources.list.d, one-line
# or deb822, as apt itself reads them): the archive that serves bookworm, and the security archive
# that serves bookworm-security (else the archive's /debian-security). --sources prints the apt
# lines the base is made from and exits.
# Environment: IMAGE (default localhost/routing-gateway:latest), BASE_IMAGE (default
#   localhost/routing-gateway-base:bookworm, made here), MIRROR (instead of apt's sources: a host
#   serving /debian and /debian-security: MIRROR=http://<host>), GATEWAY_CACHE (default
#   ~/.cache/routing-gateway), LLAMA_CMAKE_ARGS (default: this CPU's flags), STORAGE_DRIVER
#   (default vfs), CHECK_TIMEOUT_S (default 300).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${IMAGE:-localhost/routing-gateway:latest}
BASE_IMAGE=${BASE_IMAGE:-localhost/routing-gateway-base:bookworm}
CACHE=${GATEWAY_CACHE:-$HOME/.cache/routing-gateway}
CHECK_TIMEOUT_S=${CHECK_TIMEOUT_S:-300}
LLAMA_VERSION=0.3.36  # as in scripts/setup.sh
SEED=1 CHECK=1 REBUILD_BASE=0 SOURCES=0
for arg in "$@"; do
  case $arg in
    --no-seed) SEED=0 ;;
    --no-check) CHECK=0 ;;
    --rebuild-base) REBUILD_BASE=1 ;;
    --sources) SOURCES=1 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
  esac
done

say() { printf '[image] %s\n' "$*"; }

# The Debian archive and security archive the base is made from: MIRROR's, else the ones this
# machine's apt uses (`apt-get indextargets` lists its sources as apt reads them, downloaded or not).
debian_uris() {
  if [ -n "${MIRROR:-}" ]; then
    printf '%s %s\n' "${MIRROR%/}/debian" "${MIRROR%/}/debian-security"
    return
  fi
  command -v apt-get >/dev/null || { echo "[image] error: no apt-get here: set MIRROR" >&2; return 1; }
  apt-get indextargets --no-release-info --format '$(TARGET_OF) $(REPO_URI) $(RELEASE)' | awk '
    $1 != "deb" { next }
    { uri = $2; sub(/\/+$/, "", uri) }
    $3 == "bookworm" && !archive { archive = uri }
    $3 == "bookworm-security" && !security { security = uri }
    uri ~ /\/debian$/ && !any_archive { any_archive = uri }
    uri ~ /\/debian-security$/ && !any_security { any_security = uri }
    END {
      if (!archive) archive = any_archive  # a Debian archive for another release serves bookworm too
      if (!archive) exit 1
      if (!security) security = any_security
      if (!security) { security = archive; sub(/\/debian$/, "/debian-security", security) }
      print archive, security
    }' || { echo "[image] error: no Debian archive in this machine's apt sources: set MIRROR" \
                 "(a host serving /debian and /debian-security)" >&2; return 1; }
}
uris=$(debian_uris) || exit 1
read -r DEBIAN_URI SECURITY_URI <<<"$uris"
APT_LINES=("deb $DEBIAN_URI bookworm main" "deb $DEBIAN_URI bookworm-updates main"
           "deb $SECURITY_URI bookworm-security main")
if [ "$SOURCES" = 1 ]; then printf '%s\n' "${APT_LINES[@]}"; exit 0; fi
[ "$(id -u)" = 0 ] || { echo "[image] error: run as root (buildah with vfs storage and chroot isolation)" >&2; exit 1; }
export BUILDAH_ISOLATION=chroot
BUILDAH=(buildah --storage-driver "${STORAGE_DRIVER:-vfs}")

# 1. Tools.
if ! command -v buildah >/dev/null || ! command -v mmdebstrap >/dev/null; then
  say "installing buildah and mmdebstrap with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends buildah mmdebstrap >/dev/null
fi

WORK=$(mktemp -d /var/tmp/build-image.XXXXXX)
RUNNER="" CTR=""
cleanup() {
  if [ -n "$RUNNER" ] && kill -0 "$RUNNER" 2>/dev/null; then
    kill -TERM -- "-$RUNNER" 2>/dev/null || true   # the process group this script started
    for _ in $(seq 30); do kill -0 "$RUNNER" 2>/dev/null || break; sleep 0.5; done
    kill -KILL -- "-$RUNNER" 2>/dev/null || true
  fi
  [ -z "$CTR" ] || "${BUILDAH[@]}" rm "$CTR" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT

# 2. The base: Debian bookworm minbase with Python 3.11, no docs or man pages (dpkg excludes them
#    for every package installed later too, build stage included).
if [ "$REBUILD_BASE" = 1 ] || ! "${BUILDAH[@]}" inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
  say "making $BASE_IMAGE with mmdebstrap (bookworm minbase, python3.11)"
  # merged-usr hook: /usr merged by symlinks, without the usrmerge package (and the perl it pulls in)
  if ! nice -n 19 mmdebstrap --variant=minbase --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
      --include=ca-certificates,python3.11,python3.11-venv,libgomp1,passwd \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/locale/*' \
      bookworm "$WORK/base.tar" "${APT_LINES[@]}" >"$WORK/mmdebstrap.log" 2>&1; then
    tail -n 20 "$WORK/mmdebstrap.log" >&2; exit 1
  fi
  base=$("${BUILDAH[@]}" from scratch)
  tar --numeric-owner -xpf "$WORK/base.tar" -C "$("${BUILDAH[@]}" mount "$base")"
  "${BUILDAH[@]}" umount "$base" >/dev/null
  "${BUILDAH[@]}" config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd /bin/bash "$base"
  previous=$("${BUILDAH[@]}" images --quiet --noheading "$BASE_IMAGE" 2>/dev/null || true)
  "${BUILDAH[@]}" commit --quiet --rm --format docker "$base" "$BASE_IMAGE" >/dev/null
  current=$("${BUILDAH[@]}" images --quiet --noheading "$BASE_IMAGE")
  [ -z "$previous" ] || [ "$previous" = "$current" ] ||
    "${BUILDAH[@]}" rmi "$previous" >/dev/null 2>&1 || true  # the base it replaced, now untagged
  rm -f "$WORK/base.tar"
fi

# 3. The build context: what git tracks or would track (never .venv or results), plus the seed.
mkdir "$WORK/context"
git ls-files -z --cached --others --exclude-standard | \
  tar --null --no-recursion --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$WORK/context"
seed_arg=()
if [ "$SEED" = 1 ]; then
  python=$(command -v python3.11 || command -v python3)
  flags=${LLAMA_CMAKE_ARGS:-$("$python" scripts/cpu_flags.py)}
  key=$(PYTHON="$python" LLAMA_CMAKE_ARGS="$flags" bash scripts/build-llama-tools.sh --key)
  build="llama.cpp-$LLAMA_VERSION-$key"  # scripts/build-llama-tools.sh's build, setup.sh's wheel
  if ls "$CACHE/$build"/wheel/llama_cpp_python-*.whl >/dev/null 2>&1 && [ -x "$CACHE/$build/build/bin/llama-server" ] \
      && grep -qx llama-server "$CACHE/$build/built"; then
    seed="$WORK/context/.image-seed"
    mkdir -p "$seed/$build/build/bin" "$seed/models"
    cp -a "$CACHE/$build/wheel" "$CACHE/$build/built" "$seed/$build/"
    # the libraries (their links too) and llama-server: what setup.sh copies into the venv
    cp -a "$CACHE/$build"/build/bin/lib*.so* "$CACHE/$build/build/bin/llama-server" "$seed/$build/build/bin/"
    for model in "$CACHE"/models/SmolLM2-135M-Instruct*.gguf "$CACHE"/models/qwen2.5-coder-0.5b-instruct*.gguf; do
      [ -f "$model" ] || continue
      cp -al "$model" "$seed/models/" 2>/dev/null || cp -a "$model" "$seed/models/"
    done
    seed_arg=(--build-arg SEED_DIR=.image-seed)
    say "seeding the build with $CACHE (key $key: llama.cpp libraries, llama-server, wheel, $(ls "$seed/models" | wc -l) model files)"
  else
    say "no setup cache for key $key at $CACHE: the build compiles llama.cpp (about 6 minutes on 2 cores)"
  fi
fi
flag_arg=()
[ -z "${LLAMA_CMAKE_ARGS:-}" ] || flag_arg=(--build-arg "LLAMA_CMAKE_ARGS=$LLAMA_CMAKE_ARGS")
# The build's RUN steps trust what this host trusts (a TLS-intercepting proxy's CA in front of
# PyPI, say): its CA bundle is bind-mounted over the base's, never committed to the image.
ca_arg=()
[ ! -f /etc/ssl/certs/ca-certificates.crt ] ||
  ca_arg=(--volume /etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro)

# 4. Build.
say "building $IMAGE on $BASE_IMAGE"
previous=$("${BUILDAH[@]}" images --quiet --noheading "$IMAGE" 2>/dev/null || true)
start=$(date +%s)
nice -n 19 "${BUILDAH[@]}" bud --isolation chroot --format docker --layers=false \
  --build-arg "BASE_IMAGE=$BASE_IMAGE" "${seed_arg[@]}" "${flag_arg[@]}" "${ca_arg[@]}" \
  -f "$WORK/context/Dockerfile" -t "$IMAGE" "$WORK/context"
build_s=$(( $(date +%s) - start ))
rm -rf "$WORK/context"
current=$("${BUILDAH[@]}" images --quiet --noheading "$IMAGE")
[ -z "$previous" ] || [ "$previous" = "$current" ] ||
  "${BUILDAH[@]}" rmi "$previous" >/dev/null 2>&1 || true  # the image it replaced, now untagged
# uncompressed: the sum of the image's layers as stored (what `docker images` calls its size)
size=$("${BUILDAH[@]}" inspect --type image "$IMAGE" |
       python3 -c 'import json,sys; print(sum(l["size"] for l in json.loads(json.load(sys.stdin)["Manifest"])["layers"]))')
say "built $IMAGE in ${build_s}s: $(numfmt --to=si --suffix=B "$size") ($size bytes, uncompressed layers)"
echo "RESULT build_s=$build_s"
echo "RESULT size_bytes=$size"
[ "$CHECK" = 1 ] || exit 0

# 5. Run it as its own user (chroot isolation shares this host's network: a free port is picked)
#    and check the health endpoint, with the image's own HEALTHCHECK command, and a chat completion.
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
CTR=$("${BUILDAH[@]}" from --quiet "$IMAGE")
eval "$("${BUILDAH[@]}" inspect --type image "$IMAGE" | python3 -c '
import json, shlex, sys
config = json.load(sys.stdin)["Docker"]["config"]
test = config["Healthcheck"]["Test"]
print("user=" + shlex.quote(config["User"]))
print("command=" + shlex.quote(shlex.join((config["Entrypoint"] or []) + (config["Cmd"] or []))))
print("health=" + shlex.quote(shlex.join(test[1:]) if test[0] == "CMD" else test[1]))')"
say "running '$command' as $user on port $port"
setsid "${BUILDAH[@]}" run --isolation chroot --user "$user" --env "GATEWAY_SERVER__PORT=$port" "$CTR" \
  -- sh -c "exec $command" >"$WORK/run.log" 2>&1 &
RUNNER=$!
mnt=$("${BUILDAH[@]}" mount "$CTR")
health_ok=fail
deadline=$(( $(date +%s) + CHECK_TIMEOUT_S ))
while [ "$(date +%s)" -lt "$deadline" ] && kill -0 "$RUNNER" 2>/dev/null; do
  # the image's HEALTHCHECK command, run inside the image's root as its user
  if chroot --userspec="$user" "$mnt" env -i PATH=/usr/bin:/bin "GATEWAY_SERVER__PORT=$port" \
      sh -c "$health" >/dev/null 2>&1; then
    health_ok=ok; break
  fi
  sleep 2
done
say "health check (/health/ready): $health_ok"
chat_ok=fail
if [ "$health_ok" = ok ]; then
  if python3 - "$port" >"$WORK/chat.out" 2>&1 <<'EOF'
import json, sys, urllib.request
port = sys.argv[1]
body = {"model": "smollm2-routed", "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16, "temperature": 0, "routing": {"policy": "always"}}
request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Authorization": "Bearer sk-demo", "Content-Type": "application/json"})
answer = json.load(urllib.request.urlopen(request, timeout=120))
routing = answer["usage"]["routing"]
print("answer:", repr(answer["choices"][0]["message"]["content"]))
print("routing:", json.dumps(routing))
assert answer["choices"][0]["message"]["content"], "empty answer"
assert routing["upstream_calls"] > 0 and routing["upstream_tokens"] > 0, "the embedded upstream was not used"
EOF
  then chat_ok=ok; fi
  sed 's/^/[image]   /' "$WORK/chat.out"
fi
say "chat completion (sk-demo, smollm2-routed, policy always): $chat_ok"
if [ "$health_ok$chat_ok" != okok ]; then
  say "container log (last 30 lines):"; tail -n 30 "$WORK/run.log" | sed 's/^/[image]   /'
fi
"${BUILDAH[@]}" umount "$CTR" >/dev/null
echo "RESULT health=$health_ok"
echo "RESULT chat=$chat_ok"
[ "$health_ok$chat_ok" = okok ]
