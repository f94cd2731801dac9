#!/usr/bin/env bash
# The main job in one command, on a fresh machine: install, start `prefixgate serve` on the
# built-in tiny-random model (dummy weights: its text is gibberish by design), make a client
# call with the SDK, stop the server. Binds to 127.0.0.1 only. PORT=8000 by default.
set -euo pipefail
cd "$(dirname "$0")/.."
# It installs into the first python3 on PATH: refuse the system's own interpreter (a new shell
# without `. .venv/bin/activate` got torch and prefixgate installed into it), unless asked to.
if [ -z "${DEMO_ANY_PYTHON:-}" ] && ! python3 -c 'import os, sys; sys.exit(sys.prefix == sys.base_prefix and not os.environ.get("CONDA_PREFIX"))'; then
    echo "demo.sh: $(command -v python3) is not a virtual environment, and demo.sh installs torch and prefixgate into it; make and activate one first (python3 -m venv .venv && . .venv/bin/activate), or run DEMO_ANY_PYTHON=1 $0 to install there anyway" >&2
    exit 1
fi
PORT="${PORT:-8000}"
# The demo must talk to the server it starts: refuse a port something already listens on
# (before the installs, so the refusal comes at once).
if python3 -c 'import socket, sys; s = socket.socket(); s.settimeout(1); sys.exit(s.connect_ex(("127.0.0.1", int(sys.argv[1]))) != 0)' "$PORT"; then
    echo "demo.sh: something already listens on 127.0.0.1:$PORT; stop it or run PORT=<free port> $0" >&2
    exit 1
fi
python3 -m pip install -q torch==2.13.0              # the CPU wheel; a bare `torch` pulls CUDA
python3 -m pip install -q -e '.[engine]'
prefixgate serve --host 127.0.0.1 --port "$PORT" &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true' EXIT
python3 - "$PORT" "$SERVER" <<'PY'
import os, sys, time, urllib.request
url, pid = f"http://127.0.0.1:{sys.argv[1]}/ready", int(sys.argv[2])
for _ in range(240):
    try:
        os.kill(pid, 0)  # our server still runs: whatever answers below is it
    except ProcessLookupError:
        sys.exit(f"the demo's server (pid {pid}) exited before it was ready (see its log above)")
    try:
        urllib.request.urlopen(url, timeout=1)
        break
    except Exception:
        time.sleep(0.5)
else:
    sys.exit(f"server did not become ready at {url}")
PY
PREFIXGATE_BASE_URL="http://127.0.0.1:$PORT/v1" python3 examples/quickstart.py
