#!/usr/bin/env bash
# pip install through a shared wheelhouse: where WHEELHOUSE names a folder, the wheels are downloaded
# into it first (those already there are kept) and installed from it alone, so that the stacks and the
# fresh environments of CI download each wheel once; otherwise a plain pip install. Where the wheelhouse
# already holds everything asked for, it installs from it at once: no index round trips, and no re-reading
# of every cached wheel (~12 s a call for torch's). Unpinned requirements then take the wheelhouse's
# versions (CI's is made fresh in each clean clone).
#
#   bash scripts/pip_install.sh PYTHON PIP_INSTALL_ARGS...
set -euo pipefail
PY=$1
shift
if [ -n "${WHEELHOUSE:-}" ]; then
  "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" "$@" 2> /dev/null && exit 0
  "$PY" -m pip download -q -d "$WHEELHOUSE" "$@"
  exec "$PY" -m pip install -q --no-index --find-links "$WHEELHOUSE" "$@"
fi
exec "$PY" -m pip install -q "$@"
