#!/usr/bin/env bash
# Install the pinned stack into a virtual environment (created if missing).
#
#   bash scripts/install_deps.sh [VENV]        # default .venv
#
# torch 2.11.0 (CUDA 13.0 wheel; it runs on CPU too), fbgemm-gpu 1.6.0 where a
# GPU is visible, else fbgemm-gpu-cpu 1.6.0 (never both), torchrec 1.6.1 with
# --no-deps (its unpinned fbgemm-gpu dependency would pull 1.9 and break).
set -euo pipefail
VENV=${1:-.venv}
PYTHON=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FBGEMM=fbgemm-gpu==1.6.0
else
  FBGEMM=fbgemm-gpu-cpu==1.6.0
fi
"${PIP[@]}" "setuptools>=70,<82" wheel ninja
"${PIP[@]}" torch==2.11.0 "$FBGEMM" numpy
"${PIP[@]}" --no-deps torchrec==1.6.1 tensordict==0.12.4 pyvers==0.2.3 iopath==0.1.9 portalocker==4.4.2
"${PIP[@]}" torchmetrics==1.0.3 pyre-extensions tqdm pyyaml tabulate cloudpickle orjson packaging \
  importlib-metadata pytest pytest-timeout matplotlib==3.11.2
# torchx 0.7.0 (the last release) pins urllib3<1.27; the nightly installs cleanly.
"${PIP[@]}" torchx-nightly==2026.10.26

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
echo "installed: $("$VENV/bin/python" -c 'import torch, torchrec; print("torch", torch.__version__, "torchrec", torchrec.__version__)' 2>/dev/null)"
