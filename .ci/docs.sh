#!/usr/bin/env bash
# CI stage: the documentation site, built strictly, then opened in a real
# browser.
#   - installs kmp[cpu,docs,docs-browser] (into the active virtual
#     environment, as .ci/run's stage 1 leaves it; alone, into a fresh
#     .ci/venv-docs) and Debian's chromium when it is missing;
#   - builds the site with every guide and executed page run anew; -W makes
#     any warning an error (a broken link or reference, a public name without
#     a docstring or API entry, a guide that raises);
#   - opens the landing page, a guide, an API page and the performance page
#     in headless Chromium, checks their code blocks, images and tables, and
#     saves a screenshot of each to $KMP_CI_LOGS/docs (default .ci/logs/docs).
# `bash .ci/docs.sh --browser` installs the browser only (.ci/run does, in
# the background, while its first stage runs).
set -euo pipefail
cd "$(dirname "$0")/.."
started=$(date +%s)
logs=${KMP_CI_LOGS:-.ci/logs}
export TF_CPP_MIN_LOG_LEVEL=3 PIP_DISABLE_PIP_VERSION_CHECK=1

install_browser() {
  if [ ! -x /usr/bin/chromium ]; then
    echo "installing Debian's chromium"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium > /dev/null
  fi
}
if [ "${1:-}" = "--browser" ]; then
  install_browser
  exit 0
fi

if [ -z "${VIRTUAL_ENV:-}" ]; then
  rm -rf .ci/venv-docs
  python3 -m venv .ci/venv-docs
  # shellcheck disable=SC1091
  . .ci/venv-docs/bin/activate
fi
python -m pip install --quiet -e ".[cpu,docs,docs-browser]"
install_browser
echo "installed in $(( $(date +%s) - started )) s"

rm -rf docs/_build
KMP_DOCS_EXECUTE=force python -m sphinx -j auto -W --keep-going -q -b html \
  docs docs/_build/html
echo "built in $(( $(date +%s) - started )) s"
python .ci/docs_browser.py docs/_build/html "$logs/docs"
echo "docs stage passed in $(( $(date +%s) - started )) s"
