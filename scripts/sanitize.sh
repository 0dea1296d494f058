#!/usr/bin/env bash
# The native kernel's tests on a build with AddressSanitizer and UBSan (docs/testing.md): every
# out-of-bounds read or write, use of freed memory and undefined behaviour in csrc/native.cpp stops
# the test that caused it with the sanitizer's report. Arguments go to pytest (default: the tests that
# run the native kernel). The sanitized build has its own folder in torch's extension cache.
set -euo pipefail
cd "$(dirname "$0")/.."
export MHA_NATIVE_SANITIZE=1
# ASan's runtime first; libstdc++ loaded at start too, or ASan's interceptor of C++ throws finds no real one
# ("CHECK failed ... real___cxa_throw") at torch's first exception
export LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)"
export ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=1"  # python itself never frees all
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
python -c "from mha.kernels import native; assert native.native_available(), 'the sanitized build failed'"
if [ "$#" -eq 0 ]; then
    set -- tests/kernels/test_native.py tests/kernels/test_defects.py tests/kernels/test_properties.py
fi
# the slow tests too (pyproject's addopts leave them out); a -m among the arguments replaces this one
python -m pytest -q -p no:cacheprovider -m "slow or not slow" "$@"
