#!/usr/bin/env bash
# The GPU check lives in acceptance/ (an acceptance check, not a benchmark); this name runs it too.
#   bash bench/gpu_check.sh [--smoke] [...]    # = bash acceptance/gpu_check.sh [--smoke] [...]
exec bash "$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/acceptance/gpu_check.sh" "$@"
