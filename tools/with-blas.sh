#!/bin/sh
# Run a command with the fastest BLAS we can give MLX's CPU backend, after one line saying which.
#
#     sh tools/with-blas.sh .venv/bin/python -m pytest
#
# The mlx[cpu] wheel links a reference BLAS (fp32 matmuls at ~2 GFLOP/s), so `make test` and
# `make demo` run about 4x slower on Linux than with OpenBLAS preloaded (its cblas_* symbols then
# take over). In order:
#   1. not Linux: nothing to do (MLX uses Metal and Accelerate on macOS);
#   2. OPENBLAS=off: keep MLX's own BLAS;
#   3. an installed OpenBLAS (Debian/Ubuntu libopenblas0-pthread or -openmp): preload it;
#   4. one unpacked earlier into $OPENBLAS_CACHE (default .cache/openblas): preload it;
#   5. apt-get present: download Debian's/Ubuntu's libopenblas0-pthread (and libgfortran5 when the
#      system lacks it) as .deb files and unpack them into $OPENBLAS_CACHE. No root needed and
#      nothing is installed system-wide; only as root with no terminal (CI, a container build) and
#      no package lists yet does it run `apt-get update` first;
#   6. otherwise MLX's reference BLAS, and the line says how to get the fast one.
set -eu

cache=${OPENBLAS_CACHE:-.cache/openblas}
triplet="$(uname -m)-linux-gnu"
hint="sudo apt-get install libopenblas0-pthread (tests and demo run about 4x faster)"

say() { echo "BLAS: $*" >&2; }

# True when the dynamic loader really preloads $1, with $2 searched for its dependencies (it only
# warns and goes on when it cannot).
loads() { [ -z "$(env LD_LIBRARY_PATH="${2:-${LD_LIBRARY_PATH:-}}" LD_PRELOAD="$1" true 2>&1)" ]; }

installed() {
    for lib in "/usr/lib/$triplet/libopenblas.so.0" "/usr/lib/$triplet/openblas-pthread/libopenblas.so.0" \
               "/usr/lib/$triplet/openblas-openmp/libopenblas.so.0"; do
        if [ -e "$lib" ]; then echo "$lib"; return 0; fi
    done
    return 1
}

unpacked() { echo "$PWD/$cache/usr/lib/$triplet/openblas-pthread/libopenblas.so.0"; }

has_lib() { [ -e "/usr/lib/$triplet/$1" ] || [ -e "/lib/$triplet/$1" ]; }

fetch() {
    command -v apt-get >/dev/null 2>&1 && command -v dpkg-deb >/dev/null 2>&1 || return 1
    pkgs="libopenblas0-pthread"
    has_lib libgfortran.so.5 || pkgs="$pkgs libgfortran5"
    has_lib libquadmath.so.0 || [ "$(uname -m)" != x86_64 ] || pkgs="$pkgs libquadmath0"
    tmp=$(mktemp -d)
    chmod 755 "$tmp"  # apt's sandbox user writes the files when run as root
    # shellcheck disable=SC2086
    if ! (cd "$tmp" && apt-get download -qq $pkgs) >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ] && [ ! -t 0 ]; then
            apt-get update -qq >/dev/null 2>&1 || true
            (cd "$tmp" && apt-get download -qq $pkgs) >/dev/null 2>&1 || { rm -rf "$tmp"; return 1; }
        else
            rm -rf "$tmp"; return 1
        fi
    fi
    mkdir -p "$cache"
    for deb in "$tmp"/*.deb; do dpkg-deb -x "$deb" "$cache"; done
    rm -rf "$tmp"
    [ -e "$(unpacked)" ]
}

if [ "$(uname -s)" != Linux ]; then
    exec "$@"
fi
if [ "${OPENBLAS:-}" = off ]; then
    say "MLX's bundled reference BLAS (OPENBLAS=off)"
    exec "$@"
fi
if lib=$(installed) && loads "$lib"; then
    say "OpenBLAS ($lib), preloaded for MLX's CPU backend"
    export LD_PRELOAD="$lib${LD_PRELOAD:+ $LD_PRELOAD}"
    exec "$@"
fi
lib=$(unpacked)
libdir="$PWD/$cache/usr/lib/$triplet"
if [ -e "$lib" ] || fetch; then
    if loads "$lib" "$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"; then
        say "OpenBLAS (the distribution's libopenblas0-pthread, unpacked in $cache; nothing installed" \
            "system-wide), preloaded for MLX's CPU backend"
        export LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export LD_PRELOAD="$lib${LD_PRELOAD:+ $LD_PRELOAD}"
        exec "$@"
    fi
fi
say "MLX's bundled reference BLAS (slow fp32); for the fast path: $hint"
exec "$@"
