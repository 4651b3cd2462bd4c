#!/usr/bin/env bash
# Load RUN/report.html in headless Chromium: it must load with no console message at all (the
# page has no script, so any message is an error) and render; the screenshot is kept for a look.
# Usage: scripts/report_browser_check.sh RUN [SCREENSHOT.png]
# Without chromium it prints SKIPPED and succeeds (the structural tests still ran in cargo test).
set -euo pipefail
run=${1:?usage: $0 RUN [SCREENSHOT.png]}
shot=${2:-$run/report.png}
page="$(cd "$run" && pwd)/report.html"
browser=$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)
if [ -z "$browser" ]; then
    echo "*** SKIPPED: report browser check (no chromium; apt-get install chromium) ***"
    exit 0
fi
[ -f "$page" ] || { echo "no $page (run ganymede report $run first)"; exit 1; }
log=$(mktemp)
timeout 120 "$browser" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --enable-logging=stderr --v=0 --window-size=1400,3000 \
    --screenshot="$shot" "file://$page" >/dev/null 2>"$log"
if grep -q ':CONSOLE' "$log"; then
    echo "report browser check: console messages:"
    grep ':CONSOLE' "$log"
    exit 1
fi
[ -s "$shot" ] || { echo "report browser check: no screenshot"; cat "$log"; exit 1; }
echo "report browser check: $page loaded with no console messages; screenshot $shot"
