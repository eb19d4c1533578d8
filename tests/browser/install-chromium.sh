#!/bin/sh
# Installs Debian's chromium for the browser tier when it is missing (`make chromium`).
# Playwright drives this system browser (executable_path); nothing is ever downloaded by
# `playwright install`. Fails, naming the cause, when chromium cannot be installed: the
# browser tier is never skipped.
set -eu
CHROMIUM="${CHROMIUM:-/usr/bin/chromium}"

if [ -x "$CHROMIUM" ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install-chromium: $CHROMIUM is missing and this is not root (no sudo either):" \
             "run 'apt-get install -y chromium' as root" >&2
        exit 1
    fi
else
    SUDO=""
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install-chromium: $CHROMIUM is missing and there is no apt-get here:" \
         "install Chromium and set CHROMIUM=/path/to/it" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# chromium, and a font so that the page's text renders the same everywhere.
PACKAGES="chromium fonts-dejavu-core"
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
echo "install-chromium: $CHROMIUM is missing; apt-get install $PACKAGES"
# A fresh machine may have no package lists, or lists older than the mirror: install from
# what is there first, and update the lists only when that fails.
if ! $SUDO apt-get install -y -qq --no-install-recommends $PACKAGES >"$LOG" 2>&1; then
    if ! $SUDO apt-get update -qq >>"$LOG" 2>&1; then
        echo "install-chromium: apt-get update failed:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
    if ! $SUDO apt-get install -y -qq --no-install-recommends $PACKAGES >>"$LOG" 2>&1; then
        echo "install-chromium: apt-get install $PACKAGES failed:" >&2
        tail -n 20 "$LOG" >&2
        exit 1
    fi
fi
if [ ! -x "$CHROMIUM" ]; then
    echo "install-chromium: apt-get installed chromium, but $CHROMIUM is not there" >&2
    exit 1
fi
"$CHROMIUM" --version 2>/dev/null
