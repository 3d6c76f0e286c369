#!/usr/bin/env bash
# Install everything (uv if missing, then the locked workspace) into ./.venv.
# CPU torch comes from the local wheel folder the lock points at (/opt/wheels); where that folder
# does not exist, the same lock's `cuda` group takes torch from PyPI instead.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v uv >/dev/null 2>&1; then
  python3 -m pip install --quiet "uv==0.13.9"
fi
# ffmpeg: relax-omni's audio-in-video (qwen-omni-utils reads a video's soundtrack through it). Installed with
# apt-get when missing and root is available; otherwise a note (only use_audio_in_video needs it).
if ! command -v ffmpeg >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -qq ffmpeg >/dev/null 2>&1 || { apt-get update -qq >/dev/null 2>&1 &&
      apt-get install -y -qq ffmpeg >/dev/null 2>&1; }) ||
      echo "install: could not apt-get ffmpeg; relax-omni's use_audio_in_video will be unavailable" >&2
  else
    echo "install: no ffmpeg (needs root + apt-get); relax-omni's use_audio_in_video will be unavailable" >&2
  fi
fi
export UV_COMPILE_BYTECODE=1
if compgen -G "/opt/wheels/torch-2.13.0+cpu-*.whl" >/dev/null; then
  uv sync --frozen "$@"
else
  echo "install: /opt/wheels has no CPU torch wheel; using PyPI torch (group cuda)" >&2
  uv sync --frozen --no-group cpu --group cuda "$@"
fi
# The workspace's own packages are editable installs, which UV_COMPILE_BYTECODE skips: compile them too, so
# that every process (Ray workers included) reads their bytecode even where PYTHONDONTWRITEBYTECODE is set.
.venv/bin/python -m compileall -q packages/*/src >/dev/null
