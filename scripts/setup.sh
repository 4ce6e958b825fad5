#!/usr/bin/env bash
# Installs everything SPACE needs on Debian 12, as root, idempotently:
# Debian packages, a Python virtualenv with the project and its dev tools in .venv,
# and the `base` guest image (cached by content hash in /var/cache/space/images).
set -euo pipefail
cd "$(dirname "$0")/.."

say() { printf '[setup %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

if [ "$(id -u)" -ne 0 ]; then
  echo "setup.sh must run as root: SPACE manages VMs, btrfs pools and loop devices" >&2
  exit 1
fi

# python3-ipykernel and the like: the code interpreter's server (templates/), tested on
# the host too (tests/unit/test_code_interpreter_server.py).
debian_packages=(
  python3 python3-venv python3-dev gcc ca-certificates
  qemu-system-x86 qemu-utils
  debootstrap busybox-static e2fsprogs cpio zstd xz-utils kmod dpkg-dev
  btrfs-progs util-linux
  nftables iproute2
  postgresql
  python3-ipykernel python3-jupyter-client python3-matplotlib
)
missing=()
for p in "${debian_packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  # PostgreSQL is for the control plane's shared database and the tests' own throwaway
  # servers (issue 19): the package must not make and start a cluster of its own.
  mkdir -p /etc/postgresql-common/createcluster.d
  echo 'create_main_cluster = false' > /etc/postgresql-common/createcluster.d/space.conf
  say "installing Debian packages: ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

# The node agent runs as this user once its root broker runs (issue 18: `space serve`
# and `space node` started as root drop to it).
if ! id -u space >/dev/null 2>&1; then
  say "creating the system user space (the node agent runs as it)"
  useradd --system --user-group --no-create-home --home-dir /nonexistent \
    --shell /usr/sbin/nologin space
fi

# QEMU >= 8.2: a jailed QEMU maps a ready state's RAM file copy-on-write from a
# read-only descriptor (memory-backend-file rom=off). Debian 12 ships 7.2; its backports
# suite has a current one. The backports source reuses the mirror the system already has.
if ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' qemu-system-x86)" ge 1:8.2; then
  codename="$(. /etc/os-release && echo "$VERSION_CODENAME")"
  say "installing QEMU from ${codename}-backports (the jail needs QEMU >= 8.2)"
  python3 scripts/backports_source.py "$codename" > /etc/apt/sources.list.d/space-backports.sources
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -t "${codename}-backports" qemu-system-x86 qemu-utils
fi

# gVisor's runsc (issue 21: the `gvisor` guest type) from the backports suite too:
# 0.0~20240729 there against 0.0~20221219 in Debian 12. Both start `runsc do true` in
# 0.15-0.22 s here (ptrace platform); the newer spawns a process inside in 7.7 ms
# against 9.6 ms, is 20 months of fixes newer, and has --overlay2=none (the guest
# writes into its btrfs volume). Its systrap platform is slower on this host (17.6 ms)
# and KVM spins under PVM, so nodes run ptrace (space/node/privileged/_gvisor.py).
if ! dpkg --compare-versions "$(dpkg-query -W -f='${Version}' runsc 2>/dev/null || echo 0)" ge 0.0~20240729; then
  codename="$(. /etc/os-release && echo "$VERSION_CODENAME")"
  say "installing runsc (gVisor) from ${codename}-backports"
  python3 scripts/backports_source.py "$codename" > /etc/apt/sources.list.d/space-backports.sources
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
    -t "${codename}-backports" runsc
fi

# The venv is rebuilt only when pyproject.toml or the Python changes (their hash is the
# stamp). Its 480 MB take 1.5 minutes to install, so a machine keeps one built venv per
# hash in /var/cache/space/venvs, and a checkout links it (seconds), points its
# scripts at its own copy, and installs only its own code (editable) into it.
key="$( (cat pyproject.toml; /usr/bin/python3 --version) | sha256sum | cut -c1-16)"
stamp=".venv/.space-setup-$key"
if [ ! -e "$stamp" ]; then
  cached="/var/cache/space/venvs/$key"
  mkdir -p /var/cache/space/venvs
  (
    flock 9  # one setup builds it; another waits and links it
    if [ ! -e "$cached/.complete" ]; then
      say "building the venv of $(/usr/bin/python3 --version) and the dependencies in $cached"
      rm -rf "$cached"
      /usr/bin/python3 -m venv "$cached"
      "$cached/bin/pip" install -q --upgrade pip
      "$cached/bin/pip" install -q -e '.[dev]'
      # Wheels of the base install's dependencies (the SDK and client CLI) and of the
      # build backend, so tests/unit/test_sdk_alone.py installs the SDK alone offline.
      "$cached/bin/python" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > "$cached/sdk-requirements.txt"
      "$cached/bin/pip" download -q -d "$cached/sdk-wheels" -r "$cached/sdk-requirements.txt" 'setuptools>=70.1'
      touch "$cached/.complete"
      # The two newest are kept (another checkout may be on the previous pyproject).
      find /var/cache/space/venvs -mindepth 1 -maxdepth 1 -type d -printf '%T@ %p\n' \
        | sort -rn | tail -n +3 | cut -d' ' -f2- | xargs -r rm -rf
    fi
    say "linking .venv from $cached"
    rm -rf .venv
    # Hard links: pip and sed -i replace a file, never write into it, so the cache's
    # files stay as built.
    cp -al "$cached" .venv
  ) 9>/var/cache/space/venvs/.lock
  rm .venv/.complete
  # A venv names its own path in its scripts' first lines: this copy's now.
  for script in .venv/bin/*; do
    if [ -f "$script" ] && grep -qI "^#!$cached/bin/" "$script"; then
      sed -i "1s|^#!$cached/|#!$PWD/.venv/|" "$script"
    fi
  done
  sed -i "s|$cached|$PWD/.venv|g" .venv/bin/activate*
  .venv/bin/pip install -q --no-deps -e .  # this checkout's code, not the builder's
  touch "$stamp"
fi

# The real E2B SDK in a venv of its own (tests/e2b_sdk.py runs scripts in it).
scripts/e2b_sdk_venv.sh

say "building the base guest image (reused at once when unchanged)"
.venv/bin/space template build-base

# The .debs of templates/code-interpreter as a flat apt repository, so its build test
# fetches nothing from the internet (cached by package list and base dpkg status).
say "caching the code interpreter template's packages"
.venv/bin/python -m tests.code_interpreter_debs
say "setup done"
