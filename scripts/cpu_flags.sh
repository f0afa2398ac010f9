# Sourced: export GGML_* CMake options matching this CPU (x86-64 Linux). Values already in the
# environment win. AMX is always off: ggml's AMX kernels segfault on these VMs.
if [ -r /proc/cpuinfo ] && grep -q '^flags' /proc/cpuinfo; then
  _flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  _set() { # _set GGML_NAME cpuinfo-flag
    local v=OFF; case "$_flags" in *" $2 "*) v=ON ;; esac
    [ -n "${!1:-}" ] || export "$1=$v"
  }
  _set GGML_AVX avx; _set GGML_AVX2 avx2; _set GGML_FMA fma; _set GGML_F16C f16c
  _set GGML_BMI2 bmi2; _set GGML_AVX512 avx512f; _set GGML_AVX512_VNNI avx512_vnni
  _set GGML_AVX_VNNI avx_vnni
  export GGML_AMX_TILE=OFF GGML_AMX_INT8=OFF GGML_AMX_BF16=OFF
  unset _flags; unset -f _set
fi
