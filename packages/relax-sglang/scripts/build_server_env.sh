#!/usr/bin/env bash
# Build (or reuse) the cached SGLang server venv for CPU testing and print its python interpreter.
#
#   packages/relax-sglang/scripts/build_server_env.sh            -> /root/.cache/relax/sglang-server-<hash>/bin/python
#   RELAX_SGLANG_ENV=/some/dir build_server_env.sh                -> builds there instead
#
# The venv is synced from ../server/uv.lock (sglang 0.5.23 on CPU torch 2.13, no CUDA stack), then the CPU
# shims from ../server/cpu_shims/ are copied into its site-packages (see relax_sglang_cpu_shims.py for what
# each replaces and why), with the patch loader they use (relax/sglang/server_site; launched servers also get
# Relax's server patches from there through PYTHONPATH). The directory name hashes the lock, the project
# file, the shims and that loader, so a change rebuilds; a finished build is marked by .relax-ready and reused as is. Builds go to a temp dir
# renamed into place, so an interrupted build is never mistaken for a finished one.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
server="$(cd "$here/../server" && pwd)"
# the patch loader: in the source tree beside src/, in an installed wheel at relax/sglang/server_site (this
# script is relax/sglang/server_files/scripts/ there; see pyproject.toml)
site_dir="$here/../src/relax/sglang/server_site"
[[ -d "$site_dir" ]] || site_dir="$here/../../server_site"
patches="$(cd "$site_dir" && pwd)/relax_sglang_server_patches.py"
hash="$(cat "$server/uv.lock" "$server/pyproject.toml" "$server"/cpu_shims/*.py "$server"/cpu_shims/*.pth \
  "$server"/cpu_shims/sgl_kernel/*.py "$patches" | sha256sum | cut -c1-12)"
env_dir="${RELAX_SGLANG_ENV:-${HOME}/.cache/relax/sglang-server-${hash}}"

if [[ -f "$env_dir/.relax-ready" ]]; then
  echo "$env_dir/bin/python"
  exit 0
fi

command -v uv >/dev/null || { echo "build_server_env.sh: uv is not on PATH (https://docs.astral.sh/uv/)" >&2; exit 2; }
mkdir -p "$(dirname "$env_dir")"
tmp="$(mktemp -d "${env_dir}.building.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT

echo "building the SGLang server venv in $env_dir (a few minutes, downloads from PyPI)" >&2
UV_PROJECT_ENVIRONMENT="$tmp" uv sync --frozen --no-install-project --project "$server" --python 3.11 >&2

site="$("$tmp/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
cp "$server/cpu_shims/relax_sglang_cpu_shims.py" "$server/cpu_shims/relax_sglang_cpu_shims.pth" "$patches" "$site/"
cp -r "$server/cpu_shims/sgl_kernel" "$site/"
# fails here, not at first launch; and writes the bytecode of what a launch imports (server.py lets launches
# write the rest), whatever PYTHONDONTWRITEBYTECODE says: a launch then imports in half the time
PYTHONDONTWRITEBYTECODE= "$tmp/bin/python" -c 'import sglang.srt.entrypoints.http_server' >&2

touch "$tmp/.relax-ready"
rm -rf "$env_dir"
mv "$tmp" "$env_dir"
trap - EXIT
# a venv's scripts name their own path: point them at the final location
sed -i "s#$tmp#$env_dir#g" "$env_dir"/bin/activate* 2>/dev/null || true
echo "$env_dir/bin/python"
