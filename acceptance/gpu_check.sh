#!/usr/bin/env bash
# The GPU check (issue 8; docs/engines.md, "GPU check"), from a copy of the repository, offline:
#
#   bash acceptance/gpu_check.sh            # one GPU: a ~0.95B Llama, torch CUDA engine, 2 tasks (< 8 min)
#   bash acceptance/gpu_check.sh --smoke    # the same code path on CPU with a tiny model (< 3 min)
#   bash acceptance/gpu_check.sh --help     # every option (acceptance/gpu_check.py)
#
# Needs no install: the repository goes on PYTHONPATH. Python packages the node lacks come as
# wheels in acceptance/wheels/ (or $GPU_CHECK_WHEELS): each wheel that fits this Python is unpacked
# into a private directory appended to PYTHONPATH (packages the node has win). Stdout shows the
# report (`key: value [unit]` lines, then PASS or FAIL: ...); `--report FILE` writes it as JSON,
# the channel a program reads (libraries may log to stdout). The exit status is 0 on PASS,
# 1 on FAIL, 2 when the check refuses to run (one line on stderr: no CUDA without --smoke, or a
# package missing).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$(command -v python || command -v python3)}"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

wheels="${GPU_CHECK_WHEELS:-$repo/acceptance/wheels}"
if compgen -G "$wheels/*.whl" >/dev/null; then
  site="$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_wheels.XXXXXX")"
  trap 'rm -rf "$site"' EXIT
  "$python" - "$site" "$wheels"/*.whl <<'EOF'
import sys, zipfile
from pathlib import Path
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

site, wheels = Path(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
rank = {tag: i for i, tag in enumerate(sys_tags())}  # most specific first
best = {}
for wheel in wheels:
    name, version, _, tags = parse_wheel_filename(wheel.name)
    fit = min((rank[t] for t in tags if t in rank), default=None)
    if fit is not None and (name not in best or (version, -fit) > best[name][:2]):
        best[name] = (version, -fit, wheel)
for name, (version, _, wheel) in sorted(best.items()):
    zipfile.ZipFile(wheel).extractall(site)
    print(f"gpu_check: unpacked {wheel.name}", file=sys.stderr)
skipped = {canonicalize_name(parse_wheel_filename(w.name)[0]) for w in wheels} - set(best)
if skipped:
    print(f"gpu_check: no wheel fits this Python for {', '.join(sorted(skipped))}", file=sys.stderr)
EOF
  export PYTHONPATH="$PYTHONPATH:$site"
fi

"$python" "$repo/acceptance/gpu_check.py" "$@"
