#!/usr/bin/env bash
# Prints the absolute path of a Python >= 3.12 interpreter, or fails with a clear message.
# Order: python3.13, python3.12, python3 on PATH; then any 3.12+ installed under pyenv.
set -u
ok() { "$@" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' >/dev/null 2>&1; }
for cand in python3.13 python3.12 python3; do
  if command -v "$cand" >/dev/null 2>&1 && ok "$cand"; then
    "$cand" -c 'import sys; print(sys.executable)'; exit 0
  fi
done
if command -v pyenv >/dev/null 2>&1; then
  for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9]|[2-9][0-9])(\.[0-9]+)?$' | sort -rV); do
    mm=$(echo "$v" | cut -d. -f1,2)
    if PYENV_VERSION="$v" ok "python$mm"; then
      PYENV_VERSION="$v" "python$mm" -c 'import sys; print(sys.executable)'; exit 0
    fi
  done
fi
echo "error: paged_kv needs Python >= 3.12; none found (tried python3.13, python3.12, python3 and pyenv versions)." >&2
echo "       install one (e.g. 'pyenv install 3.12') and rerun." >&2
exit 1
