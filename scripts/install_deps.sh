#!/usr/bin/env bash
# Install a supported stack and the development tools into a virtual environment (created if missing).
#
#   bash scripts/install_deps.sh [VENV [STACK]]        # default .venv 1.6
#
# STACK names a constraints file, torchrec_pgas/stacks/torchrec-STACK.txt: 1.6 (torch 2.11.0, FBGEMM 1.6.0,
# TorchRec 1.6.1; the GPU machine's) or 1.9 (torch 2.14.1, FBGEMM 1.9.0, TorchRec 1.9.2). It installs what
# a user's install does (README, "Install and supported stacks"): the package's requirements with the
# [gpu] extra where a GPU is visible, else [cpu] and TorchRec with --no-deps (its metadata asks for
# fbgemm-gpu, and the two FBGEMM flavours must never meet). The package goes in pure Python here;
# `make build` builds the extension in place. WHEELHOUSE=DIR shares downloaded wheels (scripts/pip_install.sh).
set -euo pipefail
VENV=${1:-.venv}
STACK=${2:-1.6}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONSTRAINTS=$ROOT/torchrec_pgas/stacks/torchrec-$STACK.txt
[ -f "$CONSTRAINTS" ] || { echo "no stack $STACK; stacks: $(ls "$ROOT/torchrec_pgas/stacks")" >&2; exit 2; }
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip_install() { bash "$ROOT/scripts/pip_install.sh" "$VENV/bin/python" "$@"; }

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=gpu
else
  FLAVOUR=cpu
fi
# torch 2.11 needs setuptools < 82, torch 2.14 >= 77.0.3.
pip_install "setuptools>=77.0.3,<82" wheel ninja
TORCH_PGAS_NO_CUDA=1 pip_install --no-build-isolation -c "$CONSTRAINTS" "$ROOT[$FLAVOUR,torchx,bench]" \
  pytest pytest-timeout build matplotlib==3.11.2
[ "$FLAVOUR" = gpu ] || pip_install --no-deps -c "$CONSTRAINTS" torchrec

# fbgemm 1.6.0 predates its own compatibility-table entry for torch 2.11 and
# warns on every import; add the entry (the same one the GPU devbundle carries).
"$VENV/bin/python" - <<'PY'
import importlib.util, pathlib
spec = importlib.util.find_spec("fbgemm_gpu")
init = pathlib.Path(spec.origin)
text = init.read_text()
if '"1.6": "2.11"' not in text:
    init.write_text(text.replace("_fbgemm_torch_compat_table = {", '_fbgemm_torch_compat_table = {\n    "1.6": "2.11",', 1))
PY
echo "installed (stack $STACK, $FLAVOUR): $("$VENV/bin/python" -c 'import torchrec_pgas.stack as s; print(s.installed().describe())')"
