#!/usr/bin/env bash
# Builds shoal with `--features cuda` on a machine without a CUDA toolkit (and without a
# GPU): the compiler and headers come from PyPI wheels (nvidia-cuda-nvcc 13.x and
# friends), installed into a virtualenv outside the repository ($CUDA_VENV, default
# ~/.cache/shoal-cuda, ~1.5 GB). The binary lands in target/cuda/release/shoal and runs
# only where the NVIDIA driver (libcuda.so.1) is installed.
#
#   scripts/cuda-build.sh            # CUDA_COMPUTE_CAP=90 (H100/H200) unless set
#
# What it sets, and why (LIBRARY-NOTES.md): PATH/CUDA_ROOT/CUDA_PATH/CUDA_HOME point at the
# wheels' toolkit; CUDA_COMPUTE_CAP because there is no GPU to ask; CUDARC_CUDA_VERSION
# because cudarc 0.19 does not know CUDA 13.5 by name; unversioned symlinks of the runtime
# libraries (the wheels ship only .so.13); and, where no driver is installed, a link-time
# stub of libcuda.so.1 built from the cu* symbols cudarc declares. The stub is never
# shipped: at run time the driver's own libcuda.so.1 is loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${CUDA_VENV:-$HOME/.cache/shoal-cuda}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export CUDARC_CUDA_VERSION=${CUDARC_CUDA_VERSION:-$(echo "${CUDA_WHEELS:-13.0}" | awk -F. '{printf "%d%02d0", $1, $2}')}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
# The toolkit's minor version must not be newer than the driver's where the binary runs:
# candle's kernels travel as PTX, which a driver refuses from a newer nvcc. 13.0 suits
# drivers 580+; CUDA_WHEELS=13.4 (say) for newer drivers.
CV=${CUDA_WHEELS:-13.0}
"$VENV/bin/pip" install -q --disable-pip-version-check "nvidia-cuda-nvcc==$CV.*" \
  "nvidia-cuda-runtime==$CV.*" "nvidia-cublas==$CV.*" "nvidia-curand==10.4.0.*" \
  "nvidia-cuda-cccl==$CV.*" "nvidia-cuda-nvrtc==$CV.*" "nvidia-nvvm==$CV.*" "nvidia-cuda-crt==$CV.*"
ROOT=$("$VENV/bin/python" - <<'PY'
import glob, os, nvidia
for base in nvidia.__path__:
    for d in sorted(glob.glob(os.path.join(base, "cu*"))):
        if os.path.exists(os.path.join(d, "bin", "nvcc")):
            print(d)
            raise SystemExit
raise SystemExit("no nvcc in the nvidia-cuda-nvcc wheel")
PY
)
export PATH=$ROOT/bin:$PATH CUDA_ROOT=$ROOT CUDA_PATH=$ROOT CUDA_HOME=$ROOT
LIBDIR=$VENV/shoal-link
mkdir -p "$LIBDIR"
for l in cublas cublasLt cudart curand nvrtc; do
  f=$(ls "$ROOT"/lib/lib$l.so.* 2>/dev/null | head -1)
  [ -n "$f" ] || { echo "no lib$l in $ROOT/lib" >&2; exit 1; }
  ln -sf "$f" "$LIBDIR/lib$l.so"
done
if ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1'; then
  cargo fetch --quiet
  SYS=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/cudarc-0.19.*/src/driver/sys/mod.rs 2>/dev/null | tail -1)
  [ -n "$SYS" ] || { echo "cudarc's sources are not in the cargo registry" >&2; exit 1; }
  grep -oE 'fn cu[A-Za-z0-9_]+\(' "$SYS" | sort -u | sed -E 's/fn (cu[A-Za-z0-9_]+)\(/int \1(void){return 999;}/' >"$LIBDIR/libcuda-stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$LIBDIR/libcuda.so" "$LIBDIR/libcuda-stub.c"
  echo "no NVIDIA driver here: linking against a stub libcuda.so.1 (the binary needs the real one to run)"
fi
RUSTFLAGS="-L $LIBDIR" cargo build --release --features cuda --target-dir target/cuda
echo "built target/cuda/release/shoal (CUDA, compute capability $CUDA_COMPUTE_CAP)"
